"""Speculation: rejected draft tokens leave no trace in any cache kind."""

import mlx.core as mx
import pytest

from promptstore import caches as C
from promptstore.errors import CacheError

from ..conftest import forward, fresh_cache, greedy, prompt_tokens

FAMILIES = ["llama", "gemma3_text", "qwen3_next", "llama4", "falcon_h1", "baichuan_m1"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("accepted", [0, 2, 5])
def test_commit_keeps_only_the_accepted_prefix(model_of, family, accepted):
    model = model_of(family)
    tokens = prompt_tokens(60, seed=8)
    prompt, draft, rest = tokens[:40], tokens[40:45], tokens[45:52]
    cache = fresh_cache(model)
    forward(model, cache, prompt)
    spec = C.begin_speculation(cache)
    forward(model, cache, draft)
    spec.commit(accepted, tokens=draft.tolist(), replay=lambda t: model(t, cache=cache))
    assert C.prompt_position(cache) == 40 + accepted
    got = forward(model, cache, rest)
    ref_cache = fresh_cache(model)
    want = forward(model, ref_cache, mx.concatenate([prompt, draft[:accepted], rest]))
    assert mx.abs(want - got).max().item() < 1e-4
    assert greedy(model, cache, got, 12) == greedy(model, ref_cache, want, 12)


def test_rollback_and_misuse(model_of):
    model = model_of("qwen3_next")
    cache = fresh_cache(model)
    forward(model, cache, prompt_tokens(20))
    spec = C.begin_speculation(cache)
    forward(model, cache, prompt_tokens(3, seed=2))
    with pytest.raises(CacheError):
        spec.commit(4)  # more than was speculated
    with pytest.raises(CacheError):
        spec.commit(1)  # recurrent layers need the tokens replayed
    spec.rollback()
    assert C.prompt_position(cache) == 20
    with pytest.raises(CacheError):
        spec.commit(0)  # already done
