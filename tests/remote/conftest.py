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


@pytest.fixture
def redis_server(tmp_path_factory):
    if REDIS is None:
        pytest.skip("redis-server is not installed (`make redis` installs it)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.kill()


# --- a real Redis Cluster: three primaries, a replica each ------------------------------


def _cluster(tmp_path_factory):
    if REDIS is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli are needed for the cluster tests (`make redis` installs both)")
    cluster = Cluster(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.kill()


# One cluster per module for the tests that leave it whole; `cluster` empties it first.
redis_cluster_of_module = pytest.fixture(_cluster, scope="module", name="redis_cluster_of_module")
own_redis_cluster = pytest.fixture(_cluster, name="own_redis_cluster")  # for a test that kills or pauses nodes


@pytest.fixture
def redis_cluster(redis_cluster_of_module):
    redis_cluster_of_module.flushall()
    return redis_cluster_of_module


# --- a primary, its replica and three Sentinels ------------------------------------------


def _sentinels(tmp_path_factory):
    if REDIS is None:
        pytest.skip("redis-server is not installed (`make redis` installs it)")
    group = SentinelGroup(tmp_path_factory.mktemp("redis-sentinel")).start()
    try:
        yield group
    finally:
        group.kill()


sentinels_of_module = pytest.fixture(_sentinels, scope="module", name="sentinels_of_module")
own_sentinels = pytest.fixture(_sentinels, name="own_sentinels")  # for a test that fails the primary over


@pytest.fixture
def redis_sentinels(sentinels_of_module):
    sentinels_of_module.flushall()
    return sentinels_of_module
