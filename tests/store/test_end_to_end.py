"""End to end: replies generated through the store equal replies without it,
token for token, across turns, restarts and forks, for every family."""

import functools

import mlx.core as mx
import mlx_lm
import pytest

import promptstore
from promptstore.testing.models import tiny_model
from promptstore.testing.tokenizer import demo_tokenizer

from ..conftest import forward, fresh_cache, prompt_tokens

FAMILIES = ["llama", "gemma3_text", "qwen3_next", "llama4", "falcon_h1", "baichuan_m1"]
SYSTEM = (
    "You are a helpful assistant for a small bookshop. You help customers find books and explain the opening hours."
)
TURNS = ["Do you have any books about sailing?", "Is the shop open on Saturday?", "Thank you, please set one aside."]


@functools.cache
def chat_model(family):
    return tiny_model(family, vocab_size=512)


def conversation(tokenizer, turns, replies):
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, reply in zip(turns, replies + [None]):
        messages.append({"role": "user", "content": turn})
        if reply is not None:
            messages.append({"role": "assistant", "content": reply})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def chat(model, tokenizer, space, turns=TURNS, max_tokens=12):
    replies = []
    for i in range(len(turns)):
        prompt = conversation(tokenizer, turns[: i + 1], replies)
        if space is None:
            text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens)
        else:
            text = promptstore.generate(model, tokenizer, prompt, space=space, max_tokens=max_tokens)
        replies.append(text)
    return replies


@pytest.mark.parametrize("family", FAMILIES)
def test_replies_equal_replies_without_the_store(tmp_path, family):
    model, tokenizer = chat_model(family), demo_tokenizer()
    want = chat(model, tokenizer, None)
    with promptstore.PromptStore.open(tmp_path, checkpoint_interval=32) as store:
        space = store.bind(model, model_id=family)
        assert chat(model, tokenizer, space) == want
        space.flush_stats()  # hit counters are written in batches
        counters = store.index.counters(space.namespace)
        assert counters["hits"] >= 2 and counters["tokens_served"] > 0
    # After a restart the whole conversation is served from disk.
    with promptstore.PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id=family)
        assert chat(model, tokenizer, space) == want
        last = conversation(tokenizer, TURNS, want[:-1] + ["x"])
        assert space.fetch(last).length > len(conversation(tokenizer, TURNS[:2], want[:1])) // 2


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_forks_are_independent(tmp_path, family):
    """Writing into one hit's caches changes no other hit and no stored node."""
    model = chat_model(family)
    tokens = prompt_tokens(80, seed=11, vocab=512)
    with promptstore.PromptStore.open(tmp_path, checkpoint_interval=16, durability="sync") as store:
        space = store.bind(model, model_id="m")
        hit = space.fetch(tokens[:64])
        forward(model, hit.cache, tokens[:64][hit.length :])
        space.insert(tokens[:64], hit.cache)
        a, b = space.fetch(tokens), space.fetch(tokens)
        assert a.length == b.length == 64
        # Fork a diverges; b must still continue exactly like a fresh prefill.
        forward(model, a.cache, prompt_tokens(20, seed=12, vocab=512))
        want = forward(model, fresh_cache(model), tokens)
        got = forward(model, b.cache, tokens[64:])
        assert mx.abs(want - got).max().item() < 1e-4
        c = space.fetch(tokens)
        again = forward(model, c.cache, tokens[64:])
        assert mx.abs(want - again).max().item() < 1e-4


def test_fork_and_diverge_hits_the_shared_prefix(tmp_path):
    model = chat_model("gemma3_text")
    base = prompt_tokens(70, seed=13, vocab=512)
    branches = [mx.concatenate([base[:50], prompt_tokens(25, seed=20 + i, vocab=512)]) for i in range(3)]
    with promptstore.PromptStore.open(tmp_path, checkpoint_interval=16) as store:
        space = store.bind(model, model_id="m")
        for seq in [base] + branches:
            hit = space.fetch(seq)
            pos = hit.length
            for point in hit.checkpoints + (len(seq),):
                forward(model, hit.cache, seq[pos:point])
                space.insert(seq[:point], hit.cache)
                pos = point
        # The third branch diverged at 50, where the first branch left a checkpoint.
        hit = space.fetch(branches[2])
        assert hit.length == len(branches[2]) - 1 or hit.length >= 48
        want = forward(model, fresh_cache(model), branches[2])
        got = forward(model, hit.cache, branches[2][hit.length :])
        assert mx.abs(want - got).max().item() < 1e-4
