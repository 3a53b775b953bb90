"""Stores sharing prefixes through a real Redis Cluster (three primaries, a replica
each): restored with fidelity, a namespace spread over every shard, sealed as on
one server, and a primary killed mid-traffic costs misses, never a wrong state."""

import signal
import threading
import time

import mlx.core as mx
import pytest

import promptstore
from promptstore.config import Settings
from promptstore.errors import SettingsError
from promptstore.snapshots.remote import CHUNK, prune_ledger
from promptstore.snapshots.remote.cluster import ClusterURL
from promptstore.snapshots.remote.keys import BLOB_PREFIX, INDEX_PREFIX
from promptstore.snapshots.remote.tier import connect
from promptstore.testing.models import FAMILIES

from ..conftest import forward, fresh_cache, prompt_tokens
from .conftest import CLUSTER_SECONDS
from .helpers import assert_faithful, publish
from .test_pieces import publish_in_pieces
from .test_privacy import check_scan_shows_nothing

HANG_GUARD = 30.0  # seconds: only a missing timeout takes this long (the waits here are below 1 s)
TRAFFIC_SECONDS = 15.0  # the fetch/insert loop while a primary dies (about 6 s); past it the test fails


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_inserted_by_a_is_restored_by_b(tmp_path, redis_cluster, model_of, family):
    model = model_of(family)
    tokens = prompt_tokens(3 * CHUNK + 60, seed=3)
    prefix = 3 * CHUNK + 40
    assert publish(tmp_path / "a", redis_cluster.url, model, tokens[:prefix])["remote_published"] == 1
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_cluster.url) as b:
        space = b.bind(model, model_id="m")
        hit = space.fetch(tokens)
        assert (hit.length, hit.remote_tokens) == (prefix, prefix)
        assert b.remote.last_round_trips <= 3, "one step per round trip, whatever the shards"
        assert_faithful(model, hit, tokens)
        assert (space.fetch(tokens).length, space.last_hit.remote_tokens) == (prefix, 0)


def test_a_prompt_that_diverges_inside_a_node_gets_its_grid_prefix(tmp_path, redis_cluster, model_of):
    model = model_of("llama")
    a = prompt_tokens(2 * CHUNK + 100, seed=5)
    b_tokens = prompt_tokens(2 * CHUNK + 60, seed=6)
    b_tokens[: 2 * CHUNK + 30] = a[: 2 * CHUNK + 30]
    publish(tmp_path / "a", redis_cluster.url, model, a)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_cluster.url) as b:
        hit = b.bind(model, model_id="m").fetch(b_tokens)
        assert hit.length == 2 * CHUNK
        assert_faithful(model, hit, b_tokens)


def test_a_namespaces_keys_spread_over_every_shard(tmp_path, redis_cluster, model_of):
    """Blobs and records hash to their own slots: no hash tag keeps a namespace on one shard."""
    model = model_of("llama")
    prompts = [prompt_tokens(2 * CHUNK + 40, seed=50 + i) for i in range(6)]
    for i, p in enumerate(prompts):
        publish(tmp_path / f"a{i}", redis_cluster.url, model, p[: 2 * CHUNK + 20])
    primaries = redis_cluster.primaries()
    blobs = {s.port: sum(1 for _ in s.client().scan_iter(match=BLOB_PREFIX + "*")) for s in primaries}
    records = {s.port: sum(1 for _ in s.client().scan_iter(match=INDEX_PREFIX + "*")) for s in primaries}
    assert sum(blobs.values()) == 6 and sum(records.values()) == 6 * 3
    assert sum(n > 0 for n in blobs.values()) > 1, f"blobs by shard: {blobs}"
    assert all(s.client().dbsize() > 0 for s in primaries), f"records by shard: {records}"
    any_node = primaries[0].client()
    slots = {any_node.execute_command("CLUSTER", "KEYSLOT", key) for key, _ in redis_cluster.items()}
    assert len(slots) == 6 * 4, "every key in a slot of its own (no hash tag groups them)"
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_cluster.url) as b:
        space = b.bind(model, model_id="m")
        for p in prompts:
            hit = space.fetch(p)
            assert hit.remote_tokens == 2 * CHUNK + 20
            assert_faithful(model, hit, p, n_greedy=2)


def test_scan_of_every_shard_shows_no_salt_token_span_or_namespace(tmp_path, redis_cluster, model_of):
    check_scan_shows_nothing(tmp_path, redis_cluster.url, redis_cluster.items, model_of)


