"""The Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.
A request becomes a chat request (system, text, tool_use and tool_result blocks,
client tools; `cache_control` marks become checkpoints, kept for their ttl; the
request's own cache_control keeps all it stores for its ttl); the reply is a message,
or its event stream (message_start, content_block_*, message_delta,
message_stop); errors come in the API's shape."""

from __future__ import annotations

import copy
import json
import uuid

from ...errors import ServeRequestError
from ..schemas import CountTokensBody, MessagesBody, checked
from . import fields
from .chat import ChatRequest, Conversation
from .events import Finish, Text, ToolCall
from .exchange import Exchange, InputTokens, failure

ROLES = ("user", "assistant")
MAX_MARKS = 4  # blocks with cache_control in one request, as the Messages API allows
SAMPLING = ("temperature", "top_p", "top_k")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class MessagesAPI(Exchange):
    """POST /v1/messages."""

    schema = MessagesBody

    def translate(self, body: dict) -> ChatRequest:
        checked_ = checked(self.schema, body, dotted=True)
        conversation, tools, retention = _conversation(body)
        sampling = {name: getattr(checked_, name) for name in SAMPLING if getattr(checked_, name) is not None}
        return ChatRequest(
            model=checked_.model,
            messages=conversation.messages,
            tools=tools,
            max_tokens=checked_.max_tokens,
            stop=checked_.stop_sequences or [],
            stream=checked_.stream,
            sampling=sampling,
            marked=conversation.marked,
            ttls=conversation.ttls,
            retention=retention,
        )

    def error_body(self, status: int, message: str, param: str | None) -> dict:
        kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def reply(self, chat: ChatRequest, emit) -> MessageReply:
        return MessageReply(chat.model, emit)

    def ping(self) -> bytes:
        return b'event: ping\ndata: {"type": "ping"}\n\n'


class CountTokensAPI(MessagesAPI):
    """POST /v1/messages/count_tokens: the prompt's tokens as this server renders
    it (nothing is generated or stored)."""

    schema = CountTokensBody

    def serve(self, body: dict) -> None:
        try:
            request = self.admit(self.translate(body))
        except ServeRequestError as e:
            self.error(e.status, str(e), e.param)
            return
        except Exception as e:  # a fault of the server's, still answered in the API's shape
            self.error(*failure(e))
            return
        self.handler.response_generator.arrivals.done(request.arrival)  # counted, never queued
        self.send_json(200, {"input_tokens": len(request.rendered.prompt)})


# --- requests -----------------------------------------------------------------------


def _conversation(body: dict) -> tuple[Conversation, list[dict] | None, str | None]:
    """The chat messages and tools of a request, in the order the API reads them
    (tools, system, messages), with the prefixes its marks end; and the ttl of
    the request's own mark (None without one)."""
    conversation = Conversation()
    tools = _tools(body.get("tools"), conversation)
    _system(body.get("system"), conversation)
    messages = fields.required(body, "messages", "messages")
    fields.array(messages, "messages", "a non-empty list of messages", empty=False)
    for i, message in enumerate(messages):
        _message(message, f"messages.{i}", conversation)
    retention = _marked(body, "")
    if retention:  # the request's own mark: the end of its last block
        conversation.mark(retention)
    if len(conversation.marked) > MAX_MARKS:
        raise ServeRequestError(
            f"at most {MAX_MARKS} blocks may have cache_control, found {len(conversation.marked)}",
            param="cache_control",
        )
    return conversation, tools, retention


def _marked(block: dict, where: str) -> str | None:
    """The ttl of a block's (or the request's) cache_control mark ("5m" unless it
    says "1h"), None without one: the store keeps the prefix that long while
    its budgets allow."""
    mark = block.get("cache_control")
    if mark is None:
        return None
    at = f"{where}.cache_control" if where else "cache_control"
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise fields.bad(at, "{'type': 'ephemeral'}", mark)
    ttl = mark.get("ttl", "5m")
    if ttl not in ("5m", "1h"):
        raise fields.bad(f"{at}.ttl", "'5m' or '1h'", ttl)
    return ttl


