"""Cold hits served by loading, recomputing or both at once (store/plan.py).

A split restore (the first cold nodes prefilled by fetch while the others are
read) continues exactly like a full prefill on every family and cache kind; a
hit whose reads are measured slow is recomputed; one whose rates balance is
overlapped; the rates are kept across a restart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.store import plan
from promptstore.store.plan import Choice, Rates, choose
from promptstore.testing import models

from ..conftest import _model, forward, fresh_cache, greedy, prompt_tokens

TOL = 1e-4
TOKENS = prompt_tokens(50, seed=41)
ENDS = (16, 32, 48)  # one node each; whole-state layers keep their state at each end
CASES = [(f, "", None) for f in models.FAMILIES] + [("llama", "hd32", 8)]


@pytest.fixture(autouse=True)
def _auto_plan(monkeypatch):
    """These tests are of the plan itself (the suite's conftest pins `load`)."""
    monkeypatch.setenv("PROMPTSTORE_COLD_PLAN", "auto")


def bind(store, model, kv_bits=None):
    kwargs = {"kv_bits": kv_bits, "kv_group_size": 32} if kv_bits else {}
    return store.bind(model, model_id="m", **kwargs)


def fill(root, model, kv_bits=None):
    """Store [0, 16), [16, 32), [32, 48) of TOKENS on disk, each insert told its prefill time."""
    with PromptStore.open(root, checkpoint_interval=16, durability="sync") as store:
        space = bind(store, model, kv_bits)
        for end in ENDS:
            hit = space.fetch(TOKENS[:end])
            started = time.perf_counter()
            forward(model, hit.cache, TOKENS[hit.length : end])
            space.insert(TOKENS[:end], hit.cache, prefill_seconds=time.perf_counter() - started)
        assert sorted((n.start, n.end) for n in store.index.iter_nodes(space.namespace)) == [
            (0, 16),
            (16, 32),
            (32, 48),
        ]


def continues_like_a_full_prefill(model, hit, kv_bits=None) -> None:
    """Logits within TOL of a fresh prefill of TOKENS, and the same greedy tokens after."""
    want_cache = fresh_cache(model, kv_bits)
    want = forward(model, want_cache, TOKENS)
    got = forward(model, hit.cache, TOKENS[hit.length :])
    assert mx.abs(got - want).max().item() < TOL
    assert greedy(model, hit.cache, got, 4) == greedy(model, want_cache, want, 4)


@pytest.mark.parametrize("at", [16, 32])
@pytest.mark.parametrize(("family", "variant", "kv_bits"), CASES)
def test_a_split_restore_continues_like_a_full_prefill(tmp_path, monkeypatch, family, variant, kv_bits, at):
    model = _model(family, variant)
    fill(tmp_path, model, kv_bits)
    monkeypatch.setattr(plan, "choose", lambda *args: Choice("split", at))
    with PromptStore.open(tmp_path, hot_bytes=0, checkpoint_interval=16) as store:
        space = bind(store, model, kv_bits)
        hit = space.fetch(TOKENS)
        assert (hit.length, hit.computed, hit.choice.mode, list(store.tiers.reports)) == (48, at, "split", [])
        assert hit.cold_nodes == len([e for e in ENDS if e > at])
        continues_like_a_full_prefill(model, hit, kv_bits)


def test_a_split_after_held_nodes_prefills_from_their_end(tmp_path, monkeypatch):
    model = _model("qwen3_next")
    fill(tmp_path, model)
    with PromptStore.open(tmp_path, checkpoint_interval=16) as store:
        space = bind(store, model)
        store.tiers.get(next(n for n in store.index.iter_nodes(space.namespace) if n.start == 0))  # [0, 16) held
        monkeypatch.setattr(plan, "choose", lambda *args: Choice("split", 32))
        hit = space.fetch(TOKENS)
        assert (hit.length, hit.computed, hit.cold_nodes) == (48, 16, 1)
        continues_like_a_full_prefill(model, hit)


def test_slow_reads_are_measured_and_then_recomputed(tmp_path, monkeypatch):
    model = _model("llama")
    fill(tmp_path, model)
    real = os.preadv

    def slow(*args):
        time.sleep(0.03)  # a disk far slower than this model's prefill
        return real(*args)

    monkeypatch.setattr(os, "preadv", slow)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = bind(store, model)
        first = space.fetch(TOKENS)  # no read measured yet: loaded, and timed
        assert (first.length, first.choice.mode) == (48, "load")
        second = space.fetch(TOKENS)
        assert second.choice.mode == "recompute" and second.length == 0
        assert second.choice.estimates["recompute"] < second.choice.estimates["load"]
        continues_like_a_full_prefill(model, second)


def test_the_overlap_is_chosen_when_the_rates_balance(tmp_path):
    model = _model("llama")
    fill(tmp_path, model)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = bind(store, model)
        rates = plan.rates_of(space)
        # 10 ms a token to prefill; 200 ms a file to read (bytes cost nothing here).
        rates.prefill = [(0, 16, 0.16), (0, 32, 0.32), (16, 48, 0.32)]
        rates.read = [(1, 1000, 0.2), (2, 1000, 0.4)]
        hit = space.fetch(TOKENS)
        assert (hit.choice.mode, hit.choice.at, hit.length, hit.computed) == ("split", 32, 48, 32)
        assert hit.choice.estimates["split@32"] < min(hit.choice.estimates[k] for k in ("load", "recompute"))
        continues_like_a_full_prefill(model, hit)
        assert rates.prefill[-1][:2] == (0, 32) and rates.overlap_read and rates.join  # measured as it ran


def test_rates_are_kept_across_a_restart(tmp_path):
    model = _model("llama")
    fill(tmp_path, model)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = bind(store, model)
        assert len(plan.rates_of(space).prefill) == len(ENDS)  # from the inserts, kept by the first store
        space.fetch(TOKENS)
        kept = plan.rates_of(space).model_copy(deep=True)
        assert kept.read
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        assert plan.rates_of(bind(store, model)) == kept


def test_load_setting_always_loads(tmp_path):
    model = _model("llama")
    fill(tmp_path, model)
    with PromptStore.open(tmp_path, hot_bytes=0, cold_plan="load") as store:
        space = bind(store, model)
        plan.rates_of(space).read = [(1, 1000, 50.0)]  # reads said to be hopeless
        hit = space.fetch(TOKENS)
        assert (hit.length, hit.choice.mode) == (48, "load")


# --- choose, on its own -------------------------------------------------------------------

COLD = [(0, 1000, 100), (1000, 2000, 100), (2000, 3000, 100)]  # (start, end, bytes)


def rates(per_token: float, per_file: float) -> Rates:
    return Rates(
        prefill=[(0, 1000, per_token * 1000), (0, 2000, per_token * 2000)],
        read=[(1, 100, per_file), (2, 100, 2 * per_file)],  # files cost, bytes do not
    )


def test_choose_loads_until_both_rates_are_known():
    assert choose(Rates(), 0, COLD, 300).mode == "load"
    assert choose(Rates(read=[(1, 100, 9.0)]), 0, COLD, 300).mode == "load"
    assert choose(Rates(prefill=[(0, 10, 9.0)]), 0, COLD, 300).mode == "load"


def test_choose_recomputes_when_reading_is_slower():
    choice = choose(rates(per_token=1e-4, per_file=1.0), 0, COLD, 300)
    assert (choice.mode, choice.at) == ("recompute", 0)


def test_choose_loads_when_reading_is_quicker():
    assert choose(rates(per_token=1e-2, per_file=1e-3), 0, COLD, 300).mode == "load"


def test_choose_overlaps_where_prefill_and_reading_balance():
    # Prefilling 1000 tokens takes as long as reading one file: prefill the first, read two.
    choice = choose(rates(per_token=1e-3, per_file=0.5), 0, COLD, 300)
    assert (choice.mode, choice.at) == ("split", 1000)
    assert choice.estimates["split@1000"] == pytest.approx(1.0)  # max(1.0 prefill, 2 files x 0.5)


def test_choose_keeps_loading_within_the_margin():
    r = rates(per_token=1e-3, per_file=1.05)  # load 3.15 s; the best other, split@2000, 2.05 s
    assert choose(r, 0, COLD, 300, margin=0.0).mode == "split"
    assert choose(r, 0, COLD, 300, margin=1.2).mode == "load"


def test_prefill_fit_follows_attention_cost():
    quadratic = Rates(prefill=[(0, n, 1e-6 * n * n / 2) for n in (1000, 2000, 4000)])
    assert quadratic.prefill_seconds(4000, 8000) == pytest.approx(1e-6 * (8000**2 - 4000**2) / 2, rel=1e-6)


# --- a process that keeps a restored cache to the end ---------------------------------------


def test_a_process_holding_a_cold_hit_exits_cleanly(tmp_path):
    """MLX aborts at exit while an array it loaded from a Python file object is
    alive; the cold tier hands over arrays that no longer hold that reader."""
    fill(tmp_path, _model("llama"))
    script = textwrap.dedent(f"""
        from promptstore import PromptStore
        from promptstore.testing import models
        from tests.conftest import prompt_tokens
        model = models.tiny_model("llama")
        store = PromptStore.open({str(tmp_path)!r}, hot_bytes=0, cold_plan="load")
        space = store.bind(model, model_id="m")
        HIT = space.fetch(prompt_tokens(50, seed=41))
        HELD = store.tiers.get(next(iter(store.index.iter_nodes(space.namespace))))
        assert HIT.length == 48 and HIT.cold_nodes == 3 and HELD
        print("held to the end")
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "held to the end"), done.stderr[-2000:]
