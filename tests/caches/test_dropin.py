"""Drop-in: restored and adopted caches work wherever mlx-lm's own caches do."""

import gc

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import cache as mlx_cache

from promptstore import caches as C
from promptstore.testing import models

from ..conftest import forward, fresh_cache, prompt_tokens

N, K = 70, 41


def restored(model, tokens, target):
    cache = fresh_cache(model)
    forward(model, cache, tokens[:target])
    snaps = [s.eval() for s in C.snapshot_prompt_cache(cache, 0)]
    hit = fresh_cache(model)
    assert C.restore_prompt_cache(hit, snaps, target)
    return hit


def stream(model, prompt, cache, n=24):
    steps = generate_step(prompt, model, prompt_cache=cache, max_tokens=n)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next", "llama4", "falcon_h1"])
def test_mlx_lm_generate_step_from_a_restored_cache(model_of, family):
    model = model_of(family)
    tokens = prompt_tokens(N, seed=3)
    want = stream(model, tokens, fresh_cache(model))
    got = stream(model, tokens[K:], restored(model, tokens, K))
    assert got == want


def test_speculative_decoding_from_a_restored_cache(model_of):
    model = model_of("llama")
    draft = models.tiny_model("llama", seed=5, num_hidden_layers=1)
    tokens = prompt_tokens(N, seed=4)
    want = stream(model, tokens, fresh_cache(model), n=20)
    cache = restored(model, tokens, K) + fresh_cache(draft)
    # The draft's cache must hold the same prefix: prefill it the plain way.
    forward(draft, cache[len(model.layers) :], tokens[:K])
    got = [
        int(t)
        for t, _, _ in speculative_generate_step(
            tokens[K:], model, draft, prompt_cache=cache, max_tokens=20, num_draft_tokens=3
        )
    ]
    assert got == want


def test_plain_mlx_lm_caches_are_adopted_without_copying(model_of):
    model = model_of("gemma3_text")
    tokens = prompt_tokens(N, seed=5)
    plain = mlx_cache.make_prompt_cache(model)
    forward(model, plain, tokens[:K])
    buffers = [(c.keys, c.values) for c in plain]
    adopted = C.adopt_prompt_cache(plain)
    assert all(a is p for a, p in zip(adopted, plain))
    assert all(c.keys is k and c.values is v for c, (k, v) in zip(adopted, buffers))
    assert isinstance(adopted[0], C.RotatingKVCache) and isinstance(adopted[1], C.KVCache)
    ref = fresh_cache(model)
    want = forward(model, ref, tokens)
    snaps = C.snapshot_prompt_cache(adopted, 0)
    hit = fresh_cache(model)
    assert C.restore_prompt_cache(hit, snaps, K)
    got = forward(model, hit, tokens[K:])
    assert mx.abs(want - got).max().item() < 1e-4


def test_batching_merge_extract_filter_keep_our_kinds(model_of):
    model = model_of("gemma3_text")
    a = restored(model, prompt_tokens(30, seed=1), 30)
    b = restored(model, prompt_tokens(20, seed=2), 20)
    batch = [type(x).merge([x, y]) for x, y in zip(a, b)]
    assert isinstance(batch[0], C.BatchRotatingKVCache) and isinstance(batch[1], C.BatchKVCache)
    # A batched decode step runs, then each sequence comes back out.
    model(mx.array([[1], [2]]), cache=batch)
    back = [c.extract(1) for c in batch]
    assert isinstance(back[0], C.RotatingKVCache) and isinstance(back[1], C.KVCache)
    assert back[1].offset == 21
    for c in batch:
        c.filter([0])
    assert batch[1].keys.shape[0] == 1
    # The batch kinds snapshot and restore too.
    snap = batch[1].snapshot(0)
    again = C.BatchKVCache(left_padding=[0])
    assert again.restore(snap, snap.end)


def test_quantizing_a_cache_keeps_our_kind(model_of):
    cache = C.KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, 5, 32)), mx.zeros((1, 2, 5, 32)))
    q = cache.to_quantized(group_size=32, bits=8)
    assert isinstance(q, C.QuantizedKVCache) and q.offset == 5
    assert q.snapshot(0).end == 5


def test_a_restore_copies_nothing_and_the_first_write_grows_the_cache_once(model_of):
    """Restored from one snapshot per layer, a cache holds the stored arrays
    themselves, sized exactly (as mlx-lm's load_prompt_cache makes them): no
    copy. Its first write grows each buffer by one copy; the steps after it
    write in place."""
    model = model_of("llama")
    tokens = prompt_tokens(700, seed=6)
    cache = fresh_cache(model)
    forward(model, cache, tokens[:512])
    snaps = [s.eval() for s in C.snapshot_prompt_cache(cache, 0)]
    stored = sum(a.nbytes for s in snaps for a in s.arrays.values())
    del cache
    hit = fresh_cache(model)
    gc.collect()
    base = mx.get_active_memory()
    assert C.restore_prompt_cache(hit, snaps, 512)
    mx.eval([c.state for c in hit])
    assert mx.get_active_memory() - base < 0.1 * stored
    assert all(c.keys.shape[2] == c.offset == 512 for c in hit)
    forward(model, hit, tokens[512:600])
    grown = [c.keys.shape[2] for c in hit]
    assert all(g >= 600 for g in grown)
    forward(model, hit, tokens[600:601])
    assert [c.keys.shape[2] for c in hit] == grown  # in place: no regrowth, no copy
    # What the restored cache computed is what a full prefill computes.
    direct = fresh_cache(model)
    forward(model, direct, tokens[:600])
    assert mx.allclose(forward(model, direct, tokens[600:602]), forward(model, hit, tokens[601:602]), atol=1e-4)


def _retained(take):
    """Bytes still held after `take(parent)` is kept and the parent dropped."""
    gc.collect()
    base = mx.get_active_memory()
    parent = mx.random.normal((1, 8, 4096, 64))
    mx.eval(parent)
    piece = take(parent)
    mx.eval(piece)
    del parent
    gc.collect()
    return mx.get_active_memory() - base


def _snapshot_keys(parent):
    cache = C.KVCache()
    cache.state = (parent, parent, 4096)
    return cache.snapshot(4000).arrays["keys"]


def test_snapshot_does_not_pin_the_live_buffer():
    parent_bytes = 4096 * 8 * 64 * 4
    # Control: a plain slice keeps the whole parent alive.
    assert _retained(lambda p: p[..., 4000:, :]) >= 0.9 * parent_bytes
    assert _retained(lambda p: mx.contiguous(p[..., :4096, :])) >= 0.9 * parent_bytes
    assert _retained(_snapshot_keys) < 0.1 * parent_bytes