@pytest.mark.parametrize(
    "url, problem",
    [
        ("redis+cluster://", "is not host:port"),
        ("redis+cluster://127.0.0.1", "is not host:port"),
        ("redis+cluster://127.0.0.1:7000,,127.0.0.1:7001", "is not host:port"),
        ("redis+cluster://127.0.0.1:70000", "is not a port"),
        ("redis+cluster://bad host:7000", "is not a host name"),
        ("redis+cluster://127.0.0.1:7000/2", "database 0 only"),
        ("rediss+cluster://127.0.0.1:7000?timeout=3", "unknown option 'timeout'"),
        ("redis+clustr://127.0.0.1:7000", "redis+cluster://"),
    ],
)
def test_a_malformed_cluster_url_is_refused_and_changes_nothing(tmp_path, url, problem):
    with pytest.raises(SettingsError, match="remote_url") as e:
        promptstore.PromptStore.open(tmp_path / "s", remote_url=url)
    assert problem in str(e.value)
    assert not (tmp_path / "s").exists()


def test_a_cluster_url_names_its_nodes_and_how_to_reach_them():
    url = "rediss+cluster://user:p%40ss@10.0.0.1:7000,[::1]:7001,10.0.0.1:7000/0?ssl_cert_reqs=none"
    assert Settings.from_env(remote_url=url).remote_url == url
    want = ClusterURL((("10.0.0.1", 7000), ("::1", 7001)), True, "user", "p@ss", (("ssl_cert_reqs", "none"),))
    assert ClusterURL.parse(url) == want
    assert ClusterURL.parse("redis+cluster://h:1") == ClusterURL((("h", 1),))


def test_the_password_of_a_malformed_url_is_not_repeated(tmp_path):
    with pytest.raises(SettingsError) as e:
        promptstore.PromptStore.open(tmp_path / "s", remote_url="redis+cluster://user:hunter2@host:port")
    assert "hunter2" not in str(e.value) and "***" in str(e.value)


def test_paused_primaries_cost_a_bounded_wait(tmp_path, own_redis_cluster, model_of):
    """Shards that accept connections and answer nothing (SIGSTOP): a miss after
    about one timeout per shard, never a hang; local inserts go on; hits come back."""
    cluster = own_redis_cluster
    model = model_of("llama")
    tokens = prompt_tokens(4 * CHUNK + 60, seed=9)
    prefix = 4 * CHUNK + 40
    publish(tmp_path / "a", cluster.url, model, tokens[:prefix])
    primaries = cluster.primaries()
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=cluster.url, remote_timeout=0.2) as b:
        space = b.bind(model, model_id="m")
        for s in primaries:
            s.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert space.fetch(tokens).length == 0 and "remote_down" in {r.reason for r in b.reports}
            assert time.monotonic() - started < HANG_GUARD
            cache = fresh_cache(model)
            forward(model, cache, tokens[:CHUNK])
            space.insert(tokens[:CHUNK], cache)
        finally:
            for s in primaries:
                s.proc.send_signal(signal.SIGCONT)
        cluster.wait_ok()
        b.remote._down_until = 0.0  # do not wait out the retry pause
        hit = space.fetch(tokens)
        assert (hit.length, hit.remote_tokens) == (prefix, prefix)
        assert_faithful(model, hit, tokens)


def _faithful(model, want, hit, tokens) -> bool:
    got = forward(model, hit.cache, tokens[hit.length :])
    return mx.allclose(got, want, atol=1e-4, rtol=0).item()


def test_a_primary_killed_mid_traffic_costs_misses_never_a_wrong_state(tmp_path, own_redis_cluster, model_of):
    """A publishes a new prompt and B fetches it, in a loop; one primary is SIGKILLed
    under it. Every hit equals the prefill; hits resume once its replica is promoted;
    what was published before the kill is still served (or missed), never wrong."""
    cluster = own_redis_cluster
    model = model_of("llama")
    victim = cluster.primaries()[0]
    replica = cluster.replica_of(victim)
    settings = {"remote_url": cluster.url, "remote_timeout": 0.2, "remote_close_seconds": 2.0}
    prompts, wrong, log = [], 0, []  # log: (started, hit) per fetch
    killer = threading.Timer(1.0, victim.kill)
    promoted = None
    with (
        promptstore.PromptStore.open(tmp_path / "a", **settings) as a,
        promptstore.PromptStore.open(tmp_path / "b", **settings) as b,
    ):
        a_space, b_space = a.bind(model, model_id="m"), b.bind(model, model_id="m")
        started = time.monotonic()
        killer.start()
        while time.monotonic() - started < TRAFFIC_SECONDS:
            tokens = prompt_tokens(CHUNK + 60, seed=500 + len(prompts))
            cache = fresh_cache(model)
            forward(model, cache, tokens[: CHUNK + 40])
            a_space.insert(tokens[: CHUNK + 40], cache)
            a.flush()
            at = time.monotonic()
            hit = b_space.fetch(tokens)
            if hit.length:
                wrong += not _faithful(model, forward(model, fresh_cache(model), tokens), hit, tokens)
            log.append((at, hit.remote_tokens > 0))
            prompts.append(tokens)
            if promoted is None and victim.proc.poll() is not None:
                if cluster.info(replica, "replication")["role"] == "master":
                    promoted = time.monotonic()
            if promoted is not None and sum(h for t, h in log if t > promoted) >= 3:
                break
    killer.join()
    assert wrong == 0, f"{wrong} hits differ from the prefill"
    assert promoted is not None, f"the replica was not promoted within {TRAFFIC_SECONDS} s"
    assert sum(h for t, h in log if t > promoted) >= 3, "hits did not resume after the promotion"
    assert any(not h for _, h in log), "the kill cost no miss: the victim served nothing?"
    # A fresh replica of B reads everything published so far: hits equal the prefill, the rest are misses.
    with promptstore.PromptStore.open(tmp_path / "c", **settings) as c:
        space = c.bind(model, model_id="m")
        hits = 0
        for tokens in prompts:
            hit = space.fetch(tokens)
            if hit.length:
                hits += 1
                want = forward(model, fresh_cache(model), tokens)
                assert _faithful(model, want, hit, tokens)
        assert hits > 0
    assert time.monotonic() - started < TRAFFIC_SECONDS + 2 * CLUSTER_SECONDS


