"""OpenAI's Responses API, POST /v1/responses, used statelessly (the client sends
the conversation in `input`): `instructions`, message, function_call and
function_call_output items and function tools become a chat request; the reply
is a response object, or its event stream; errors come in the API's shape."""

from __future__ import annotations

import copy
import json
import time
import uuid

from ...errors import ServeRequestError
from ..schemas import ResponsesBody, checked
from . import fields
from .chat import ChatRequest, Conversation
from .events import Finish, Text, ToolCall
from .exchange import Exchange, InputTokens

# Roles as chat templates know them: a developer message is a system message.
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
SAMPLING = ("temperature", "top_p")
# Fields of server-side state this server does not keep.
STATEFUL = {
    "previous_response_id": "send the conversation in 'input' instead (this server keeps no responses)",
    "conversation": "send the conversation in 'input' instead (this server keeps no conversations)",
}


class ResponsesAPI(Exchange):
    """POST /v1/responses."""

    body: dict  # the request, set by translate: the response echoes its settings

    max_tokens_field = "max_output_tokens"

    def translate(self, body: dict) -> ChatRequest:
        checked_ = checked(ResponsesBody, body)
        _stateless(body)
        _text_format(body.get("text"))
        self.body = body
        limit = checked_.max_output_tokens
        sampling = {name: getattr(checked_, name) for name in SAMPLING if getattr(checked_, name) is not None}
        return ChatRequest(
            model=checked_.model,
            messages=_conversation(body).messages,
            tools=_tools(body.get("tools")),
            max_tokens=self.handler.response_generator.cli_args.max_tokens if limit is None else limit,
            stop=[],
            stream=checked_.stream,
            sampling=sampling,
            retention=checked_.prompt_cache_retention,
            cache_key=checked_.prompt_cache_key,
        )

    def error_body(self, status: int, message: str, param: str | None) -> dict:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        code = {401: "invalid_api_key", 404: "model_not_found"}.get(status)
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def reply(self, chat: ChatRequest, emit) -> ResponseReply:
        return ResponseReply(chat, self.body, self.handler.response_generator.cli_args, emit)


# --- requests -----------------------------------------------------------------------


def _stateless(body: dict) -> None:
    for name, instead in STATEFUL.items():
        if body.get(name) is not None:
            raise ServeRequestError(f"{name} is not supported: {instead}", param=name)
    if body.get("background"):
        raise ServeRequestError("background is not supported: responses are answered at once", param="background")


def _text_format(value) -> None:
    if value is None:
        return
    form = fields.obj(value, "text").get("format")
    if form is not None and fields.obj(form, "text.format").get("type") != "text":
        raise fields.bad("text.format.type", "'text' (this server writes plain text)", form.get("type"))


def _conversation(body: dict) -> Conversation:
    """`instructions` as the system message, then `input`."""
    conversation = Conversation()
    instructions = body.get("instructions")
    if instructions is not None:
        conversation.add({"role": "system", "content": fields.text(instructions, "instructions")})
    _input(fields.required(body, "input", "input"), conversation)
    return conversation


def _input(value, conversation: Conversation) -> None:
    if isinstance(value, str):
        conversation.add({"role": "user", "content": value})
        return
    items = fields.array(value, "input", "a string or a non-empty list of items", empty=False)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        fields.obj(item, where)
        kind = item.get("type", "message")
        add = ITEMS.get(kind) if isinstance(kind, str) else None
        if add is None:
            raise ServeRequestError(
                f"{where}.type {item.get('type')!r} is not supported (expected one of: {', '.join(ITEMS)})",
                param=f"{where}.type",
            )
        add(item, where, conversation)


def _message(item: dict, where: str, conversation: Conversation) -> None:
    role = item.get("role", fields.MISSING)
    if not isinstance(role, str) or role not in ROLES:
        raise fields.bad(f"{where}.role", f"one of {', '.join(ROLES)}", role)
    content = fields.required(item, "content", f"{where}.content")
    conversation.add({"role": ROLES[role], "content": _text(content, f"{where}.content")})


def _text(content, where: str) -> str | list[dict]:
    """A string, or text parts joined (as mlx_lm.server joins content parts); with an
    input_image among them, chat content parts in their order."""
    if isinstance(content, str):
        return content
    parts = fields.array(content, where, "a string or a list of content parts")
    out: str | list[dict] = ""
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        fields.obj(part, at)
        if part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise fields.bad(f"{at}.image_url", "a data URL (this server takes no file_id)", url)
            out = fields.with_part(out or None, fields.image_part(url, at))
            continue
        if part.get("type") not in TEXT_PARTS:
            raise fields.bad(f"{at}.type", "input_text, output_text or input_image", part.get("type"))
        text = fields.text(part.get("text"), f"{at}.text")
        out = fields.with_part(out, {"type": "text", "text": text}) if isinstance(out, list) else out + text
    return out


def _function_call(item: dict, where: str, conversation: Conversation) -> None:
    """A call the model made: part of the assistant message before it, if the
    previous item was one (as one reply's text and calls are)."""
    call_id = fields.text(fields.required(item, "call_id", f"{where}.call_id"), f"{where}.call_id")
    name = fields.text(fields.required(item, "name", f"{where}.name"), f"{where}.name")
    arguments = fields.text(fields.required(item, "arguments", f"{where}.arguments"), f"{where}.arguments")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise fields.bad(f"{where}.arguments", "a JSON object in a string", arguments)
    message = conversation.last("assistant") or conversation.add({"role": "assistant", "content": None})
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    message.setdefault("tool_calls", []).append(call)


