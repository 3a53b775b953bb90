"""Cold hits by plan: an overlap hit (the head prefilled by fetch while the tail is
read) continues exactly as a full prefill does for every family and cache kind;
the plan recomputes when reads are slow, loads when they are fast, and overlaps
the two in between; long inserts become chains of nodes of at most node_bytes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from promptstore import PromptStore, config
from promptstore.config import Settings
from promptstore.errors import SettingsError
from promptstore.store import plan
from promptstore.store.plan import NOTE, ColdNode, Rates, choose, rates_of

from ..conftest import _model, forward, fresh_cache, greedy, insert_following_checkpoints, prompt_tokens

TOL = 1e-4
STEP = 8
NODE_BYTES = 16 << 10  # a few dozen positions of a tiny model per node
CASES = [
    ("llama", "", None),  # kv
    ("llama", "hd32", 4),  # quantized kv
    ("gemma3_text", "", None),  # rotating (sliding window) + kv
    ("qwen3_next", "", None),  # arrays (gated delta) + kv
    ("llama4", "", None),  # chunked kv + kv
    ("falcon_h1", "", None),  # cache list (mamba + kv)
    ("baichuan_m1", "", None),  # cache list (conv states + kv / rotating)
]
A = prompt_tokens(150, seed=71)


def open_store(root, **settings):
    return PromptStore.open(root, **{"prefill_step": STEP, "node_bytes": NODE_BYTES, **settings})


def continue_and_compare(model, hit, tokens, kv_bits):
    got = forward(model, hit.cache, tokens[hit.length :])
    ref = fresh_cache(model, kv_bits)
    want = forward(model, ref, tokens)
    assert mx.abs(got - want).max().item() < TOL
    assert greedy(model, hit.cache, got, 4) == greedy(model, ref, want, 4)


@pytest.mark.parametrize("family,variant,kv_bits", CASES, ids=[f"{f}{'-q' if b else ''}" for f, _, b in CASES])
def test_an_overlap_hit_continues_as_a_full_prefill(tmp_path, family, variant, kv_bits):
    model = _model(family, variant)
    kwargs = {"kv_bits": kv_bits, "kv_group_size": 32} if kv_bits else {}
    node_bytes = NODE_BYTES // 4 if kv_bits else NODE_BYTES  # quantized positions are smaller
    with open_store(tmp_path, durability="sync", node_bytes=node_bytes) as store:
        space = store.bind(model, model_id="m", **kwargs)
        insert_following_checkpoints(space, model, A)
        assert store.index.counters(space.namespace)["nodes"] >= 3
    tokens = mx.concatenate([A, prompt_tokens(5, seed=72)])
    with open_store(tmp_path, hot_bytes=0, cold_plan="overlap", node_bytes=node_bytes) as store:  # files only
        space = store.bind(model, model_id="m", **kwargs)
        hit = space.fetch(tokens)
        assert hit.plan is not None and hit.plan.mode == "overlap", hit.plan
        assert 0 < hit.computed < hit.length, (hit.computed, hit.length)
        assert hit.length >= len(A) - STEP  # recurrent layers restore at a grid checkpoint
        continue_and_compare(model, hit, tokens, kv_bits)
        assert list(store.reports) == []


def test_a_long_insert_becomes_a_chain_of_nodes_each_within_node_bytes(tmp_path):
    model = _model("llama")
    with open_store(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        cache = fresh_cache(model)
        forward(model, cache, A)
        assert space.insert(A, cache) == len(A)
        nodes = list(store.index.iter_nodes(space.namespace))
        assert len(nodes) >= 3
        assert all(sum(layer.nbytes for layer in n.record.layers) <= NODE_BYTES for n in nodes)
        assert sorted((n.start, n.end) for n in nodes)[0][0] == 0
        assert sum(n.end - n.start for n in nodes) == len(A)
    with open_store(tmp_path, hot_bytes=0) as store:  # every node from its own file
        space = store.bind(model, model_id="m")
        tokens = mx.concatenate([A, prompt_tokens(3, seed=73)])
        hit = space.fetch(tokens)
        assert hit.length == len(A) and hit.cold_nodes == len(nodes)
        continue_and_compare(model, hit, tokens, None)


# --- choosing ---------------------------------------------------------------------------------

# Four cold nodes of 1,000 tokens and 100 MB each, all in the page cache.
COLD = [ColdNode(i * 1000, (i + 1) * 1000, 100_000_000, 100_000_000) for i in range(4)]


def rates(tokens_per_s: float, read_bytes_per_s: float) -> Rates:
    r = Rates()
    for n in (500, 1000, 2000):
        r.add("prefill", 0, n, n / tokens_per_s)
    r.add("warm", 100_000_000, 100_000_000 / read_bytes_per_s)
    r.add("place", 100_000_000, 100_000_000 / 50e9)
    return r


@pytest.mark.parametrize(
    "tokens_per_s,read_bytes_per_s,mode",
    [
        (20_000, 0.2e9, "recompute"),  # reading 400 MB takes 2 s, prefilling 4k tokens 0.2 s
        (200, 5e9, "load"),  # the other way round
        (5_000, 0.4e9, "overlap"),  # 0.8 s either way alone: prefill half while reading half
    ],
)
def test_the_plan_follows_the_rates(tokens_per_s, read_bytes_per_s, mode):
    choice = choose(rates(tokens_per_s, read_bytes_per_s), 0, COLD)
    assert choice.mode == mode, choice
    if mode == "overlap":
        assert choice.at in {1000, 2000, 3000}
        assert choice.estimates[f"overlap@{choice.at}"] < min(choice.estimates["load"], choice.estimates["recompute"])


def test_without_a_prefill_rate_the_plan_loads_and_never_guesses_an_overlap():
    r = Rates()
    assert choose(r, 0, COLD).mode == "load"
    assert choose(r, 0, COLD, mode="overlap").at == 2000  # told to overlap, with no rates: in the middle


def test_a_compiling_first_forward_does_not_make_prefill_look_slow():
    r = rates(20_000, 0.2e9)
    r.add("prefill", 0, 1000, 5.0)  # a first forward that compiled its kernels
    assert r.prefill_seconds(0, 1000) == pytest.approx(0.05, rel=0.3)


@pytest.mark.parametrize("reads,mode", [(1e6, "recompute"), (20e9, "load")])
def test_a_fetch_serves_a_cold_hit_as_the_measured_rates_say(tmp_path, reads, mode):
    """Rates kept in the index steer a real fetch: slow reads recompute (the hit is
    the part held in memory, here none), fast ones load."""
    model = _model("llama")
    with open_store(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        cache = fresh_cache(model)
        forward(model, cache, A)
        space.insert(A, cache)
        r = rates_of(space.index, space.namespace)
        for n in (50, 100, 150):
            r.add("prefill", 0, n, n / 20_000)
        r.warm, r.disk = [(1 << 20, (1 << 20) / reads)], [(1 << 20, (1 << 20) / reads)]
        space.flush_stats()  # kept in the index
    with open_store(tmp_path, hot_bytes=0, cold_plan="auto") as store:
        space = store.bind(model, model_id="m")
        tokens = mx.concatenate([A, prompt_tokens(3, seed=74)])
        hit = space.fetch(tokens)
        assert hit.plan.mode == mode, hit.plan
        assert hit.length == (0 if mode == "recompute" else len(A))
        continue_and_compare(model, hit, tokens, None)


# --- the plan's former name -------------------------------------------------------------------


def test_split_the_former_name_of_overlap_is_read_as_overlap(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(config, "_warned", set())
    assert Settings(cold_plan="split").cold_plan == "overlap"
    assert Settings.from_env(cold_plan="split").cold_plan == "overlap"
    monkeypatch.setenv("PROMPTSTORE_COLD_PLAN", "split")
    assert Settings.from_env().cold_plan == "overlap"
    with PromptStore.open(tmp_path) as store:
        assert store.settings.cold_plan == "overlap"
    assert any("deprecated" in r.getMessage() for r in caplog.records)
    with pytest.raises(SettingsError):
        Settings.from_env(cold_plan="splits")


def test_rates_kept_under_the_former_name_are_read(tmp_path):
    """Stores kept their overlap samples as "split" before the rename."""
    model = _model("llama")
    with open_store(tmp_path) as store:
        space = store.bind(model, model_id="m")
        space.index.set_note(space.namespace, NOTE, b'{"prefill": [[0, 100, 0.01]], "split": [[1.0, 2.0]]}')
    plan._rates.clear()  # read again from the index, as a new process does
    with open_store(tmp_path) as store:
        space = store.bind(model, model_id="m")
        r = rates_of(space.index, space.namespace)
        assert r.overlap == [(1.0, 2.0)] and r.overlap_factor() == 2.0
        assert r.prefill == [(0, 100, 0.01)]
        assert "split" not in r.model_dump()
