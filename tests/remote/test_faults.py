"""The server killed in the middle of a fetch, a lookup and a publish, restarted
empty, paused, full, or answering garbage: every local operation keeps working,
the caller sees a miss (reported), never an exception or a wrong state."""

import signal
import time

import mlx.core as mx
import pytest

import promptstore
from promptstore.snapshots.remote import CHUNK, RemoteTier
from promptstore.snapshots.remote.keys import BLOB_PREFIX, INDEX_PREFIX

from ..conftest import forward, prompt_tokens
from .conftest import RedisServer, free_cluster_port
from .helpers import assert_faithful, publish

HANG_GUARD = 30.0  # seconds: only a missing timeout takes this long (the waits here are ~0.2 s)


def _reasons(store) -> set[str]:
    return {r.reason for r in store.reports}


def _kill_first(monkeypatch, server, method: str):
    """Kill the real server the first time RemoteTier.<method> runs, then run it."""
    original = getattr(RemoteTier, method)
    fired = []

    def killing(self, *args, **kwargs):
        if not fired:
            fired.append(True)
            server.kill()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RemoteTier, method, killing)
    return fired


@pytest.mark.parametrize("method", ["_mget", "_load"])  # during the lookup, during the blobs' fetch
def test_server_killed_mid_fetch_then_restarted_empty(tmp_path, redis_server, model_of, monkeypatch, method):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=1)
    publish(tmp_path / "a", redis_server.url, model, tokens[:280])
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url, remote_timeout=0.2) as b:
        space = b.bind(model, model_id="m")
        fired = _kill_first(monkeypatch, redis_server, method)
        started = time.monotonic()
        hit = space.fetch(tokens)
        assert fired and hit.length == 0 and "remote_down" in _reasons(b)
        assert time.monotonic() - started < HANG_GUARD
        monkeypatch.undo()
        assert_faithful(model, hit, tokens)  # a miss is an empty cache, still usable
        # Inserts and local hits go on while the server is down.
        cache = space.new_cache()
        forward(model, cache, tokens[:-1])
        space.insert(tokens[:-1], cache)
        assert space.fetch(tokens).length == len(tokens) - 1
        # Restarted empty: a miss, then what A publishes again is a hit.
        redis_server.restart_empty()
        other = prompt_tokens(300, seed=2)
        b.remote._down_until = 0.0  # do not wait out the retry pause
        assert space.fetch(other).length == 0
        publish(tmp_path / "a2", redis_server.url, model, other[:280])
        hit = space.fetch(other)
        assert hit.remote_tokens == 280
        assert_faithful(model, hit, other)


def test_server_killed_mid_publish(tmp_path, redis_server, model_of, monkeypatch):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=4)
    fired = _kill_first(monkeypatch, redis_server, "publish")
    started = time.monotonic()
    with promptstore.PromptStore.open(tmp_path / "a", remote_url=redis_server.url, remote_timeout=0.2) as a:
        space = a.bind(model, model_id="m")
        cache = space.new_cache()
        forward(model, cache, tokens[:280])
        space.insert(tokens[:280], cache)
        a.flush()
        assert fired and a.remote.counts["remote_publish_failed"] == 1
        hit = space.fetch(tokens)  # the local tiers serve as before
        assert hit.length == 280
        assert_faithful(model, hit, tokens)
    assert time.monotonic() - started < HANG_GUARD