def _mark(block: dict, where: str, conversation: Conversation) -> None:
    """The conversation so far is a marked prefix when the block has cache_control."""
    ttl = _marked(block, where)
    if ttl:
        conversation.mark(ttl)


def _tools(value, conversation: Conversation) -> list[dict] | None:
    """Client tools as function tools (name, description, input_schema as parameters)."""
    if value is None:
        return None
    out = []
    for i, tool in enumerate(fields.array(value, "tools")):
        where = f"tools.{i}"
        fields.obj(tool, where)
        if tool.get("type", "custom") != "custom":
            raise ServeRequestError(
                f"{where}.type {tool['type']!r} is not supported: this server runs client tools (no type, or 'custom')",
                param=f"{where}.type",
            )
        out.append(fields.function_tool(tool, where, "input_schema", schema_required=True))
        _mark(tool, where, conversation)
    return out or None


def _system(value, conversation: Conversation) -> None:
    """The system prompt: a string, or text blocks joined (as mlx_lm.server joins content parts)."""
    if value is None:
        return
    if isinstance(value, str):
        conversation.add({"role": "system", "content": value})
        return
    blocks = fields.array(value, "system", "a string or a list of text blocks")
    message = conversation.add({"role": "system", "content": ""})
    for j, block in enumerate(blocks):
        where = f"system.{j}"
        fields.obj(block, where)
        if block.get("type") != "text":
            raise fields.bad(f"{where}.type", "'text'", block.get("type", fields.MISSING))
        message["content"] += fields.text(block.get("text"), f"{where}.text")
        _mark(block, where, conversation)


def _message(message, where: str, conversation: Conversation) -> None:
    fields.obj(message, where)
    role = message.get("role", fields.MISSING)
    if role not in ROLES:
        raise fields.bad(f"{where}.role", "'user' or 'assistant' (a system prompt goes in 'system')", role)
    content = fields.required(message, "content", f"{where}.content")
    if isinstance(content, str):
        conversation.add({"role": role, "content": content})
        return
    blocks = fields.array(content, f"{where}.content", "a string or a list of content blocks")
    turn = _Turn(role, conversation)
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        fields.obj(block, at)
        kind = block.get("type")
        add = BLOCKS[role].get(kind) if isinstance(kind, str) else None
        if add is None:
            raise ServeRequestError(
                f"{at}.type {kind!r} is not supported in a {role} message (expected one of: {', '.join(BLOCKS[role])})",
                param=f"{at}.type",
            )
        add(turn, block, at)
        _mark(block, at, conversation)
    turn.close()


class _Turn:
    """The chat messages one Messages API message becomes: its text (blocks
    joined) and tool calls in one message; each tool result a `tool` message."""

    def __init__(self, role: str, conversation: Conversation):
        self.role, self.conversation = role, conversation
        self.current: dict | None = None
        self.added = False

    def _message(self) -> dict:
        if self.current is None:
            self.current = self.conversation.add({"role": self.role, "content": None})
            self.added = True
        return self.current

    def text(self, block: dict, where: str) -> None:
        message = self._message()
        text = fields.text(block.get("text"), f"{where}.text")
        if isinstance(message["content"], list):  # after an image: a part of its own
            message["content"] = fields.with_part(message["content"], {"type": "text", "text": text})
        else:
            message["content"] = (message["content"] or "") + text

    def image(self, block: dict, where: str) -> None:
        """An image block: base64 data becomes a data URL; a URL source is refused (nothing is fetched)."""
        source = fields.obj(fields.required(block, "source", f"{where}.source"), f"{where}.source")
        if source.get("type") != "base64":
            raise fields.bad(f"{where}.source.type", "'base64' (this server fetches nothing)", source.get("type"))
        media = fields.text(
            fields.required(source, "media_type", f"{where}.source.media_type"), f"{where}.source.media_type"
        )
        data = fields.text(fields.required(source, "data", f"{where}.source.data"), f"{where}.source.data")
        message = self._message()
        message["content"] = fields.with_part(
            message["content"], fields.image_part(f"data:{media};base64,{data}", where)
        )

    def tool_use(self, block: dict, where: str) -> None:
        call_id = fields.text(fields.required(block, "id", f"{where}.id"), f"{where}.id")
        name = fields.text(fields.required(block, "name", f"{where}.name"), f"{where}.name")
        arguments = fields.obj(fields.required(block, "input", f"{where}.input"), f"{where}.input")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        self._message().setdefault("tool_calls", []).append(call)

    def tool_result(self, block: dict, where: str) -> None:
        call_id = fields.text(fields.required(block, "tool_use_id", f"{where}.tool_use_id"), f"{where}.tool_use_id")
        self.conversation.add({"role": "tool", "tool_call_id": call_id, "content": _result_text(block, where)})
        self.current, self.added = None, True  # text after a result is a new user message

    def thinking(self, block: dict, where: str) -> None:
        """A previous reply's thinking: not rendered (chat templates drop earlier turns' reasoning)."""

    def close(self) -> None:
        if not self.added:  # an empty list of blocks is still a turn
            self.conversation.add({"role": self.role, "content": ""})


