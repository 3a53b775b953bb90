"""Fidelity: a cache restored from snapshots generates exactly what a full
prefill generates, for every cache kind, on real mlx-lm model classes."""

from functools import reduce

import mlx.core as mx
import pytest

from promptstore import caches as C

from ..conftest import forward, fresh_cache, greedy, prompt_tokens

N, K1, K = 80, 29, 53  # K1, K: not multiples of the window (16) or chunk (16)
TOL = 1e-4
CASES = [
    ("llama", None),
    ("llama", 8),  # quantized KV
    ("gemma3_text", None),
    ("qwen3_next", None),
    ("llama4", None),
    ("falcon_h1", None),
    ("baichuan_m1", None),
]
IDS = [f"{f}-q{b}" if b else f for f, b in CASES]


def reference(model, tokens, kv_bits):
    cache = fresh_cache(model, kv_bits)
    logits = forward(model, cache, tokens)
    return logits, greedy(model, cache, logits, 32)


def snapshots_at(model, tokens, kv_bits, bounds):
    """Per-layer snapshots of each span between `bounds`, from one prefill."""
    cache, chain = fresh_cache(model, kv_bits), []
    for lo, hi in zip(bounds, bounds[1:]):
        forward(model, cache, tokens[lo:hi])
        chain.append([s.eval() for s in C.snapshot_prompt_cache(cache, lo)])
    return chain


def continue_from(model, snapshots, tokens, kv_bits, target):
    cache = fresh_cache(model, kv_bits)
    assert C.restore_prompt_cache(cache, snapshots, target)
    assert C.prompt_position(cache) == target
    logits = forward(model, cache, tokens[target:])
    return logits, greedy(model, cache, logits, 32)


def assert_same(ref, got):
    diff = mx.abs(ref[0] - got[0]).max().item()
    assert diff < TOL, f"logits differ by {diff}"
    assert ref[1] == got[1]


@pytest.mark.parametrize("family,kv_bits", CASES, ids=IDS)
def test_restore_matches_full_prefill(model_of, family, kv_bits):
    model = model_of(family, "hd32" if kv_bits else "")
    tokens = prompt_tokens(N)
    ref = reference(model, tokens, kv_bits)
    assert len(set(ref[1])) > 3, "the model must not be degenerate"
    (upper, lower) = snapshots_at(model, tokens, kv_bits, [0, K1, K])
    # A chain of two snapshots per layer.
    chains = [[a, b] for a, b in zip(upper, lower)]
    assert_same(ref, continue_from(model, chains, tokens, kv_bits, K))
    # One merged snapshot per layer.
    merged = C.merge_prompt_snapshots(upper, lower)
    assert_same(ref, continue_from(model, merged, tokens, kv_bits, K))


@pytest.mark.parametrize("family,kv_bits", CASES, ids=IDS)
def test_restore_through_merge_and_split(model_of, family, kv_bits):
    """Four snapshots merged, split at a point inside, restored from the halves."""
    model = model_of(family, "hd32" if kv_bits else "")
    tokens = prompt_tokens(N, seed=7)
    ref = reference(model, tokens, kv_bits)
    chain = snapshots_at(model, tokens, kv_bits, [0, 11, 23, 40, K])
    merged = reduce(C.merge_prompt_snapshots, chain)
    assert all(C.arrays_equal(a, b) for a, b in zip(C.merge_prompt_chain(chain), merged))
    uppers, lowers = C.split_prompt_snapshots(merged, 31)
    layers = [[u, lo] if u is not None else [lo] for u, lo in zip(uppers, lowers)]
    assert_same(ref, continue_from(model, layers, tokens, kv_bits, K))
    # Range-only models restore anywhere inside; check a point inside too.
    if all(u is not None for u in uppers):
        assert_same(reference(model, tokens, kv_bits), continue_from(model, uppers, tokens, kv_bits, 31))


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_bfloat16_snapshots_restore_exactly(model_of, family):
    model = model_of(family)
    cache = fresh_cache(model)
    forward(model, cache, prompt_tokens(40))
    snaps = [
        C.Snapshot(
            s.kind,
            s.start,
            s.end,
            s.whole,
            {k: a.astype(mx.bfloat16) if a.dtype == mx.float32 else a for k, a in s.arrays.items()},
            s.scalars,
            s.children,
        )
        for s in C.snapshot_prompt_cache(cache, 0)
    ]
    arrays, meta = C.to_flat(snaps)
    back = C.from_flat(arrays, meta)
    assert all(C.arrays_equal(a, b) for a, b in zip(snaps, back))
