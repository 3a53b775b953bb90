"""Multi-turn chats through a real `promptstore serve`: replies equal a full
prefill's, each turn restores the whole previous turn, and so after a restart."""

import pytest

from promptstore.snapshots import device

from .conftest import QUESTIONS, SYSTEM, chat, reference_reply, rendered_length, store_problems


@pytest.mark.parametrize("options", [(), ("--no-reply-before-fetch",)], ids=["reply-first", "batch-prefills-reply"])
def test_each_turn_restores_the_previous_turn_and_replies_equal_a_full_prefill(serve, model_dir, options):
    """Replies equal a full prefill's with and without --no-reply-before-fetch.
    Without it each turn restores the whole previous turn; with it, at least the
    previous turn's prompt (its reply is stored either in the quiet before the
    next turn or, when that comes first, by the next turn's batch; which one
    happens here is not controlled: tests/serve/test_cache.py covers both)."""
    model = model_dir("llama")
    server = serve(model, *options)
    client = server.client()
    messages = [{"role": "system", "content": SYSTEM}]
    previous = 0  # tokens of the conversation so far, as the template renders it
    for n, question in enumerate(QUESTIONS):
        if n == 2:  # the store survives a restart: the next turn hits the same
            assert server.stop() == 0
            server = serve(model, *options, store=server.store)
            client = server.client()
        messages.append({"role": "user", "content": question})
        asked = rendered_length(model, messages[:-2]) if n else 0  # the previous turn's messages, no reply
        text, ids, cached = chat(client, messages)
        assert ids == reference_reply(model, messages, 12), f"turn {n}"
        least = asked if options else previous
        assert cached >= least, f"turn {n} restored {cached} tokens, fewer than {least}"
        assert (cached > 0) == (n > 0)
        messages.append({"role": "assistant", "content": text})
        previous = rendered_length(model, messages)
    assert server.stop() == 0
    assert store_problems(server.store) == {}


def test_streamed_reply_equals_the_full_reply(serve, model_dir):
    model = model_dir("llama")
    client = serve(model).client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    whole, _, _ = chat(client, messages, max_tokens=16)
    stream = client.chat.completions.create(
        model="default_model",
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_hybrid_model_hits_the_shared_system_prompt_on_the_second_conversation(serve, model_dir, family):
    """Recurrent (qwen3_next) and sliding-window (gemma3_text) layers restore
    only where a whole state was stored: the first conversation stores the
    system segment's end."""
    model = model_dir(family)
    client = serve(model).client()
    system = [{"role": "system", "content": SYSTEM}]
    first = system + [{"role": "user", "content": QUESTIONS[0]}]
    text, ids, cached = chat(client, first)
    assert ids == reference_reply(model, first, 12) and cached == 0
    second = system + [{"role": "user", "content": QUESTIONS[1]}]
    _, ids, cached = chat(client, second)
    assert ids == reference_reply(model, second, 12)
    assert cached >= rendered_length(model, system)
    # The first conversation's next turn restores its whole first turn.
    first += [{"role": "assistant", "content": text}]
    previous = rendered_length(model, first)
    first += [{"role": "user", "content": QUESTIONS[2]}]
    _, ids, cached = chat(client, first)
    assert ids == reference_reply(model, first, 12)
    assert cached >= previous


def test_speculative_decoding_with_a_draft_model_restores_and_replies_equal(serve, model_dir):
    """--draft-model: mlx_lm.server serves one request at a time and appends the
    draft's caches to the model's; one namespace covers both."""
    model = model_dir("llama")
    client = serve(model, "--draft-model", str(model), "--num-draft-tokens", "2").client()
    messages = [{"role": "system", "content": SYSTEM}]
    previous = 0
    for n, question in enumerate(QUESTIONS[:3]):
        messages.append({"role": "user", "content": question})
        text, ids, cached = chat(client, messages)
        assert ids == reference_reply(model, messages, 12), f"turn {n}"
        assert cached >= previous and (cached > 0) == (n > 0)
        messages.append({"role": "assistant", "content": text})
        previous = rendered_length(model, messages)


@pytest.mark.skipif(
    device.CUDA,
    reason="MLX's CUDA backend has no quantized_matmul for this model's shape (1x101x32x2, 8 bits, group 32)",
)
def test_quantized_kv_cache_restores_and_replies_equal(serve, model_dir):
    """--kv-bits: caches turn quantized past --quantized-kv-start; the store
    keeps plain and quantized layouts in two namespaces of the model."""
    model = model_dir("llama-hd32")
    quantized = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 64}
    client = serve(model, *[f"--{k.replace('_', '-')}={v}" for k, v in quantized.items()]).client()
    messages = [{"role": "system", "content": SYSTEM}]
    previous = 0
    for n, question in enumerate(QUESTIONS[:3]):
        messages.append({"role": "user", "content": question})
        text, ids, cached = chat(client, messages)
        assert ids == reference_reply(model, messages, 12, **quantized), f"turn {n}"
        assert cached >= previous and (cached > 0) == (n > 0)
        messages.append({"role": "assistant", "content": text})
        previous = rendered_length(model, messages)
