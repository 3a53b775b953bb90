"""The blocks and items inside a Messages or Responses request, checked where
they are translated (schemas.py checks the fields around them): a wrong one
raises ServeRequestError naming it (its `param`) and what was expected."""

from __future__ import annotations

from typing import Any

from ...errors import ServeRequestError
from ..schemas import kind

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


def image_part(url: str, where: str) -> dict:
    """An image as a chat content part (OpenAI's image_url), naming where the client put it:
    a bad image's 400 names that place (serve/vision.py)."""
    if url.strip()[:8].lower().startswith(("http://", "https://")):
        raise ServeRequestError(
            f"{where}: remote image URLs are refused: this server fetches nothing; send the image as base64",
            param=where,
        )
    return {"type": "image_url", "image_url": {"url": url}, "where": where}


def with_part(content, part: dict) -> list[dict]:
    """A message's content (None, a string or parts) with `part` after it, as parts."""
    parts = [] if content is None else ([{"type": "text", "text": content}] if isinstance(content, str) else content)
    return [*parts, part]
