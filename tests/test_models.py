"""The random-weight test models run, are deterministic, and prefill the same
in chunks as in one go with mlx-lm's own caches: the baseline every cache
fidelity test in this project compares against."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from promptstore.testing.models import (
    ATTENTION_CHUNK_SIZE,
    FAMILIES,
    SLIDING_WINDOW,
    llama_1b_shape,
    model_args,
    tiny_model,
)

# Longer than the sliding window and the attention chunk, so chunked prefill
# wraps RotatingKVCache and rolls ChunkedKVCache.
N = 100
assert N > 2 * max(SLIDING_WINDOW, ATTENTION_CHUNK_SIZE)

# Chunk schemes: uneven multi-token chunks; single-token steps that rotate
# the sliding window in place before a long chunk; token by token.
SCHEMES = {
    "37+40+23": [37, 40, 23],
    "17+1+1+81": [17, 1, 1, 81],
    "1x100": [1] * N,
}

# float32 on CPU; measured differences are at most ~1e-5.
ATOL = 1e-4

EXPECTED_KINDS = {
    "llama": {"KVCache"},
    "gemma3_text": {"RotatingKVCache", "KVCache"},
    "qwen3_next": {"ArraysCache", "KVCache"},
    "llama4": {"ChunkedKVCache", "KVCache"},
    "falcon_h1": {"CacheList(ArraysCache,KVCache)"},
    "baichuan_m1": {
        "CacheList(ArraysCache,RotatingKVCache)",
        "CacheList(ArraysCache,KVCache)",
    },
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param)


def _lm_rows(model) -> int:
    # The vocabulary is the logits' width; read it off a 1-token forward.
    return model(mx.array([[0]], dtype=mx.int32)).shape[-1]


def _prompt(vocab: int, n: int = N) -> list[int]:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(7)).tolist()


def _prefill(model, prompt, sizes):
    cache = make_prompt_cache(model)
    logits, start = [], 0
    for size in sizes:
        chunk = mx.array([prompt[start : start + size]], dtype=mx.int32)
        logits.append(model(chunk, cache=cache))
        mx.eval(logits[-1])
        start += size
    assert start == len(prompt)
    return mx.concatenate(logits, axis=1), cache


def _greedy(model, cache, logits, n=16):
    tokens = []
    for _ in range(n):
        token = mx.argmax(logits[0, -1]).item()
        tokens.append(token)
        logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)
    return tokens


def _kind(cache) -> str:
    if isinstance(cache, CacheList):
        return f"CacheList({','.join(type(c).__name__ for c in cache.caches)})"
    return type(cache).__name__


def _leaves(cache):
    return cache.caches if isinstance(cache, CacheList) else [cache]


def test_families_cover_every_cache_kind():
    assert set(FAMILIES) == set(EXPECTED_KINDS)
    for family in FAMILIES:
        kinds = {_kind(c) for c in make_prompt_cache(tiny_model(family))}
        assert kinds == EXPECTED_KINDS[family], family


def test_forward_shape_and_values(family_model):
    family, model = family_model
    vocab = _lm_rows(model)
    prompt = mx.array([_prompt(vocab)], dtype=mx.int32)
    logits = model(prompt, cache=make_prompt_cache(model))
    assert logits.shape == (1, N, vocab)
    assert logits.dtype == mx.float32
    assert mx.isfinite(logits).all().item()
    # Random weights that are too small give near-constant logits.
    assert logits[0, -1].std().item() > 0.1


@pytest.mark.parametrize("scheme", SCHEMES)
def test_chunked_prefill_matches_one_shot(family_model, scheme):
    family, model = family_model
    prompt = _prompt(_lm_rows(model))
    whole, whole_cache = _prefill(model, prompt, [N])
    chunked, chunked_cache = _prefill(model, prompt, SCHEMES[scheme])

    diff = mx.abs(chunked[0, -1] - whole[0, -1]).max().item()
    assert diff <= ATOL, f"{family} {scheme}: last-token logits differ by {diff}"
    reference = _greedy(model, whole_cache, whole)
    assert _greedy(model, chunked_cache, chunked) == reference
    assert len(set(reference)) >= 4, f"{family} greedy decoding is degenerate"


def test_chunked_prefill_wraps_windows_and_rolls_chunks():
    # Guards the test above: its prompt really outgrows both windows.
    for family in ("gemma3_text", "llama4", "baichuan_m1"):
        model = tiny_model(family)
        _, cache = _prefill(model, _prompt(_lm_rows(model)), SCHEMES["37+40+23"])
        leaves = [leaf for c in cache for leaf in _leaves(c)]
        rotating = [c for c in leaves if isinstance(c, RotatingKVCache)]
        chunked = [c for c in leaves if isinstance(c, ChunkedKVCache)]
        assert rotating or chunked
        assert all(c.keys.shape[2] < c.offset for c in rotating)
        # Trimmed at the start of the third call, to its last chunk_size.
        assert all(c.start_position == 37 + 40 - ATTENTION_CHUNK_SIZE for c in chunked)


def test_seed_fixes_weights():
    a, b = tiny_model("qwen3_next", seed=3), tiny_model("qwen3_next", seed=3)
    c = tiny_model("qwen3_next", seed=4)
    pa, pb, pc = (dict(tree_flatten(m.parameters())) for m in (a, b, c))
    assert pa.keys() == pb.keys() == pc.keys()
    assert all(mx.array_equal(pa[k], pb[k]).item() for k in pa)
    assert not all(mx.array_equal(pa[k], pc[k]).item() for k in pa)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_dtype_casts_weights_not_values(dtype):
    low = tiny_model("gemma3_text", dtype=dtype)
    full = dict(tree_flatten(tiny_model("gemma3_text").parameters()))
    for name, p in tree_flatten(low.parameters()):
        assert p.dtype == dtype
        assert mx.array_equal(p, full[name].astype(dtype)).item(), name
    logits = low(mx.array([_prompt(256, 20)], dtype=mx.int32))
    assert logits.dtype == dtype and mx.isfinite(logits).all().item()


def test_model_args_overrides():
    assert model_args("llama", num_hidden_layers=3).num_hidden_layers == 3
    args = model_args("llama4", attention_chunk_size=8)
    assert args.text_config.attention_chunk_size == 8
    model = tiny_model("gemma3_text", sliding_window=8)
    caches = make_prompt_cache(model)
    assert {c.max_size for c in caches if isinstance(c, RotatingKVCache)} == {8}
    with pytest.raises(ValueError, match="unknown family"):
        model_args("gpt2")


def test_model_is_in_eval_mode(family_model):
    _, model = family_model
    assert not model.training


def test_llama_1b_shape():
    model = llama_1b_shape(num_layers=1, vocab_size=512)
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.weight.shape == (32 * 64, 2048)
    assert attn.k_proj.weight.shape == (8 * 64, 2048)
    assert attn.v_proj.weight.shape == (8 * 64, 2048)
    assert mlp.gate_proj.weight.shape == (8192, 2048)
    assert mlp.down_proj.weight.shape == (2048, 8192)
    assert attn.q_proj.weight.dtype == mx.float16
    cache = make_prompt_cache(model)
    logits = model(mx.array([[1, 2, 3, 4]], dtype=mx.int32), cache=cache)
    assert logits.shape == (1, 4, 512) and mx.isfinite(logits).all().item()
    assert [type(c) for c in cache] == [KVCache]
    assert cache[0].keys.shape[1::2] == (8, 64)
