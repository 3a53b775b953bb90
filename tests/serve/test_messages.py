"""The Anthropic Messages API on a real `promptstore serve`, through the official
`anthropic` SDK: replies equal a full prefill's (a server on an empty store),
streaming, a tool-use round trip, cache_read_input_tokens over turns and a
restart, cache_control marks as checkpoints, tenants, and errors in the API's
shape that store nothing."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from .api_clients import (
    WEATHER,
    anthropic_client,
    conversation_length,
    prompt_tokens,
    reference_text,
    reference_tokens,
    tool_model,
)
from .conftest import QUESTIONS, SYSTEM, api_keys_file, chat, loaded

MAX_TOKENS = 12


def ask(client, messages, *, stream=False, **kwargs):
    """(text, usage, stop_reason) of one reply, created or streamed."""
    args = dict(model="default_model", max_tokens=MAX_TOKENS, messages=messages, **kwargs)
    if stream:
        with client.messages.stream(**args) as events:
            text = "".join(events.text_stream)
            message = events.get_final_message()
        assert message.content[0].text == text
    else:
        message = client.messages.create(**args)
    text = "".join(b.text for b in message.content if b.type == "text")
    return text, message.usage, message.stop_reason


def as_chat(system: str, messages: list[dict]) -> list[dict]:
    return [{"role": "system", "content": system}, *messages]


def test_four_turns_restore_the_previous_turn_and_replies_equal_a_full_prefill(serve, model_dir):
    """Turns alternate messages.create and messages.stream; the store survives a
    restart after the second turn. Recent SDKs send no temperature: the server's
    default (0) applies."""
    model = model_dir("llama")
    server = serve(model)
    client = anthropic_client(server)
    messages: list[dict] = []
    previous, restored = 0, -1
    for n, question in enumerate(QUESTIONS):
        if n == 2:
            assert server.stop() == 0
            server = serve(model, store=server.store)
            client = anthropic_client(server)
        messages.append({"role": "user", "content": question})
        text, usage, stop = ask(client, messages, system=SYSTEM, stream=n % 2 == 1)
        rendered = as_chat(SYSTEM, messages)
        assert text == reference_text(model, rendered, MAX_TOKENS), f"turn {n}"
        assert stop in ("end_turn", "max_tokens")
        prompt = len(prompt_tokens(model, rendered))
        assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == prompt
        assert usage.cache_read_input_tokens >= previous, f"turn {n} restored less than the previous turn"
        assert usage.cache_read_input_tokens > restored
        if n == 0:
            assert usage.cache_read_input_tokens == 0 and usage.cache_creation_input_tokens == prompt
        else:  # what the store lacked: the new turn, stored with the reply
            assert usage.cache_creation_input_tokens == prompt - usage.cache_read_input_tokens
        restored = usage.cache_read_input_tokens
        messages.append({"role": "assistant", "content": text})
        previous = conversation_length(model, as_chat(SYSTEM, messages))
    # The same request again is held whole: nothing new to store.
    _, usage, _ = ask(client, messages[:-1], system=SYSTEM)
    assert usage.cache_creation_input_tokens == 0 and usage.input_tokens == 1
    assert server.stop() == 0


def test_system_blocks_sampling_stop_sequences_and_count_tokens(serve, model_dir):
    model = model_dir("llama")
    client = anthropic_client(serve(model))
    system = [{"type": "text", "text": SYSTEM[:60]}, {"type": "text", "text": SYSTEM[60:]}]
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTIONS[0]}]}]
    text, usage, _ = ask(client, messages, system=system)
    rendered = as_chat(SYSTEM, [{"role": "user", "content": QUESTIONS[0]}])  # blocks joined
    assert text == reference_text(model, rendered, MAX_TOKENS)
    # Sampling fields a client sends are used: top_k 1 is greedy whatever the temperature.
    sampled, _, _ = ask(client, messages, system=system, extra_body={"temperature": 1.0, "top_k": 1})
    assert sampled == text
    count = client.messages.count_tokens(model="default_model", system=system, messages=messages)
    assert count.input_tokens == len(prompt_tokens(model, rendered))
    # A stop sequence the reply would spell (one token of it, seen there first) ends it there.
    _, tokenizer = loaded(model)
    tokens = reference_tokens(model, rendered, MAX_TOKENS)
    k, stop = next(
        (k, word)
        for k, t in enumerate(tokens[2:], 2)
        if t not in tokens[:k]
        and (word := tokenizer.decode([t])).strip()
        and "\ufffd" not in word
        and tokenizer.encode(word, add_special_tokens=False) == [t]
    )
    message = client.messages.create(
        model="default_model", max_tokens=MAX_TOKENS, system=system, messages=messages, stop_sequences=["zzz", stop]
    )
    cut = "".join(b.text for b in message.content)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.usage.output_tokens == k + 1 and text.startswith(cut) and len(cut) < len(text)


def test_a_tool_use_round_trip_renders_and_restores_as_chat_completions(serve, model_dir, tmp_path):
    """The client sends the assistant's tool_use block and its tool_result back
    (a random-weight model never calls a tool itself): the prompt renders through
    the model's tool-calling template exactly as the same conversation in chat
    completions form, so each API restores what the other stored."""
    model = tool_model(model_dir("llama"), tmp_path / "tool-model")
    server = serve(model)
    client = anthropic_client(server)
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 21 C"}]}
            ],
        },
    ]
    chat_messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
    ]
    tools = [{"type": "function", "function": WEATHER}]
    prompt = prompt_tokens(model, chat_messages, tools)
    _, tokenizer = loaded(model)
    rendered = tokenizer.decode(prompt)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in rendered and '"name": "get_weather"' in rendered
    text, usage, _ = ask(client, messages, system=SYSTEM, tools=[tool])
    assert text == reference_text(model, chat_messages, MAX_TOKENS, tools)
    assert usage.cache_read_input_tokens == 0 and usage.cache_creation_input_tokens == len(prompt)
    # The same conversation through chat completions: every token but the last restored.
    reply, _, cached = chat(server.client(), chat_messages, max_tokens=MAX_TOKENS, tools=tools)
    assert cached == len(prompt) - 1 and reply == text
    # The next turn restores the whole previous one (the reply realigned as the template renders it).
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks. And tomorrow?"}]
    chat_messages += [{"role": "assistant", "content": text}]
    previous = conversation_length(model, chat_messages, tools)
    chat_messages += [{"role": "user", "content": "Thanks. And tomorrow?"}]
    text, usage, _ = ask(client, messages, system=SYSTEM, tools=[tool])
    assert text == reference_text(model, chat_messages, MAX_TOKENS, tools)
    assert usage.cache_read_input_tokens >= previous


def test_a_cache_control_mark_mid_conversation_becomes_a_checkpoint(serve, model_dir, tmp_path):
    """qwen3_next's recurrent layers restore only where their state was stored. A
    block marked with cache_control is stored as a node boundary even when the
    conversation goes on past it: a later conversation that shares the prompt up
    to the mark restores exactly that far, where an unmarked one (another tenant,
    the same requests) restores the system prompt only."""
    model = model_dir("qwen3_next")
    keys = {"marked": "salt-marked-1", "plain": "salt-plain-2"}
    server = serve(model, "--api-keys", str(api_keys_file(tmp_path / "keys.json", keys)))
    first = QUESTIONS[0]
    restored = {}
    for tenant in keys:
        client = anthropic_client(server, api_key=tenant)
        block = {"type": "text", "text": first} | (
            {"cache_control": {"type": "ephemeral"}} if tenant == "marked" else {}
        )
        went_on = [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": QUESTIONS[1]}]
        ask(client, [{"role": "user", "content": [block]}, *went_on], system=SYSTEM)
        other = [{"role": "assistant", "content": "No."}, {"role": "user", "content": QUESTIONS[2]}]
        _, usage, _ = ask(client, [{"role": "user", "content": first}, *other], system=SYSTEM)
        restored[tenant] = usage.cache_read_input_tokens
    at_mark = conversation_length(model, as_chat(SYSTEM, [{"role": "user", "content": first}]))
    assert restored["marked"] == at_mark
    assert 0 < restored["plain"] < at_mark  # the system prompt's end
    assert server.stop() == 0


def test_x_api_key_and_bearer_name_the_same_tenant(serve, model_dir, tmp_path):
    model = model_dir("llama")
    server = serve(
        model, "--api-keys", str(api_keys_file(tmp_path / "keys.json", {"key-a": "salt-a", "key-b": "salt-b"}))
    )
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    body = {"model": "default_model", "max_tokens": 4, "system": SYSTEM, "messages": messages}
    with httpx.Client(trust_env=False, timeout=60) as http:
        r = http.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "key-a"})
        assert r.status_code == 200 and r.json()["usage"]["cache_read_input_tokens"] == 0
        r = http.post(server.url + "/v1/messages?beta=true", json=body, headers={"x-api-key": "key-mallory"})
        assert r.status_code == 401
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    _, usage, _ = ask(anthropic_client(server, api_key="key-a"), messages, system=SYSTEM)  # the SDK: Bearer
    assert usage.cache_read_input_tokens > 0
    _, usage, _ = ask(anthropic_client(server, api_key="key-b"), messages, system=SYSTEM)
    assert usage.cache_read_input_tokens == 0  # no hits across tenants


BAD = [
    ({"max_tokens": None}, 400, "max_tokens is required"),
    ({"max_tokens": 0}, 400, "max_tokens must be at least 1, got 0"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, 400, "messages.0.role must be 'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": 7}]}, 400, "messages.0.content must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400, "messages.0.content.0.type 'video'"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
        400,
        "not supported in a user message",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages.0.content.0.text must"),
    ({"cache_control": {"type": "forever"}}, 400, "cache_control must be"),
    ({"tools": [{"name": "x"}]}, 400, "tools.0.input_schema is required"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0.type"),
    ({"temperature": 3}, 400, "temperature must be at most 1, got 3"),
    ({"model": "someone/else"}, 404, "not served"),
]


def test_bad_requests_get_the_messages_error_shape_and_store_nothing(serve, model_dir):
    """Every refused request shares the good one's system prompt: had any of them
    been stored, even in part, the good one would restore it."""
    server = serve(model_dir("llama"))
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    good = {"model": "default_model", "max_tokens": 4, "system": SYSTEM, "messages": messages}
    with httpx.Client(trust_env=False, timeout=60) as http:
        for change, status, message in BAD:
            body = {k: v for k, v in (good | change).items() if v is not None}
            r = http.post(server.url + "/v1/messages", json=body)
            assert r.status_code == status, (change, r.text)
            error = r.json()
            assert error["type"] == "error", error
            assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
            assert message in error["error"]["message"], (message, error)
        r = http.post(
            server.url + "/v1/messages", content=b'{"max_tokens": ', headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError, match="not served"):
        anthropic_client(server).messages.create(model="claude-x", max_tokens=4, system=SYSTEM, messages=messages)
    _, usage, _ = ask(anthropic_client(server), messages, system=SYSTEM)
    assert usage.cache_read_input_tokens == 0
