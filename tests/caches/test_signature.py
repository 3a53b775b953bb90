"""signature(): what a cache's arrays look like, the token axis left out.

The store compares it with a one-token forward's before an insert, so it must
be equal for every length one model layer reaches, and differ where another
model (or a batch) would hand the store arrays this model cannot use.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from promptstore import caches as C
from promptstore.testing import models

from ..conftest import _model, forward, fresh_cache, prompt_tokens

WINDOWED = ("gemma3_text", "llama4")  # rotating / chunked layers: lengths past the window too


def _signatures(model, n, **kwargs):
    cache = C.make_prompt_cache(model, **kwargs)
    forward(model, cache, prompt_tokens(n, seed=n))
    return [c.signature() for c in cache]


@pytest.mark.parametrize("family", models.FAMILIES)
def test_equal_at_every_length(family):
    model = _model(family)
    one = _signatures(model, 1)
    assert all(one), one  # every layer holds arrays after one token
    for n in (2, 9, 40 if family in WINDOWED else 17):
        assert _signatures(model, n) == one, n


def test_equal_for_quantized_layers_of_any_length():
    model = _model("llama", "hd32")
    assert _signatures(model, 1, kv_bits=8, kv_group_size=32) == _signatures(model, 300, kv_bits=8, kv_group_size=32)


def test_read_without_evaluating():
    """The store builds its template from a forward it never evaluates."""
    model = _model("qwen3_next")
    lazy = C.make_prompt_cache(model)
    model(prompt_tokens(1)[None], cache=lazy)  # no mx.eval
    assert [c.signature() for c in lazy] == _signatures(model, 1)


def test_empty_until_filled():
    assert all(c.signature() in ((), ((), ())) for c in fresh_cache(_model("falcon_h1")))
    assert all(c.signature() == () for c in fresh_cache(_model("llama")))


@pytest.mark.parametrize("change", ["head dim", "head count", "batch", "dtype"])
def test_differs_where_the_arrays_do(change):
    model = _model("llama")
    cache = fresh_cache(model)
    forward(model, cache, prompt_tokens(5))
    keys, values = cache[0].keys[..., :5, :], cache[0].values[..., :5, :]
    other = {
        "head dim": lambda a: mx.concatenate([a, a], axis=3),
        "head count": lambda a: mx.concatenate([a, a], axis=1),
        "batch": lambda a: mx.concatenate([a, a], axis=0),
        "dtype": lambda a: a.astype(mx.bfloat16),
    }[change]
    changed = C.KVCache()
    changed.update_and_fetch(other(keys), other(values))
    same = C.KVCache()
    same.update_and_fetch(keys, values)
    assert same.signature() == cache[0].signature()
    assert changed.signature() != cache[0].signature()
