"""OpenAI's Responses API on a real `promptstore serve`, through the official
`openai` SDK's client.responses.create: replies equal a full prefill's, plain
and streamed, stateless turns restore the previous turn (after a restart too),
a function call round trip renders as chat completions does, and bad input
gets the API's error shape and stores nothing."""

from __future__ import annotations

import httpx
import openai
import pytest

from .api_clients import WEATHER, conversation_length, prompt_tokens, reference_text, tool_model
from .conftest import QUESTIONS, SYSTEM, chat

MAX_TOKENS = 12


def respond(client, input, **kwargs):
    return client.responses.create(
        model="default_model", input=input, max_output_tokens=MAX_TOKENS, temperature=0, **kwargs
    )


def test_plain_and_streamed_responses_equal_a_full_prefill(serve, model_dir):
    model = model_dir("llama")
    client = serve(model).client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    prompt = len(prompt_tokens(model, messages))
    r = respond(client, QUESTIONS[0], instructions=SYSTEM)
    assert r.output_text == reference_text(model, messages, MAX_TOKENS)
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.usage.input_tokens == prompt and r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens <= MAX_TOKENS and r.usage.total_tokens == prompt + r.usage.output_tokens
    events = list(respond(client, QUESTIONS[0], instructions=SYSTEM, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text
    done = events[-1]
    assert done.type == f"response.{r.status}" and done.response.output_text == streamed
    assert done.response.usage.input_tokens_details.cached_tokens == prompt - 1  # the same prompt again


def test_stateless_turns_restore_the_previous_turn_and_after_a_restart(serve, model_dir):
    """The client sends back each response's output items with the next input."""
    model = model_dir("llama")
    server = serve(model)
    client = server.client()
    items: list = []
    messages = [{"role": "system", "content": SYSTEM}]
    previous = 0
    for n, question in enumerate(QUESTIONS[:3]):
        if n == 2:
            assert server.stop() == 0
            server = serve(model, store=server.store)
            client = server.client()
        items.append({"role": "user", "content": question})
        messages.append({"role": "user", "content": question})
        r = respond(client, items, instructions=SYSTEM, stream=n == 1)
        if n == 1:
            r = list(r)[-1].response
        assert r.output_text == reference_text(model, messages, MAX_TOKENS), f"turn {n}"
        cached = r.usage.input_tokens_details.cached_tokens
        assert cached >= previous and (cached > 0) == (n > 0), f"turn {n}: {cached} of {previous}"
        items += [item.model_dump(exclude_none=True) for item in r.output]
        messages.append({"role": "assistant", "content": r.output_text})
        previous = conversation_length(model, messages)
    assert server.stop() == 0


def test_a_function_call_round_trip_renders_and_restores_as_chat_completions(serve, model_dir, tmp_path):
    """The client sends the model's function_call item and its output back (a
    random-weight model never calls a tool itself): the prompt renders through
    the tool-calling template exactly as the chat completions form does."""
    model = tool_model(model_dir("llama"), tmp_path / "tool-model")
    client = serve(model).client()
    arguments = '{"city": "Paris"}'
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    tools = [{"type": "function", "function": WEATHER}]
    prompt = prompt_tokens(model, messages, tools)
    r = respond(client, items, instructions=SYSTEM, tools=[{"type": "function", **WEATHER}])
    assert r.output_text == reference_text(model, messages, MAX_TOKENS, tools)
    assert r.usage.input_tokens == len(prompt) and r.usage.input_tokens_details.cached_tokens == 0
    reply, _, cached = chat(client, messages, max_tokens=MAX_TOKENS, tools=tools)
    assert cached == len(prompt) - 1 and reply == r.output_text


BAD = [
    ({"input": 5}, "input", "input must be a string or a list, got 5"),
    ({"input": []}, "input", "input must be a string or a non-empty list"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role", "input[0].role must be one of"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "'web_search_call' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url", "data URL"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0].type", "input_text"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
        None,
        "this model takes no images",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
        "input[0].arguments",
        "a JSON object in a string",
    ),
    ({"instructions": 3}, "instructions", "instructions must be a string"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'function'"),
    ({"max_output_tokens": 0}, "max_output_tokens", "must be at least 1, got 0"),
    ({"temperature": -1}, "temperature", "temperature must be at least 0, got -1"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.type", "'text'"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the conversation in 'input'"),
]


def test_bad_input_gets_the_responses_error_shape_and_stores_nothing(serve, model_dir):
    """Every refused request shares the good one's instructions: had any been
    stored, even in part, the good one would restore it."""
    server = serve(model_dir("llama"))
    good = {"model": "default_model", "instructions": SYSTEM, "input": QUESTIONS[0], "max_output_tokens": 4}
    with httpx.Client(trust_env=False, timeout=60) as http:
        for change, param, message in BAD:
            r = http.post(server.url + "/v1/responses", json=good | change)
            assert r.status_code == 400, (change, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, error
            assert message in error["message"], (message, error)
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="not served") as refused:
        client.responses.create(model="someone/else", input=QUESTIONS[0], instructions=SYSTEM)
    assert refused.value.body["param"] == "model"
    r = respond(client, QUESTIONS[0], instructions=SYSTEM)
    assert r.usage.input_tokens_details.cached_tokens == 0
