"""One rendering path for chat completions, Messages and Responses: a
conversation sent through any of them renders to the same tokens and restores
the same from the store (a real server); the two APIs' translations give the
same chat request, a request's cache_control marks its last block; a tool call
the model writes becomes a tool_use block and a function_call item, in shapes
the official SDKs validate."""

from __future__ import annotations

from itertools import groupby

import anthropic.types
import openai.types.responses
import pydantic
import pytest
from mlx_lm import server as mlx_server
from mlx_lm.generate import make_text_state_machine

from promptstore.serve.apis.chat import marked_positions
from promptstore.serve.apis.events import Finish, ToolCall, reply_events
from promptstore.serve.apis.exchange import InputTokens, play
from promptstore.serve.apis.messages import MessageReply, MessagesAPI
from promptstore.serve.apis.responses import ResponseReply, ResponsesAPI
from promptstore.testing.tokenizer import demo_tokenizer

from .api_clients import WEATHER, anthropic_client, conversation_length, reference_text, tool_model
from .conftest import QUESTIONS, SYSTEM, api_keys_file, chat, loaded

MAX_TOKENS = 12


def via_chat(server, key: str, messages: list[dict]) -> tuple[str, int]:
    text, _, cached = chat(server.client(key), messages, max_tokens=MAX_TOKENS)
    return text, cached


def via_messages(server, key: str, messages: list[dict]) -> tuple[str, int]:
    client = anthropic_client(server, api_key=key)
    m = client.messages.create(
        model="default_model", max_tokens=MAX_TOKENS, system=messages[0]["content"], messages=messages[1:]
    )
    return "".join(b.text for b in m.content), m.usage.cache_read_input_tokens


def via_responses(server, key: str, messages: list[dict]) -> tuple[str, int]:
    r = server.client(key).responses.create(
        model="default_model",
        instructions=messages[0]["content"],
        input=messages[1:],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    return r.output_text, r.usage.input_tokens_details.cached_tokens


def test_one_conversation_restores_the_same_through_all_three_apis(serve, model_dir, tmp_path):
    """Four tenants hold the same conversation: three through one API each, the
    fourth through each API in turn. Every turn gives the same reply and restores
    the same tokens in all four: the same tokens, whichever API rendered them."""
    model = model_dir("llama")
    apis = {"chat": [via_chat], "messages": [via_messages], "responses": [via_responses]}
    apis["mixed"] = [via_chat, via_messages, via_responses]
    keys = api_keys_file(tmp_path / "keys.json", {name: f"salt-{name}-0" for name in apis})
    server = serve(model, "--api-keys", str(keys))
    conversations = {name: [{"role": "system", "content": SYSTEM}] for name in apis}
    previous = 0  # the conversation so far, as rendered
    for n, question in enumerate(QUESTIONS[:3]):
        turns = {}
        for name, ways in apis.items():
            conversations[name].append({"role": "user", "content": question})
            turns[name] = ways[n % len(ways)](server, name, conversations[name])
            conversations[name].append({"role": "assistant", "content": turns[name][0]})
        assert len(set(turns.values())) == 1, f"turn {n}: {turns}"
        text, cached = turns["chat"]
        assert text == reference_text(model, conversations["chat"][:-1], MAX_TOKENS)
        assert cached >= previous and (cached > 0) == (n > 0)
        previous = conversation_length(model, conversations["chat"])
    assert server.stop() == 0


# --- translations -------------------------------------------------------------------

CALL = {"city": "Paris"}


def test_the_two_apis_translate_one_conversation_to_the_same_chat_request():
    tool_use = {"type": "tool_use", "id": "c1", "name": "get_weather", "input": CALL}
    result = {"type": "tool_result", "tool_use_id": "c1", "content": "Sunny"}
    messages_body = {
        "max_tokens": 8,
        "system": SYSTEM,
        "tools": [
            {"name": "get_weather", "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
        ],
        "messages": [
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, tool_use]},
            {"role": "user", "content": [result, {"type": "text", "text": "Thanks."}]},
        ],
    }
    responses_body = {
        "max_output_tokens": 8,
        "instructions": SYSTEM,
        "tools": [{"type": "function", **WEATHER}],
        "input": [
            {"role": "user", "content": QUESTIONS[0]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "Thanks."}]},
        ],
    }
    a, b = MessagesAPI(None).translate(messages_body), ResponsesAPI(None).translate(responses_body)
    assert [m["role"] for m in a.messages] == ["system", "user", "assistant", "tool", "user"]
    assert a.tools == b.tools == [{"type": "function", "function": WEATHER}]
    for chat_request in (a, b):  # arguments parsed, as mlx_lm.server does before it renders
        mlx_server.process_message_content(chat_request.messages)
    assert a.messages == b.messages