def test_a_paused_server_costs_a_bounded_wait(tmp_path, redis_server, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=7)
    publish(tmp_path / "a", redis_server.url, model, tokens[:280])
    redis_server.proc.send_signal(signal.SIGSTOP)  # slow: accepts connections, answers nothing
    try:
        with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url, remote_timeout=0.2) as b:
            space = b.bind(model, model_id="m")
            started = time.monotonic()
            assert space.fetch(tokens).length == 0 and "remote_down" in _reasons(b)
            cache = space.new_cache()
            forward(model, cache, tokens[:280])
            space.insert(tokens[:280], cache)
        assert time.monotonic() - started < HANG_GUARD
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("kind", ["server", "cluster"])
def test_no_server_at_all(tmp_path, model_of, kind):
    """Ports nobody listens on (one server, or every node of a cluster): the store
    opens, inserts and serves locally; every remote call is a reported miss after
    a bounded wait."""
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=8)
    if kind == "server":
        url = f"redis://127.0.0.1:{RedisServer(tmp_path).port}/0"
    else:
        taken: set[int] = set()
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{free_cluster_port(taken)}" for _ in range(3))
    counts = publish(tmp_path / "a", url, model, tokens[:280], remote_timeout=0.2)
    assert counts["remote_publish_failed"] == 1
    with promptstore.PromptStore.open(tmp_path / "a", remote_url=url, remote_timeout=0.2) as a:
        hit = a.bind(model, model_id="m").fetch(tokens)
        assert hit.length == 280
        assert_faithful(model, hit, tokens)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=url, remote_timeout=0.2) as b:
        started = time.monotonic()
        assert b.bind(model, model_id="m").fetch(tokens).length == 0
        assert "remote_down" in _reasons(b) and time.monotonic() - started < HANG_GUARD


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_a_full_server_evicts_or_refuses(tmp_path, model_of, policy):
    """Past maxmemory: what was evicted is a miss, what was refused was never
    published; every hit is faithful."""
    server = RedisServer(tmp_path / "redis", "--maxmemory", "1mb", "--maxmemory-policy", policy)
    (tmp_path / "redis").mkdir()
    server.start()
    try:
        model = model_of("llama")
        prompts = [prompt_tokens(300, seed=100 + i) for i in range(8)]  # ~280 KB of blobs each
        counts = [publish(tmp_path / f"a{i}", server.url, model, p[:280]) for i, p in enumerate(prompts)]
        if policy == "noeviction":
            assert sum(c.get("remote_publish_failed", 0) for c in counts) > 0
        hits = 0
        with promptstore.PromptStore.open(tmp_path / "b", remote_url=server.url) as b:
            space = b.bind(model, model_id="m")
            for p in prompts:
                hit = space.fetch(p)
                assert hit.length in (0, 280)
                hits += hit.length > 0
                assert_faithful(model, hit, p)
        assert 0 < hits < len(prompts)
    finally:
        server.kill()


@pytest.mark.parametrize("what", ["blob", "record"])
def test_a_byte_flipped_in_redis_is_a_reported_miss(tmp_path, redis_server, model_of, what):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=12)
    publish(tmp_path / "a", redis_server.url, model, tokens[:280])
    client = redis_server.client()
    prefix = BLOB_PREFIX if what == "blob" else INDEX_PREFIX
    for key in client.scan_iter(match=prefix + "*"):
        middle = client.strlen(key) // 2
        byte = client.getrange(key, middle, middle)
        client.setrange(key, middle, bytes([byte[0] ^ 0x01]))
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        space = b.bind(model, model_id="m")
        hit = space.fetch(tokens)
        assert hit.length == 0 and "remote_garbage" in _reasons(b)
        assert not list(b.index.iter_nodes(space.namespace)), "nothing of a bad blob is stored"


def test_values_of_the_wrong_type_are_a_miss(tmp_path, redis_server, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=13)
    publish(tmp_path / "a", redis_server.url, model, tokens[:280])
    client = redis_server.client()
    for key in list(client.scan_iter(match=BLOB_PREFIX + "*")):
        client.delete(key)
        client.rpush(key, b"not a blob")
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        hit = b.bind(model, model_id="m").fetch(tokens)
        assert hit.length == 0 and b.reports


def test_blobs_a_publisher_sent_are_sent_again_once_the_server_lost_them(tmp_path, redis_server, model_of):
    """A failover, an eviction or a restart may lose what a process published; its
    next publish under the same prefix must not name the lost blobs: it sends them
    again, and a reader hits the whole prompt."""
    model = model_of("llama")
    system = prompt_tokens(2 * CHUNK, seed=21)
    tails = [prompt_tokens(CHUNK + 40, seed=22 + i) for i in range(3)]
    prompts = [mx.concatenate([system, tail]) for tail in tails]
    with promptstore.PromptStore.open(tmp_path / "a", remote_url=redis_server.url) as a:
        space = a.bind(model, model_id="m")
        for n, tokens in enumerate(prompts):
            if n == 2:
                redis_server.client().flushall()  # the server lost everything it held
            cache = space.new_cache()
            forward(model, cache, tokens)
            space.insert(tokens, cache)
            a.flush()  # spills, then the publishes they queue
            assert a.remote.flush(HANG_GUARD)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        hit = b.bind(model, model_id="m").fetch(mx.concatenate([prompts[2], prompt_tokens(8, seed=30)]))
        assert hit.length == len(prompts[2]) and hit.remote_tokens == hit.length
        assert_faithful(model, hit, mx.concatenate([prompts[2], prompt_tokens(8, seed=30)]))
