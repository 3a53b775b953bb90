"""Request fields of the Messages and Responses APIs, checked where they are
read: a wrong one raises ServeRequestError naming the field (its `param`) and
what was expected, before anything is rendered or queued."""

from __future__ import annotations

from typing import Any

from ...errors import ServeRequestError
from ..shapes import kind

MISSING = object()


def bad(where: str, expected: str, value: Any) -> ServeRequestError:
    got = "nothing" if value is MISSING else kind(value)
    return ServeRequestError(f"{where} must be {expected}, got {got}", param=where)


def required(body: dict, name: str, where: str) -> Any:
    if name not in body:
        raise ServeRequestError(f"{where} is required", param=where)
    return body[name]


def obj(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise bad(where, "an object", value)
    return value


def array(value: Any, where: str, expected: str = "a list", *, empty: bool = True) -> list:
    if not isinstance(value, list) or (not empty and not value):
        raise bad(where, expected, value)
    return value


def text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad(where, "a string", value)
    return value


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise bad(where, "true or false", value)
    return value


def integer(value: Any, where: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad(where, f"an integer of at least {low}", value)
    return value


def number(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad(where, f"a number from {low} to {high}", value)
    return float(value)


def strings(value: Any, where: str) -> list[str]:
    """A string or a list of strings (stop sequences), as a list."""
    if isinstance(value, str) and value:
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad(where, "a list of non-empty strings", value)
    return list(value)


def sampling(body: dict, names: dict[str, tuple]) -> dict[str, float]:
    """The sampling fields a client sent, checked: {name: (low, high)}, high None
    for an integer (top_k). Fields left out take the server's defaults."""
    out = {}
    for name, (low, high) in names.items():
        value = body.get(name)
        if value is None:
            continue
        out[name] = integer(value, name, low) if high is None else number(value, name, low, high)
    return out


def function_tool(tool: dict, where: str, schema: str, *, schema_required: bool) -> dict:
    """A chat completion's function tool from a tool's `name`, `description` and
    parameter schema (the field `schema`: input_schema or parameters)."""
    function = {"name": text(required(tool, "name", f"{where}.name"), f"{where}.name")}
    if tool.get("description") is not None:
        function["description"] = text(tool["description"], f"{where}.description")
    value = required(tool, schema, f"{where}.{schema}") if schema_required else tool.get(schema)
    if value is not None:
        function["parameters"] = obj(value, f"{where}.{schema}")
    return {"type": "function", "function": function}