def test_the_requests_cache_control_marks_the_end_of_its_last_block():
    tok = demo_tokenizer(512)
    body = {"max_tokens": 8, "system": SYSTEM, "messages": [{"role": "user", "content": QUESTIONS[0]}]}
    marked = MessagesAPI(None).translate(body | {"cache_control": {"type": "ephemeral"}})
    assert MessagesAPI(None).translate(body).marked == []
    assert marked.marked == [marked.messages]
    prompt = list(tok.apply_chat_template(marked.messages, add_generation_prompt=True))
    whole = len(tok.apply_chat_template(marked.messages, add_generation_prompt=False))
    assert marked_positions(tok, prompt, marked.marked, None, {}) == [whole]
    # A mark mid-message: where the prompt stops agreeing with the cut message's own rendering.
    blocks = [
        {"type": "text", "text": "Hello. ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Bye."},
    ]
    cut = MessagesAPI(None).translate(body | {"messages": [{"role": "user", "content": blocks}]})
    assert cut.marked[0][-1]["content"] == "Hello. " and cut.messages[-1]["content"] == "Hello. Bye."
    prompt = list(tok.apply_chat_template(cut.messages, add_generation_prompt=True))
    (point,) = marked_positions(tok, prompt, cut.marked, None, {})
    assert tok.decode(prompt[:point]).endswith("<|user|>Hello. ") and tok.decode(prompt[point:]).startswith("Bye.")


# --- replies ------------------------------------------------------------------------


def generated(tokenizer, text: str) -> list:
    """mlx_lm.server's responses for a reply that spells `text`, then ends its turn."""
    detokenizer = tokenizer.detokenizer
    out = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        detokenizer.add_token(token)
        out.append(mlx_server.Response(detokenizer.last_segment, token, 0.0, None, ()))
    detokenizer.finalize()
    out.append(mlx_server.Response(detokenizer.last_segment, tokenizer.eos_token_id, 0.0, "stop", ()))
    return out


def test_a_tool_call_in_a_reply_becomes_a_tool_use_block_and_a_function_call_item(model_dir, tmp_path):
    """The generation thread's responses for a reply that calls a tool (spelled
    here: a random-weight model does not write one) go through mlx-lm's own
    state machine and tool parser, and come out in shapes the SDKs validate."""
    _, tokenizer = loaded(tool_model(model_dir("llama"), tmp_path / "tool-model"))
    assert tokenizer.has_tool_calling
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    responses = generated(tokenizer, "Let me look." + call)
    ctx = mlx_server.GenerationContext(
        has_tool_calling=True,
        has_thinking=False,
        tool_parser=tokenizer.tool_parser,
        text_sm=make_text_state_machine(tokenizer, []),
        initial_state="normal",
        prompt=[1, 2, 3],
    )
    events = list(reply_events(ctx, responses, None, tokenizer, []))
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Text"] * (len(kinds) - 2) + ["ToolCall", "Finish"]  # text piece by piece, then the call
    assert "".join(e.text for e in events[:-2]) == "Let me look."
    assert events[-2:] == [ToolCall("get_weather", CALL), Finish("tool_calls", None, len(responses), 0)]
    tokens = InputTokens(3, 0, 3)
    sent: list[tuple[str, dict]] = []
    message = _replay(MessageReply("m", lambda name, data: sent.append((name, data))), events, tokens)
    parsed = anthropic.types.Message.model_validate(message)
    assert [b.type for b in parsed.content] == ["text", "tool_use"] and parsed.stop_reason == "tool_use"
    assert parsed.content[1].input == CALL and parsed.content[0].text == "Let me look."
    stream = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    assert [stream.validate_python(data).type for _, data in sent] == [name for name, _ in sent]
    block = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert [name for name, _ in groupby(name for name, _ in sent)] == [
        "message_start",
        *block,
        *block,
        "message_delta",
        "message_stop",
    ]
    sent.clear()
    chat = type("Chat", (), {"model": "m", "sampling": {}})()
    cli = type("Cli", (), {"temp": 0.0, "top_p": 1.0})()
    response = _replay(ResponseReply(chat, {}, cli, lambda name, data: sent.append((name, data))), events, tokens)
    parsed = openai.types.responses.Response.model_validate(response)
    assert [item.type for item in parsed.output] == ["message", "function_call"]
    assert parsed.output_text == "Let me look." and parsed.output[1].arguments == '{"city": "Paris"}'
    stream = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    assert [stream.validate_python(data).type for _, data in sent] == [name for name, _ in sent]


def _replay(reply, events, tokens):
    play(reply, events, lambda: tokens)
    return reply.body()


@pytest.mark.parametrize("api", [MessagesAPI, ResponsesAPI])
def test_replies_without_events_are_valid_too(api):
    """A reply that ends at once (max tokens of 1 hit by the end-of-turn token)."""
    tokens = InputTokens(5, 4, 0)
    if api is MessagesAPI:
        body = _replay(MessageReply("m", lambda *a: None), [Finish("stop", None, 1, 0)], tokens)
        parsed = anthropic.types.Message.model_validate(body)
        assert parsed.content == [] and parsed.usage.cache_read_input_tokens == 4 and parsed.usage.input_tokens == 1
    else:
        chat = type("Chat", (), {"model": "m", "sampling": {}})()
        cli = type("Cli", (), {"temp": 0.0, "top_p": 1.0})()
        body = _replay(ResponseReply(chat, {}, cli, lambda *a: None), [Finish("length", None, 1, 0)], tokens)
        parsed = openai.types.responses.Response.model_validate(body)
        assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
        assert parsed.usage.input_tokens_details.cached_tokens == 4
