"""The remote tier over TLS, against real redis-server processes that speak only
TLS (certificates made in process): one server (rediss://), a primary that
Sentinels watch (rediss+sentinel://) and a cluster (rediss+cluster://) each
carry a node in pieces (values read off the encrypted socket into place) from
store A to store B, restored with the logits of a full prefill. A store that
does not trust the server's certificate, or speaks plain text to it, gets a
bounded, reported miss and works on locally."""

from __future__ import annotations

import time

import pytest

import promptstore
from promptstore.testing.redis_cluster import Cluster, RedisServer
from promptstore.testing.redis_sentinel import SentinelGroup
from promptstore.testing.tls import make_certificates

from ..conftest import prompt_tokens
from .conftest import running
from .helpers import assert_faithful
from .test_pieces import PIECE, fetch, publish_in_pieces

HANG_GUARD = 30.0  # seconds: only a missing timeout makes one fetch take this long


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certificates):
    yield from running(RedisServer, tmp_path_factory.mktemp("redis-tls"), tls=certificates)


@pytest.fixture(scope="module")
def tls_sentinels(tmp_path_factory, certificates):
    yield from running(SentinelGroup, tmp_path_factory.mktemp("sentinel-tls"), tls=certificates)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, certificates):
    yield from running(Cluster, tmp_path_factory.mktemp("cluster-tls"), tls=certificates)


@pytest.mark.parametrize("deployment", ["tls_server", "tls_sentinels", "tls_cluster"])
def test_a_node_in_pieces_crosses_tls_whole(tmp_path, request, model_of, deployment):
    target = request.getfixturevalue(deployment)
    assert target.url.startswith(("rediss://", "rediss+sentinel://", "rediss+cluster://"))
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=71)
    counts = publish_in_pieces(tmp_path / "a", target.url, model, tokens[:280])
    assert counts["remote_published"] == 1 and not counts.get("remote_publish_failed")
    hit, reasons, _ = fetch(tmp_path / "b", target.url, model, tokens)
    assert (hit.length, hit.remote_tokens) == (280, 280) and not reasons
    assert hit.nbytes > 2 * PIECE, "the node did not go in several pieces"
    assert_faithful(model, hit, tokens)


@pytest.mark.parametrize("how", ["untrusted certificate", "plain text"])
def test_a_server_this_store_cannot_speak_tls_to_is_a_bounded_miss(tmp_path, tls_server, model_of, how):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=72)
    if how == "untrusted certificate":  # the system's authorities, which never signed it
        url = f"rediss://127.0.0.1:{tls_server.port}/0"
    else:
        url = f"redis://127.0.0.1:{tls_server.port}/0"
    counts = publish_in_pieces(tmp_path / "a", url, model, tokens[:280])
    assert counts["remote_publish_failed"] == 1
    with promptstore.PromptStore.open(tmp_path / "a", remote_url=url, remote_timeout=0.5) as a:
        space = a.bind(model, model_id="m")
        started = time.monotonic()
        hit = space.fetch(tokens)
        assert time.monotonic() - started < HANG_GUARD
        assert hit.length == 280 and hit.remote_tokens == 0  # its own node, from its local tiers
        assert_faithful(model, hit, tokens)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=url, remote_timeout=0.5) as b:
        started = time.monotonic()
        assert b.bind(model, model_id="m").fetch(tokens).length == 0
        assert time.monotonic() - started < HANG_GUARD
        assert b.remote.counts.get("remote_down", 0) > 0
