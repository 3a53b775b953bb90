"""Helpers for the Messages and Responses API tests: the anthropic client on a
real server, a model directory whose chat template renders tools and tool
calls, and replies and renderings computed in this process without any cache."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import anthropic
import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.generate import generate_step

from promptstore.serve.replies import reply_text

from .conftest import REQUEST_TIMEOUT_S, Server, loaded

# A tool-calling template in the manner of Qwen2.5's (Hermes tool calls), over the
# demo tokenizer's special tokens; mlx-lm reads its calls with the json_tools parser.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "Tools:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call><|end|>'
    "{%- elif messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}<|end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}<|user|><tool_response>\n{{ message['content'] }}\n</tool_response><|end|>"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}<|assistant|>{{ message['content'] }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|end|>"
    "{%- else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def tool_model(model: Path, into: Path) -> Path:
    """A copy of model directory `model` with the tool-calling template."""
    if not into.exists():
        shutil.copytree(model, into)
        (into / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return into


def anthropic_client(server: Server, api_key: str = "none", **kwargs) -> anthropic.Anthropic:
    http = anthropic.DefaultHttpxClient(trust_env=False, timeout=REQUEST_TIMEOUT_S)
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, http_client=http, **kwargs)


def prompt_tokens(model: Path, messages: list[dict], tools=None) -> list[int]:
    """A chat request's prompt as mlx_lm.server renders it (content parts joined,
    tool call arguments parsed), with the generation prompt."""
    _, tokenizer = loaded(model)
    messages = copy.deepcopy(messages)
    mlx_server.process_message_content(messages)
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))


def conversation_length(model: Path, messages: list[dict], tools=None) -> int:
    """Tokens of a conversation as rendered, without a generation prompt."""
    _, tokenizer = loaded(model)
    messages = copy.deepcopy(messages)
    mlx_server.process_message_content(messages)
    return len(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False))


def reference_tokens(model: Path, messages: list[dict], max_tokens: int, tools=None) -> list[int]:
    """Greedy reply tokens from a full prefill of the rendered prompt (no cache at
    all), as a server on an empty store generates them."""
    net, tokenizer = loaded(model)
    prompt = prompt_tokens(model, messages, tools)
    out = []
    greedy = lambda x: x.argmax(-1)  # noqa: E731
    for token, _ in generate_step(mx.array(prompt), net, max_tokens=max_tokens, sampler=greedy):
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return out


def reference_text(model: Path, messages: list[dict], max_tokens: int, tools=None) -> str:
    """The text of reference_tokens' reply, as a server writes it."""
    _, tokenizer = loaded(model)
    return reply_text(tokenizer, reference_tokens(model, messages, max_tokens, tools))
