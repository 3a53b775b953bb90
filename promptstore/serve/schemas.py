"""Every field of every API's request body, as pydantic models: a body is checked
against its API's schema in the HTTP thread, before anything renders or queues
it, and a wrong field is a ServeRequestError that names it and says what it takes.
Fields no API defines are ignored, as mlx_lm.server ignores them."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import ServeRequestError

MAX_SEED = 2**64 - 1  # MLX's random seed is an unsigned 64-bit integer


def kind(value: Any) -> str:
    """What a JSON value is, for a message: a list or an object by its type, a
    scalar as written (shortened)."""
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    if isinstance(value, dict):
        return "an object"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    short = f"{text[:30]}{'...' if len(text) > 30 else ''}"
    return f"a string {short}" if isinstance(value, str) else short


class Body(BaseModel):
    """A request body: strict JSON types, fields no API defines ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class Item(Body):
    """An object inside a body (a message, a part, a tool): its other keys pass
    through untouched (chat templates read what they know)."""


# prompt_cache_key: a client's name for requests that share a prefix (counted, never stored).
CacheKey = Annotated[str, Field(min_length=1, max_length=1024)]
# prompt_cache_retention, as OpenAI names its classes (store/retention.py).
CacheRetention = Literal["in_memory", "24h"]
Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Unit = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


def _stop(value: Any) -> list[str] | None:
    """A stop sequence or a list of them, as a list."""
    if value is None:
        return None
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) and s for s in value):
        return list(value)
    raise PydanticCustomError("stop", "must be a non-empty string or a list of non-empty strings")


# --- chat completions and completions (mlx_lm.server's own APIs) -----------------------


class Function(Item):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Item):
    type: Literal["function"]
    function: Function


class CalledFunction(Item):
    name: str
    arguments: str | dict


class ToolCall(Item):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Part(Item):
    """A content part: text, or an image for vision models."""

    type: Literal["text", "image_url", "input_image", "image"]
    text: str | None = None

    @model_validator(mode="after")
    def _has_text(self):
        if self.type == "text" and self.text is None:
            raise PydanticCustomError("text", "of type text must have a string 'text'")
        return self


class Message(Item):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(Item):
    include_usage: bool = False


class Sampling(Body):
    """What chat completions and completions share (mlx_lm.server's fields included)."""

    model: str = "default_model"
    max_tokens: Positive | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Unit | None = None
    top_k: Count | None = None
    min_p: Unit | None = None
    n: Literal[1] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None  # checked by _stop
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(ge=0)] | None = None
    repetition_context_size: Count | None = None
    presence_context_size: Count | None = None
    frequency_context_size: Count | None = None
    xtc_probability: Unit | None = None
    xtc_threshold: Unit | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=11)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    user: str | None = None
    num_draft_tokens: Count | None = None
    draft_model: str | None = None
    adapters: str | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value):
        return _stop(value)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value):
        for key in value or {}:
            if not key.lstrip("-").isdigit():
                raise PydanticCustomError("token_id", "keys must be token ids (integers written as strings)")
        return value


class ChatCompletionBody(Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None
    role_mapping: dict[str, str] | None = None
    prompt_cache_key: CacheKey | None = None
    prompt_cache_retention: CacheRetention | None = None

    @field_validator("response_format")
    @classmethod
    def _plain_text(cls, value):
        if value is not None and value.get("type", "text") != "text":
            raise PydanticCustomError("response_format", "must be {'type': 'text'}: this server writes text")
        return value


class CompletionBody(Sampling):
    """POST /v1/completions: one prompt, a string or token ids."""

    prompt: Any  # checked by _one_prompt
    logprobs: bool | Annotated[int, Field(ge=0, le=5)] = False
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, str) or (
            isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        ):
            return value
        if value == []:
            raise PydanticCustomError("prompt", "must not be empty")
        raise PydanticCustomError("prompt", "must be a string or a list of token ids (one prompt per request)")


# --- the Messages API (Anthropic) -------------------------------------------------------


