"""Tokens outside the model's vocabulary (issue 16, defect 4): before the fix, a token
id past the embedding's rows crashed the process (SIGSEGV in the embedding's gather)
from generate and stream_generate, and fetch and insert accepted it. Every entry
point now raises TokenRangeError before anything runs, and stores nothing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from promptstore import PromptStore
from promptstore.errors import InvalidTokensError, TokenRangeError
from promptstore.store.tokens import vocabulary_size
from promptstore.testing.models import tiny_model

from ..conftest import child_failure, forward, fresh_cache, prompt_tokens, run_isolated

VOCAB = 256  # the tiny models' vocabulary

ENTRY_POINTS = """
import sys
import mlx.core as mx
import promptstore
from promptstore import PromptStore
from promptstore.testing.models import tiny_model
from promptstore.testing.tokenizer import demo_tokenizer

model, tokenizer = tiny_model("llama"), demo_tokenizer()
bad = [1, 2, 3, 10**6]
with PromptStore.open(sys.argv[1], durability="sync") as store:
    space = store.bind(model, model_id="m")
    cache = space.new_cache()
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    calls = {
        "fetch": lambda: space.fetch(bad),
        "insert": lambda: space.insert(bad, cache),
        "generate": lambda: promptstore.generate(model, tokenizer, bad, space=space, max_tokens=2),
        "stream_generate": lambda: list(promptstore.stream_generate(model, tokenizer, bad, space=space, max_tokens=2)),
    }
    for name, call in calls.items():
        try:
            call()
            print(name, "accepted")
        except Exception as e:
            print(name, type(e).__name__)
    print("nodes", len(list(store.index.iter_nodes(space.namespace))))
"""


def test_every_entry_point_refuses_a_token_past_the_vocabulary(tmp_path):
    result = run_isolated(ENTRY_POINTS, str(tmp_path / "store"))
    assert child_failure(result) == ""
    lines = result.stdout.splitlines()
    assert lines == [f"{name} TokenRangeError" for name in ("fetch", "insert", "generate", "stream_generate")] + [
        "nodes 0"
    ]
    assert not list((tmp_path / "store" / "cold" / "files").rglob("*.safetensors"))


@pytest.mark.parametrize(
    "tokens",
    [[0, VOCAB], np.array([VOCAB + 5, 1], dtype=np.int64), mx.array([3, 2**31], dtype=mx.uint32), [2**32 - 1, 0]],
    ids=["list", "numpy", "mlx", "largest uint32"],
)
def test_out_of_vocabulary_tokens_are_refused_by_fetch_and_insert(tmp_path, tokens):
    model = tiny_model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        cache = fresh_cache(model)
        forward(model, cache, prompt_tokens(2))
        for call in (lambda: space.fetch(tokens), lambda: space.insert(tokens, cache)):
            with pytest.raises(TokenRangeError) as info:
                call()
            assert isinstance(info.value, InvalidTokensError)
            assert "vocabulary of 256" in str(info.value)
        assert list(store.index.iter_nodes(space.namespace)) == []
        # The last id inside the vocabulary is fine.
        edge = mx.array([VOCAB - 1, 0, VOCAB - 1], dtype=mx.uint32)
        cache = fresh_cache(model)
        forward(model, cache, edge)
        assert space.insert(edge, cache) == 3
        assert space.fetch(edge).length == 2


def test_vocabulary_size_is_the_token_embeddings_rows():
    import mlx.nn as nn

    assert vocabulary_size(tiny_model("llama4")) == VOCAB  # nested under language_model
    assert vocabulary_size(tiny_model("llama", vocab_size=512)) == 512
    quantized = tiny_model("llama")
    nn.quantize(quantized, group_size=32, bits=4)
    assert vocabulary_size(quantized) == VOCAB
    assert vocabulary_size(nn.Linear(4, 4)) is None
