"""Fidelity under every durability: a conversation's turn, restored from memory,
from its files after a clean close, and after a second restart, equals a full
prefill (logits within 1e-4, greedy tokens identical) for each cache kind. The
durabilities come from the settings themselves: a new one runs here at once."""

from __future__ import annotations

from typing import get_args

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.config import Settings

from ..conftest import forward, fresh_cache, greedy, prompt_tokens

DURABILITIES = get_args(Settings.model_fields["durability"].annotation)
FAMILIES = ("llama", "gemma3_text", "qwen3_next")


def store_turn(space, model, tokens) -> None:
    """A chat turn as generation stores it: prefill past the hit, inserting at each checkpoint."""
    hit = space.fetch(tokens)
    position = hit.length
    for point in (*hit.checkpoints, len(tokens)):
        if point > position:
            forward(model, hit.cache, tokens[position:point])
            space.insert(tokens[:point], hit.cache, turn=True)
            position = point


def assert_restores_as_prefill(space, model, tokens, at_least: int) -> None:
    hit = space.fetch(tokens)
    assert hit.length >= at_least
    want_cache = fresh_cache(model)
    want = forward(model, want_cache, tokens)
    got = forward(model, hit.cache, tokens[hit.length :])
    assert mx.abs(want - got).max().item() < 1e-4
    assert greedy(model, hit.cache, got, 8) == greedy(model, want_cache, want, 8)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_turn_restores_as_a_full_prefill_under_every_durability(tmp_path, model_of, durability, family):
    model = model_of(family)
    turn = prompt_tokens(120, seed=71)
    following = mx.concatenate([turn, prompt_tokens(8, seed=72)])  # the next turn: goes on from all of it
    with PromptStore.open(tmp_path, durability=durability, warm_start=False) as store:
        space = store.bind(model, model_id="m")
        store_turn(space, model, turn)
        assert_restores_as_prefill(space, model, following, len(turn))  # hot
    assert store.unwritten == (0, 0) and store.declined == (0, 0)
    for _ in range(2):  # from disk, and again after a restart that read it
        with PromptStore.open(tmp_path, durability=durability, warm_start=False) as store:
            assert_restores_as_prefill(store.bind(model, model_id="m"), model, following, len(turn))