def _result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    parts = fields.array(content, f"{where}.content", "a string or a list of text blocks")
    texts = []
    for k, part in enumerate(parts):
        at = f"{where}.content.{k}"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise fields.bad(f"{at}.type", "'text' (this server takes text tool results)", _type_of(part))
        texts.append(fields.text(part.get("text"), f"{at}.text"))
    return "".join(texts)


def _type_of(part):
    return part.get("type", fields.MISSING) if isinstance(part, dict) else part


BLOCKS = {
    "user": {"text": _Turn.text, "image": _Turn.image, "tool_result": _Turn.tool_result},
    "assistant": {
        "text": _Turn.text,
        "tool_use": _Turn.tool_use,
        "thinking": _Turn.thinking,
        "redacted_thinking": _Turn.thinking,
    },
}


# --- replies ------------------------------------------------------------------------


def usage(tokens: InputTokens, output: int) -> dict:
    """The Messages API's usage: its three input counts add up to the prompt."""
    return {
        "input_tokens": tokens.computed,
        "cache_creation_input_tokens": tokens.stored,
        "cache_read_input_tokens": tokens.restored,
        "output_tokens": output,
    }


class MessageReply:
    """A message built from reply events, streamed as the API's events through `emit`."""

    def __init__(self, model: str, emit):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model, self.emit = model, emit
        self.content: list[dict] = []
        self.open: str | None = None  # the type of the block being streamed
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict = {}

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }

    body = message

    def begin(self, tokens: InputTokens) -> None:
        self.usage = usage(tokens, 0)
        self.emit("message_start", {"type": "message_start", "message": self.message()})

    def text(self, event: Text) -> None:
        kind, delta = ("thinking", "thinking_delta") if event.reasoning else ("text", "text_delta")
        if self.open != kind:
            self._open(
                {"type": "thinking", "thinking": "", "signature": ""}
                if event.reasoning
                else {"type": "text", "text": ""}
            )
        self.content[-1][kind] += event.text
        self._delta({"type": delta, kind: event.text})

    def tool_call(self, event: ToolCall) -> None:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": event.name, "input": {}}
        self._open(block)
        block["input"] = event.arguments
        self._delta({"type": "input_json_delta", "partial_json": json.dumps(event.arguments)})
        self._close()

    def finish(self, event: Finish, tokens: InputTokens) -> None:
        self._close()
        self.stop_reason = "stop_sequence" if event.stop_sequence else STOP_REASONS[event.reason]
        self.stop_sequence = event.stop_sequence
        self.usage = usage(tokens, event.tokens)
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        self.emit("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage})
        self.emit("message_stop", {"type": "message_stop"})

    def _open(self, block: dict) -> None:
        self._close()
        self.content.append(block)
        self.open = block["type"]
        start = {"type": "content_block_start", "index": len(self.content) - 1, "content_block": copy.deepcopy(block)}
        self.emit("content_block_start", start)

    def _delta(self, delta: dict) -> None:
        self.emit(
            "content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
        )

    def _close(self) -> None:
        if self.open is not None:
            self.emit("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})
            self.open = None