class MessagesBody(Body):
    """POST /v1/messages (and count_tokens); blocks are checked where they are
    translated (apis/messages.py)."""

    model: str = "default_model"
    max_tokens: Positive
    messages: Annotated[list[dict], Field(min_length=1)]
    system: str | list[dict] | None = None
    stop_sequences: Any = None  # checked by _stop
    stream: bool = False
    temperature: Unit | None = None
    top_p: Unit | None = None
    top_k: Count | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None
    thinking: dict | None = None
    cache_control: dict | None = None
    service_tier: str | None = None

    @field_validator("stop_sequences", mode="plain")
    @classmethod
    def _stop(cls, value):
        return _stop(value)


class CountTokensBody(MessagesBody):
    """POST /v1/messages/count_tokens: no max_tokens."""

    max_tokens: Positive = 1


# --- the Responses API (OpenAI) ---------------------------------------------------------


class ResponsesBody(Body):
    """POST /v1/responses; input items are checked where they are translated
    (apis/responses.py)."""

    model: str = "default_model"
    input: str | Annotated[list[dict], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Positive | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Unit | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict | None = None
    text: dict | None = None
    store: bool | None = None
    reasoning: dict | None = None
    truncation: str | None = None
    user: str | None = None
    include: list[str] | None = None
    max_tool_calls: Positive | None = None
    top_logprobs: Count | None = None
    prompt_cache_key: CacheKey | None = None
    prompt_cache_retention: CacheRetention | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None


# --- errors -----------------------------------------------------------------------------

# pydantic's error types, in the words of an API reference.
WORDS = {
    "missing": "is required",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "dict_type": "must be an object",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "none_required": "is not supported: leave it out",
    "too_long": "is too long",
}


def checked(schema: type[Body], body: dict, *, dotted: bool = False) -> Body:
    """`body` as an instance of `schema`, or ServeRequestError naming the first
    field at fault (dotted: `messages.0.role` as the Messages API writes paths,
    else `messages[0].role`)."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise refusal(e.errors(include_url=False), dotted) from None


def refusal(errors: list[dict], dotted: bool) -> ServeRequestError:
    """The error to report: the deepest field at fault (the shape the client
    meant, of a union's alternatives); a value no alternative of a union took
    is told what each would take."""
    depth = lambda error: len(_fields(error["loc"]))  # noqa: E731
    deepest = max(depth(error) for error in errors)
    at = [error for error in errors if depth(error) == deepest]
    at = [error for error in at if _fields(error["loc"]) == _fields(at[0]["loc"])]
    where = path(at[0]["loc"], dotted) or "the body"
    words = []
    for error in at:
        said = (WORDS.get(error["type"]) or _words(error)).removeprefix("must be ")
        if said not in words:
            words.append(said)
    text = " or ".join(words)
    text = text if text.startswith(("is ", "must", "keys", "of type")) else f"must be {text}"
    got = "" if at[0]["type"] == "missing" else f", got {kind(at[0].get('input'))}"
    return ServeRequestError(f"{where} {text}{got}", param=where)


def _fields(loc: tuple) -> tuple:
    return tuple(part for part in loc if not _is_alternative(part))


def _is_alternative(part) -> bool:
    """A loc part pydantic adds for a union's member or a validator (not a field or index)."""
    return isinstance(part, str) and (
        part[:1].isupper() or "[" in part or "-" in part or part in ("str", "int", "float", "bool")
    )


def path(loc: tuple, dotted: bool) -> str:
    out = ""
    for part in _fields(loc):
        if isinstance(part, int):
            out += f".{part}" if dotted else f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _words(error: dict) -> str:
    ctx = error.get("ctx") or {}
    kind_ = error["type"]
    if kind_ in ("greater_than_equal", "greater_than"):
        return f"must be at least {_number(ctx.get('ge', ctx.get('gt')))}"
    if kind_ in ("less_than_equal", "less_than"):
        return f"must be at most {_number(ctx.get('le', ctx.get('lt')))}"
    if kind_ == "literal_error":
        return "must be " + str(ctx.get("expected")).replace("False", "false").replace("True", "true")
    if kind_ == "too_short":
        return "must be a non-empty list"
    if kind_ == "string_too_short":
        return "must be a non-empty string"
    if kind_ == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    if kind_ == "value_error":
        return str(ctx.get("error") or error["msg"]).removeprefix("Value error, ")
    msg = error["msg"]
    return msg[:1].lower() + msg[1:]


def _number(value) -> str:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)
