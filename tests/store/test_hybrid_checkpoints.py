"""Checkpoints on the prefill grid: asked for where layers need them, followed by
generate, kept in memory, dropped when spilled if no prompt used them, counted."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest

import promptstore
from promptstore import PromptStore
from promptstore.testing.tokenizer import demo_tokenizer

from ..conftest import _model, forward, fresh_cache, insert_following_checkpoints, prompt_tokens
from .test_end_to_end import chat_model

STEP = 8
A = prompt_tokens(44, seed=81)


def diverging(at: int, seed: int) -> mx.array:
    return mx.concatenate([A[:at], prompt_tokens(6, seed=seed)])


@pytest.mark.parametrize(
    "family, expected",
    [("llama", ()), ("gemma3_text", (8, 16, 24, 32, 40)), ("qwen3_next", (8, 16, 24, 32, 40))],
)
def test_hits_ask_for_every_prefill_step_where_layers_need_one(tmp_path, family, expected):
    with PromptStore.open(tmp_path, prefill_step=STEP) as store:
        space = store.bind(_model(family), model_id="m")
        assert space.fetch(A).checkpoints == expected
    with PromptStore.open(tmp_path, prefill_step=STEP, checkpoint_interval=16) as store:
        space = store.bind(_model(family), model_id="m")
        assert space.fetch(A).checkpoints == tuple(p for p in expected if p % 16 == 0)


@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1"])
def test_unused_states_are_dropped_when_spilled_and_come_back(tmp_path, family):
    model = _model(family)
    with PromptStore.open(tmp_path, prefill_step=STEP) as store:  # write_back: spilled at close
        space = store.bind(model, model_id="m")
        insert_following_checkpoints(space, model, A)
        assert space.fetch(diverging(21, seed=82)).length == 16  # the state at 16 is used
        costs = space.checkpoint_counters()
        assert costs["checkpoints"] == 5 and costs["checkpoint_bytes"] > 0
        assert (costs["checkpoint_hits"], costs["checkpoint_tokens"]) == (1, 16)
    with PromptStore.open(tmp_path, prefill_step=STEP, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        state = space.namespace.state_mask
        kept = {n.end: n.present & state == state for n in store.index.iter_nodes(space.namespace)}
        # Used (16) and the leaf (44) keep their state; the unused ones in between do not.
        assert kept == {8: False, 16: True, 24: False, 32: False, 40: False, 44: True}
        counts = space.checkpoint_counters()
        assert counts["checkpoints_dropped"] == 4 and counts["checkpoint_bytes_dropped"] > 0
        hit = space.fetch(diverging(29, seed=83))
        assert (hit.length, 24 in hit.checkpoints) == (16, True)  # passing 24 again stores its state again
        tokens = diverging(29, seed=83)
        got = forward(model, hit.cache, tokens[hit.length :])
        assert mx.abs(got - forward(model, fresh_cache(model), tokens)).max().item() < 1e-4
        insert_following_checkpoints(space, model, tokens)  # a branch point at 29: its state is kept
        assert space.fetch(diverging(30, seed=84)).length == 29


def test_generate_follows_the_grid(tmp_path):
    model, tokenizer = chat_model("qwen3_next"), demo_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Which books about sailing?"}])
    want = mlx_lm.generate(model, tokenizer, prompt, max_tokens=6)
    with PromptStore.open(tmp_path, prefill_step=STEP) as store:
        space = store.bind(model, model_id="m")
        assert promptstore.generate(model, tokenizer, prompt, space=space, max_tokens=6) == want
        ends = {n.end for n in store.index.iter_nodes(space.namespace)}
        assert set(range(STEP, len(prompt) - 1, STEP)) <= ends