def _function_output(item: dict, where: str, conversation: Conversation) -> None:
    call_id = fields.text(fields.required(item, "call_id", f"{where}.call_id"), f"{where}.call_id")
    output = _text(fields.required(item, "output", f"{where}.output"), f"{where}.output")
    if isinstance(output, list):
        raise fields.bad(f"{where}.output", "text (this server takes no images in a function's output)", output)
    conversation.add({"role": "tool", "tool_call_id": call_id, "content": output})


def _reasoning(item: dict, where: str, conversation: Conversation) -> None:
    """A previous reply's reasoning: not rendered (chat templates drop earlier turns' reasoning)."""


ITEMS = {
    "message": _message,
    "function_call": _function_call,
    "function_call_output": _function_output,
    "reasoning": _reasoning,
}


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    out = []
    for i, tool in enumerate(fields.array(value, "tools")):
        where = f"tools[{i}]"
        fields.obj(tool, where)
        if tool.get("type") != "function":
            raise fields.bad(f"{where}.type", "'function' (this server runs function tools)", tool.get("type"))
        out.append(fields.function_tool(tool, where, "parameters", schema_required=False))
    return out or None


# --- replies ------------------------------------------------------------------------


def usage(tokens: InputTokens, output: int, reasoning: int) -> dict:
    details = {"cached_tokens": tokens.restored, "cache_write_tokens": tokens.stored}
    return {
        "input_tokens": tokens.total,
        "input_tokens_details": details,
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": tokens.total + output,
    }


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseReply:
    """A response built from reply events, streamed as the API's events through `emit`."""

    def __init__(self, chat: ChatRequest, body: dict, cli_args, emit):
        self.id, self.created = _id("resp"), int(time.time())
        self.output: list[dict] = []
        self.open: str | None = None  # "message" or "reasoning": the item being streamed
        self.sequence = 0
        self.status, self.usage, self.incomplete = "in_progress", None, None
        self._send = emit
        self.echo = {
            "model": chat.model,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": chat.sampling.get("temperature", cli_args.temp),
            "top_p": chat.sampling.get("top_p", cli_args.top_p),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "metadata": body.get("metadata") or {},
            "text": {"format": {"type": "text"}},
            "previous_response_id": None,
        }

    def response(self) -> dict:
        head = {"id": self.id, "object": "response", "created_at": self.created, "status": self.status}
        tail = {"output": self.output, "usage": self.usage, "error": None, "incomplete_details": self.incomplete}
        return head | self.echo | tail

    body = response

    def emit(self, name: str, data: dict) -> None:
        self._send(name, {"type": name, "sequence_number": self.sequence, **data})
        self.sequence += 1

    def begin(self, tokens: InputTokens) -> None:
        self.emit("response.created", {"response": self.response()})
        self.emit("response.in_progress", {"response": self.response()})

    def text(self, event: Text) -> None:
        kind = "reasoning" if event.reasoning else "message"
        if self.open != kind:
            self._open(kind)
        item = self.output[-1]
        item["content"][0]["text"] += event.text
        name = "response.reasoning_text.delta" if event.reasoning else "response.output_text.delta"
        extra = {} if event.reasoning else {"logprobs": []}
        self.emit(name, self._at(item) | {"content_index": 0, "delta": event.text} | extra)

    def tool_call(self, event: ToolCall) -> None:
        self._close()
        arguments = json.dumps(event.arguments)
        item = {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": event.name}
        item |= {"arguments": "", "status": "in_progress"}
        self.output.append(item)
        self.emit("response.output_item.added", {"output_index": len(self.output) - 1, "item": copy.deepcopy(item)})
        self.emit("response.function_call_arguments.delta", self._at(item) | {"delta": arguments})
        item.update(arguments=arguments, status="completed")
        self.emit(
            "response.function_call_arguments.done", self._at(item) | {"name": event.name, "arguments": arguments}
        )
        self.emit("response.output_item.done", {"output_index": len(self.output) - 1, "item": item})

    def finish(self, event: Finish, tokens: InputTokens) -> None:
        cut = event.reason == "length"
        self._close("incomplete" if cut else "completed")
        self.usage = usage(tokens, event.tokens, event.reasoning_tokens)
        self.status = "incomplete" if cut else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if cut else None
        self.emit("response.incomplete" if cut else "response.completed", {"response": self.response()})

    def _at(self, item: dict) -> dict:
        """Where an event of the item being written (always the last) points."""
        return {"item_id": item["id"], "output_index": len(self.output) - 1}

    def _open(self, kind: str) -> None:
        self._close()
        if kind == "message":
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": _id("rs"), "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self.open = kind
        self.emit("response.output_item.added", {"output_index": len(self.output) - 1, "item": copy.deepcopy(item)})
        item["content"].append(part)
        self.emit("response.content_part.added", self._at(item) | {"content_index": 0, "part": copy.deepcopy(part)})

    def _close(self, status: str = "completed") -> None:
        if self.open is None:
            return
        item = self.output[-1]
        part = item["content"][0]
        if self.open == "message":
            self.emit(
                "response.output_text.done", self._at(item) | {"content_index": 0, "text": part["text"], "logprobs": []}
            )
        else:
            self.emit("response.reasoning_text.done", self._at(item) | {"content_index": 0, "text": part["text"]})
        self.emit("response.content_part.done", self._at(item) | {"content_index": 0, "part": part})
        item["status"] = status
        self.emit("response.output_item.done", {"output_index": len(self.output) - 1, "item": item})
        self.open = None
