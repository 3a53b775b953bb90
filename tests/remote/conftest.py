"""A real redis-server on a free loopback port, in a temporary directory, for the
remote-tier tests; killed (and restartable) by the tests that fault it. The
processes are started by promptstore.testing.redis_cluster (the soak uses it too)
and, for a primary the Sentinels watch, promptstore.testing.redis_sentinel."""

from __future__ import annotations

import pytest

from promptstore.testing.redis_cluster import (
    BUS_OFFSET,
    CLUSTER_ARGS,
    CLUSTER_SECONDS,
    REDIS,
    REDIS_CLI,
    START_SECONDS,
    Cluster,
    RedisServer,
    free_cluster_port,
    free_port,
)
from promptstore.testing.redis_sentinel import SentinelGroup

__all__ = [
    "BUS_OFFSET",
    "CLUSTER_ARGS",
    "CLUSTER_SECONDS",
    "REDIS",
    "REDIS_CLI",
    "START_SECONDS",
    "Cluster",
    "RedisServer",
    "free_cluster_port",
    "free_port",
]


def running(kind, directory, **options):
    """A fixture's body: `kind(directory, **options)` started (skipped, saying why,
    where its binaries are missing) for the tests, and killed after them."""
    needs = ("redis-server", "redis-cli") if kind is Cluster else ("redis-server",)
    absent = [name for name, path in (("redis-server", REDIS), ("redis-cli", REDIS_CLI)) if name in needs and not path]
    if absent:
        pytest.skip(
            f"{' and '.join(absent)} not installed (`make redis` installs {'both' if len(absent) > 1 else 'it'})"
        )
    servers = kind(directory, **options).start()
    try:
        yield servers
    finally:
        servers.kill()


@pytest.fixture
def redis_server(tmp_path_factory):
    yield from running(RedisServer, tmp_path_factory.mktemp("redis"))


# --- a real Redis Cluster: three primaries, a replica each ------------------------------


def _cluster(tmp_path_factory):
    yield from running(Cluster, tmp_path_factory.mktemp("redis-cluster"))


# One cluster per module for the tests that leave it whole; `cluster` empties it first.
redis_cluster_of_module = pytest.fixture(_cluster, scope="module", name="redis_cluster_of_module")
own_redis_cluster = pytest.fixture(_cluster, name="own_redis_cluster")  # for a test that kills or pauses nodes


@pytest.fixture
def redis_cluster(redis_cluster_of_module):
    redis_cluster_of_module.flushall()
    return redis_cluster_of_module


# --- a primary, its replica and three Sentinels ------------------------------------------


def _sentinels(tmp_path_factory):
    yield from running(SentinelGroup, tmp_path_factory.mktemp("redis-sentinel"))


sentinels_of_module = pytest.fixture(_sentinels, scope="module", name="sentinels_of_module")
own_sentinels = pytest.fixture(_sentinels, name="own_sentinels")  # for a test that fails the primary over


@pytest.fixture
def redis_sentinels(sentinels_of_module):
    sentinels_of_module.flushall()
    return sentinels_of_module