def test_what_this_store_published_is_counted_over_every_shard(tmp_path, redis_cluster, model_of):
    model = model_of("llama")
    for i in range(4):
        publish(tmp_path / "a", redis_cluster.url, model, prompt_tokens(CHUNK + 40, seed=70 + i))
    assert connect(redis_cluster.url, 0.5).ping()
    with promptstore.PromptStore.open(tmp_path / "a", remote_url=redis_cluster.url) as a:
        remote = a.remote
        summary = remote.summary(lambda key: a.index.get(key) is not None)
        assert (summary["published"], summary["on_server"], summary["evicted"]) == (4, 4, 0)
        redis_cluster.flushall()
        assert remote.summary(lambda key: True)["evicted"] == 4
        assert prune_ledger(tmp_path / "a", remote.client) == 4


def test_a_node_in_pieces_spreads_over_the_shards(tmp_path, redis_cluster, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=66)
    publish_in_pieces(tmp_path / "a", redis_cluster.url, model, tokens[:280], piece_bytes=1 << 14)
    by_shard = [sum(1 for _ in s.client().scan_iter(match=BLOB_PREFIX + "*")) for s in redis_cluster.primaries()]
    assert sum(by_shard) > 3 and all(n > 0 for n in by_shard), f"pieces by shard: {by_shard}"
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_cluster.url) as b:
        hit = b.bind(model, model_id="m").fetch(tokens)
        assert hit.remote_tokens == 280 and not b.reports
        assert_faithful(model, hit, tokens)


def test_a_shard_that_stops_mid_fetch_costs_one_bounded_miss(tmp_path, own_redis_cluster, model_of):
    """A node's pieces on every shard are read side by side, a thread a shard: one
    primary stopped once the lookup is done (SIGSTOP, well within the node timeout:
    no failover) makes the fetch a miss after about one timeout, whichever shard it is (read on the calling
    thread or beside it); no connection is left in use, and once it runs again the
    next fetch restores every piece."""
    cluster, model = own_redis_cluster, model_of("llama")
    tokens = prompt_tokens(300, seed=67)
    publish_in_pieces(tmp_path / "a", cluster.url, model, tokens[:280], piece_bytes=1 << 14)
    primaries = cluster.primaries()
    assert all(any(True for _ in s.client().scan_iter(match=BLOB_PREFIX + "*")) for s in primaries)
    for n, stopped in enumerate(primaries):
        with promptstore.PromptStore.open(tmp_path / f"b{n}", remote_url=cluster.url, remote_timeout=0.2) as b:
            space, remote = b.bind(model, model_id="m"), b.remote
            remote.client.ping()  # connections open and the slot table read, as a serving store has
            stream = remote._stream

            def stop_then_stream(names, each, into, stopped=stopped, stream=stream):
                stopped.proc.send_signal(signal.SIGSTOP)  # the lookup went well: the values' shard stops
                return stream(names, each, into)

            remote._stream = stop_then_stream
            try:
                started = time.monotonic()
                miss = space.fetch(tokens)
                waited = time.monotonic() - started
            finally:
                stopped.proc.send_signal(signal.SIGCONT)
                del remote._stream
            assert miss.length == 0 and "remote_down" in {r.reason for r in b.reports}, (n, miss)
            assert waited < HANG_GUARD
            pools = [node.redis_connection.connection_pool for node in remote.client.topology().get_nodes()]
            assert not any(pool._in_use_connections for pool in pools), f"shard {n}: connections left in use"
            remote._down_until = 0.0  # do not wait out the retry pause
            hit = space.fetch(tokens)
            assert (hit.length, hit.remote_tokens) == (280, 280), (n, hit)
            assert remote.client._readers is not None  # the shards were read side by side
            assert_faithful(model, hit, tokens)
