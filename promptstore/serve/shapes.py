"""Request bodies of the wrong shape, refused in the HTTP thread before anything is
queued: a 400 naming the field and what was expected, never a Python message
("'str' object has no attribute 'get'") from deeper in mlx_lm.server."""

from __future__ import annotations

import json
from typing import Any

from ..errors import ServeRequestError

MESSAGE = "an object with 'role' and 'content'"
# Content part types mlx_lm.server renders: text, and images for vision models.
PART_TYPES = ("text", "image_url", "input_image", "image")


def kind(value: Any) -> str:
    """What a JSON value is, for a message: a list or an object by its type, a
    scalar as written (shortened)."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    text = json.dumps(value)
    return f"a string {text[:30]}{'...' if len(text) > 30 else ''}" if isinstance(value, str) else text[:30]


def check_messages(body: dict) -> None:
    """A chat request's `messages`: a non-empty list of messages, each a role and
    content (a string, null, or a list of text or image parts)."""
    if "messages" not in body:
        raise ServeRequestError("messages is required: a list of objects with 'role' and 'content'")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else kind(messages)
        raise ServeRequestError(f"messages must be a non-empty list of objects with 'role' and 'content', got {got}")
    for i, message in enumerate(messages):
        _check_message(f"messages[{i}]", message)


def _check_message(where: str, message: Any) -> None:
    if not isinstance(message, dict):
        raise ServeRequestError(f"{where} must be {MESSAGE}, got {kind(message)}")
    if not isinstance(message.get("role"), str):
        raise ServeRequestError(
            f"{where}.role must be a string (system, user, assistant, tool), got {kind(message.get('role'))}"
        )
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ServeRequestError(f"{where}.content must be a string or a list of content parts, got {kind(content)}")
    for j, part in enumerate(content):
        _check_part(f"{where}.content[{j}]", part)


def _check_part(where: str, part: Any) -> None:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ServeRequestError(f"{where} must be an object with a 'type' (text or image_url), got {kind(part)}")
    if part["type"] not in PART_TYPES:
        raise ServeRequestError(f"{where}.type {part['type']!r} is not supported (expected text or image_url)")
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise ServeRequestError(f"{where}.text must be a string, got {kind(part.get('text'))}")


def check_max_tokens(body: dict) -> None:
    """max_tokens and max_completion_tokens, when given: positive integers (mlx_lm.server
    takes true for 1 and names max_tokens for either)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ServeRequestError(f"{name} must be an integer, got {kind(value)}")
        if value < 1:
            raise ServeRequestError(f"{name} must be at least 1, got {value}")
