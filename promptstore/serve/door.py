"""A request body at the door, before any API reads it: a JSON content type, a
Content-Length within --max-body-bytes (a larger body is answered 413 before any
of it is read or parsed), read within a time bound, UTF-8, and a JSON object."""

from __future__ import annotations

import json
import socket
import time

from ..errors import ServeRequestError
from .schemas import kind

DEFAULT_MAX_BODY_BYTES = 32 << 20  # the Messages API's own limit on a request
BODY_SECONDS = 30.0  # the longest a client may take to send a body it announced
DRAIN_SECONDS = 1.0  # after a 413, what the client still sends is read and dropped this long at most


def read_body(handler, limit: int) -> dict:
    """The request's JSON object, or ServeRequestError (411, 413, 415 or 400)."""
    content_type = handler.headers.get("Content-Type")
    if content_type is not None and not _json_type(content_type):
        raise ServeRequestError(
            f"Content-Type {content_type[:60]!r} is not supported: send the body as application/json", status=415
        )
    if handler.headers.get("Transfer-Encoding"):
        raise ServeRequestError("send the body with a Content-Length (chunked bodies are not read)", status=411)
    length = handler.headers.get("Content-Length")
    if length is None:
        raise ServeRequestError("a Content-Length header is required", status=411)
    try:
        n = int(length)
    except ValueError:
        raise ServeRequestError(f"the Content-Length header {length[:30]!r} is not a number") from None
    if n < 0:
        raise ServeRequestError(f"the Content-Length header {n} is negative")
    if n > limit:
        handler.unread = n  # dropped after the answer (drain), then the connection closes
        raise ServeRequestError(
            f"the body has {n} bytes; this server takes at most {limit} (--max-body-bytes)", status=413
        )
    raw = _read(handler, n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ServeRequestError(f"the body is not UTF-8 (byte {e.start} is {raw[e.start]:#04x})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError) as e:
        raise ServeRequestError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ServeRequestError("the body is not valid JSON: it nests too deeply") from None
    if not isinstance(body, dict):
        raise ServeRequestError(f"the body must be a JSON object, got {kind(body)}")
    _check_text(body)
    return body


def _check_text(body: dict) -> None:
    """A JSON string may escape half of a surrogate pair (`"\\ud800"`): text no
    tokenizer takes. Refused, naming the field that holds it."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        where = _unpaired(body, "")
        raise ServeRequestError(
            f"{where or 'the body'} holds an unpaired surrogate (\\ud800-\\udfff)", param=where
        ) from None


def _unpaired(value, where: str) -> str | None:
    """Where in `value` a string with an unpaired surrogate is (a key's or a value's)."""
    if isinstance(value, str):
        return where if _surrogate(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = key if isinstance(key, int) else key.encode("utf-8", "backslashreplace").decode("utf-8")
        at = f"{where}[{name}]" if isinstance(key, int) else (f"{where}.{name}" if where else name)
        if isinstance(key, str) and _surrogate(key):
            return at
        found = _unpaired(item, at)
        if found is not None:
            return found
    return None


def _surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _json_type(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _read(handler, n: int) -> bytes:
    """`n` bytes of body, within BODY_SECONDS (a client that stops sending holds
    no thread for ever)."""
    connection = handler.connection
    previous = connection.gettimeout()
    connection.settimeout(BODY_SECONDS)
    try:
        raw = handler.rfile.read(n)
    except TimeoutError:
        handler.close_connection = True
        raise ServeRequestError(f"the body did not arrive within {BODY_SECONDS:.0f} s", status=408) from None
    finally:
        connection.settimeout(previous)
    if len(raw) < n:
        handler.close_connection = True
        raise ServeRequestError(f"the body ended after {len(raw)} of the {n} bytes announced")
    return raw


def drain(handler) -> None:
    """After answering a body that was not read: drop what the client still sends
    (at most DRAIN_SECONDS, never more than it announced), so that closing the
    socket does not reset the connection before the client reads the answer."""
    left = getattr(handler, "unread", 0)
    if not left:
        return
    handler.close_connection = True
    connection = handler.connection
    deadline = time.monotonic() + DRAIN_SECONDS
    try:
        connection.shutdown(socket.SHUT_WR)  # the answer is whole: the client sees its end
        while left > 0 and (wait := deadline - time.monotonic()) > 0:
            connection.settimeout(wait)
            chunk = handler.rfile.read1(min(left, 1 << 20))
            if not chunk:
                break
            left -= len(chunk)
    except OSError:
        pass  # the client went away: nothing more to drop
