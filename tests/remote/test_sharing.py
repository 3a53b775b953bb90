"""Two stores on two paths sharing one Redis: what A inserts, B restores with
fidelity; B keeps what it fetched; lookups cost a bounded number of round trips."""

import os

import mlx.core as mx
import pytest

import promptstore
from promptstore.snapshots.remote import CHUNK, ledger_summary
from promptstore.testing.models import FAMILIES

from ..conftest import forward, prompt_tokens
from .helpers import assert_faithful, commands, publish


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_inserted_by_a_is_restored_by_b(tmp_path, redis_server, model_of, family):
    model = model_of(family)
    tokens = prompt_tokens(CHUNK + 200, seed=3)
    prefix = CHUNK + 150
    assert publish(tmp_path / "a", redis_server.url, model, tokens[:prefix])["remote_published"] == 1
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        space = b.bind(model, model_id="m")
        hit = space.fetch(tokens)
        assert (hit.length, hit.remote_tokens) == (prefix, prefix)
        assert_faithful(model, hit, tokens)
        # B keeps it: the next fetch is local, and it survives B's restart.
        assert (space.fetch(tokens).length, space.last_hit.remote_tokens) == (prefix, 0)
        assert b.tiers.remote.quiet, "a node made from a remote hit is not published back"
    with promptstore.PromptStore.open(tmp_path / "b") as b:
        hit = b.bind(model, model_id="m").fetch(tokens)
        assert (hit.length, hit.remote_tokens) == (prefix, 0)
        assert_faithful(model, hit, tokens)


def test_a_prompt_that_diverges_inside_a_node_gets_its_grid_prefix(tmp_path, redis_server, model_of):
    """Attention layers restore anywhere: B shares [0, 300) of A's 400-token node and
    gets [0, 256), the deepest chunk boundary of the remote index."""
    model = model_of("llama")
    a = prompt_tokens(400, seed=5)
    b_tokens = prompt_tokens(360, seed=6)
    b_tokens[:300] = a[:300]
    publish(tmp_path / "a", redis_server.url, model, a)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        hit = b.bind(model, model_id="m").fetch(b_tokens)
        assert hit.length == CHUNK
        assert_faithful(model, hit, b_tokens)


def test_the_parts_of_a_node_a_remote_hit_split_are_published(tmp_path, redis_server, model_of):
    """B's own node [0, 297) is split at 257 when B stores A's prompt, which shares
    its first 257 tokens, from the server. Both parts have spans the server holds
    no blob of: they are B's to publish, not quiet copies of a remote hit, so B's
    next prompt below the split (a node [257, 297) whose path is [0, 257)) is
    published whole, and a fresh store restores it all."""
    model = model_of("llama")
    shared = prompt_tokens(CHUNK + 1, seed=80)  # a grid point, and one token more
    tails = [prompt_tokens(40, seed=81 + k) for k in range(3)]
    b_first, a_prompt, b_next = (mx.concatenate([shared, t]) for t in tails)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        b_space = b.bind(model, model_id="m")
        cache = b_space.new_cache()
        forward(model, cache, b_first)
        b_space.insert(b_first, cache)
        b.flush()
        publish(tmp_path / "a", redis_server.url, model, a_prompt)
        hit = b_space.fetch(mx.concatenate([a_prompt, tails[0][:4]]))
        assert hit.remote_tokens > 0 and hit.length == len(a_prompt)  # kept here, splitting B's node at 257
        cache = b_space.new_cache()
        forward(model, cache, b_next)
        b_space.insert(b_next, cache)
        b.flush()
        counts = dict(b.remote.counts)
    assert not counts.get("remote_publish_incomplete"), counts
    with promptstore.PromptStore.open(tmp_path / "c", remote_url=redis_server.url) as c:
        tokens = mx.concatenate([b_next, tails[1][:4]])
        hit = c.bind(model, model_id="m").fetch(tokens)
        assert (hit.length, hit.remote_tokens) == (len(b_next), len(b_next))
        assert_faithful(model, hit, tokens)


def test_lookup_round_trips_do_not_grow_with_the_prompt(tmp_path, redis_server, model_of):
    model = model_of("llama")
    client = redis_server.client()
    for n in (CHUNK // 2, 4 * CHUNK + 10, 16 * CHUNK + 10):
        tokens = prompt_tokens(n + 20, seed=n)
        publish(tmp_path / f"a{n}", redis_server.url, model, tokens[:n])
        with promptstore.PromptStore.open(tmp_path / f"b{n}", remote_url=redis_server.url) as b:
            space = b.bind(model, model_id="m")
            before = commands(client)
            hit = space.fetch(tokens)
            trips = commands(client) - before - 1  # less the INFO that counted
            assert hit.length == n and b.remote.last_round_trips == trips
            assert trips <= 3, f"{trips} round trips for a {n}-token prompt"


def test_publish_threshold_and_what_this_store_published(tmp_path, redis_server, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=9)
    counts = publish(tmp_path / "a", redis_server.url, model, tokens, remote_publish_seconds=1e6)
    assert counts.get("remote_published", 0) == 0 and redis_server.client().dbsize() == 0
    publish(tmp_path / "c", redis_server.url, model, tokens)
    with promptstore.PromptStore.open(tmp_path / "c") as c:
        exists = lambda key: c.index.get(key) is not None  # noqa: E731
        summary = ledger_summary(tmp_path / "c", redis_server.client(), exists)
        assert summary["published"] == summary["on_server"] == 1 and summary["local_gone"] == 0
        redis_server.client().flushall()
        summary = ledger_summary(tmp_path / "c", redis_server.client(), exists)
        assert (summary["on_server"], summary["evicted"]) == (0, 1)
    with promptstore.PromptStore.open(tmp_path / "c", remote_url=redis_server.url) as c:
        summary = c.remote.summary(lambda key: c.index.get(key) is not None)
        assert (summary["published"], summary["evicted"], summary["local_gone"]) == (1, 1, 0)


def test_stats_and_compact_know_the_remote_tier(tmp_path, redis_server, model_of):
    """What a store published shows in `stats` (operator view) and in compact's report,
    and compact forgets blobs the server no longer has."""
    import json
    import subprocess
    import sys

    from promptstore.store.compact import compact

    model = model_of("llama")
    publish(tmp_path / "a", redis_server.url, model, prompt_tokens(300, seed=31))
    env = {**os.environ, "PROMPTSTORE_REMOTE_URL": redis_server.url, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "promptstore", "stats", "--store", str(tmp_path / "a"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    remote = json.loads(out.stdout)["remote"]
    assert remote["published"] >= 1 and remote["on_server"] == remote["published"] and remote["evicted"] == 0
    redis_server.client().flushall()  # the server restarted empty, or evicted everything
    os.environ["PROMPTSTORE_REMOTE_URL"] = redis_server.url
    try:
        report = compact(tmp_path / "a")
    finally:
        del os.environ["PROMPTSTORE_REMOTE_URL"]
    assert report.actions["remote blobs gone from the server"]["files"] == remote["published"]
    assert report.remote["published"] == 0
