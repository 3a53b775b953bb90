"""A catalogue of hostile requests to `promptstore serve` (bad fields, bad bytes, bad
framing), each with the 4xx it must get and the field its error must name; a helper
that sends one to a server, and the check of an error body in its API's shape."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

CHAT, CHAT_BARE, COMPLETIONS = "/v1/chat/completions", "/chat/completions", "/v1/completions"
MESSAGES, COUNT_TOKENS, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
PATHS = (CHAT, CHAT_BARE, COMPLETIONS, MESSAGES, COUNT_TOKENS, RESPONSES)
ANTHROPIC_PATHS = (MESSAGES, COUNT_TOKENS)
API = {CHAT: "chat", CHAT_BARE: "chat(bare)", COMPLETIONS: "completions", MESSAGES: "messages"}
API |= {COUNT_TOKENS: "count_tokens", RESPONSES: "responses"}

# The server under test must be started with --max-body-bytes MAX_BODY_BYTES for
# the 413 case; its body is ten times that, and valid JSON, so only its size is wrong.
MAX_BODY_BYTES = 1_000_000
HUGE_BODY_BYTES = 10 * MAX_BODY_BYTES

HELLO = [{"role": "user", "content": "Hello there."}]
WIZARD = [{"role": "wizard", "content": "Hello there."}]


def block_typed(kind) -> list[dict]:
    """Messages whose one content block has `kind` as its type."""
    return [{"role": "user", "content": [{"type": kind, "text": "Hello there."}]}]


# Small valid bodies (4 tokens at most, greedy): every case is one of them with one thing wrong.
BASE: dict[str, dict] = {
    CHAT: {"model": "default_model", "messages": HELLO, "max_tokens": 4, "temperature": 0},
    CHAT_BARE: {"model": "default_model", "messages": HELLO, "max_tokens": 4, "temperature": 0},
    COMPLETIONS: {"model": "default_model", "prompt": "Hello there.", "max_tokens": 4, "temperature": 0},
    MESSAGES: {"model": "default_model", "messages": HELLO, "max_tokens": 4, "temperature": 0},
    COUNT_TOKENS: {"model": "default_model", "messages": HELLO},
    RESPONSES: {"model": "default_model", "input": "Hello there.", "max_output_tokens": 4, "temperature": 0},
}

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One request: `body` is merged over the path's BASE (a dict), or sent as it is
    (bytes). `headers` replace the defaults (a None value drops that header), and
    `no_length` sends it over a raw socket without Content-Length."""

    name: str
    path: str
    body: dict | bytes
    status: int | tuple[int, ...] = 400
    field: str | None = None
    headers: dict[str, str | None] = dataclasses.field(default_factory=dict)
    no_length: bool = False

    def expects(self, status: int) -> bool:
        return status in (self.status if isinstance(self.status, tuple) else (self.status,))

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps({**BASE[self.path], **self.body}).encode()


def _fields(path: str, values: dict[str, list], status: int | tuple[int, ...] = 400) -> list[Case]:
    """A case per (field, bad value): the value replaces the field in the path's base body."""
    return [
        Case(f"{API[path]}: {name}={json.dumps(v)[:24]}", path, {name: v}, status, name)
        for name, vs in values.items()
        for v in vs
    ]


def _json(path: str, **fields) -> bytes:
    """The path's base body with `fields`, as bytes (json writes ASCII, so a lone
    surrogate stays an escape; an official client refuses to encode one)."""
    return json.dumps({**BASE[path], **fields}).encode()


def _huge_body() -> bytes:
    # Built on first use: ten megabytes of valid JSON is not for import time.
    text = "sail " * (HUGE_BODY_BYTES // 5)
    return json.dumps({**BASE[CHAT], "messages": [{"role": "user", "content": text}]}).encode()


def catalogue(huge: bool = True) -> list[Case]:
    """Every hostile case, ordered by path; `huge` adds the 10 MB body (413)."""
    big = [10**12, 2**70]
    cases = [
        *_fields(
            CHAT,
            {
                "stop": [123, [1, 2], [None], {"a": 1}],
                "seed": [-1],
                "n": [3],
                "max_tokens": big,
                "max_completion_tokens": big,
                "chat_template_kwargs": [5],
                "temperature": ["hot"],
                "model": [7],
                "tools": ["x"],
                "messages": [[]],
                "logit_bias": [{"99999999": 1}],
            },
        ),
        # An adapter or draft model other than the served ones is a field error or "not served".
        *_fields(CHAT, {"adapters": ["x"], "draft_model": ["x"]}, (400, 404)),
        Case("chat: messages[0].role=wizard", CHAT, {"messages": WIZARD}, field="messages"),
        Case("chat: top_logprobs=50", CHAT, {"logprobs": True, "top_logprobs": 50}, field="top_logprobs"),
        Case("chat: model not served", CHAT, {"model": "someone/other-model"}, 404, "model"),
        *_fields(
            COMPLETIONS,
            {"stop": [123, [1, 2], [None], {"a": 1}], "n": [3], "best_of": [2], "echo": [True], "suffix": ["x"]},
        ),
        *_fields(
            MESSAGES,
            {
                "messages": [[]],
                "stop_sequences": [123],
                "max_tokens": [10**12],
                "temperature": ["x"],
                "model": [7],
                "tools": ["x"],
                "system": [5],
            },
        ),
        Case("messages: messages[0].role=wizard", MESSAGES, {"messages": WIZARD}, field="messages"),
        Case("messages: model not served", MESSAGES, {"model": "someone/other-model"}, 404, "model"),
        # Found by tests/serve/test_hostile.py's generated bodies: a type or role that is no string.
        Case("messages: content[0].type=[1]", MESSAGES, {"messages": block_typed([1])}, field="messages"),
        Case("count_tokens: content[0].type={}", COUNT_TOKENS, {"messages": block_typed({})}, field="messages"),
        Case("responses: input[0].type=[]", RESPONSES, {"input": [{**HELLO[0], "type": []}]}, field="input"),
        Case("responses: input[0].role={}", RESPONSES, {"input": [{**HELLO[0], "role": {}}]}, field="input"),
        # A lone surrogate is a valid JSON escape but no text a tokenizer encodes (also found so).
        Case("chat: stop=lone surrogate", CHAT, _json(CHAT, stop="\ud800"), field="stop"),
        Case(
            "chat: content=lone surrogate",
            CHAT,
            _json(CHAT, messages=[{"role": "user", "content": "Hi \ud800"}]),
            field="messages",
        ),
        Case("completions: stop=[lone surrogate]", COMPLETIONS, _json(COMPLETIONS, stop=["\ud800"]), field="stop"),
        Case("completions: prompt=lone surrogate", COMPLETIONS, _json(COMPLETIONS, prompt="Hi \ud800"), field="prompt"),
        Case(
            "messages: stop_sequences=[lone surrogate]",
            MESSAGES,
            _json(MESSAGES, stop_sequences=["\ud800"]),
            field="stop_sequences",
        ),
        *_fields(COUNT_TOKENS, {"messages": [[]], "model": [7]}),
        *_fields(
            RESPONSES,
            {"input": [[]], "max_output_tokens": [10**12], "temperature": ["x"], "model": [7], "tools": ["x"]},
        ),
    ]
    for path in PATHS:
        api = API[path]
        cases += [
            Case(f"{api}: not UTF-8", path, b'{"messages": "\xff\xfe"}'),
            Case(f"{api}: bad JSON", path, b'{"messages": ['),
            Case(f"{api}: not an object", path, b"[1, 2]"),
            Case(f"{api}: text/plain", path, {}, 415, headers={"Content-Type": "text/plain"}),
        ]
    cases += [
        # Python's json refuses an int of over 4300 digits with a ValueError that is no JSONDecodeError.
        Case("chat: 5000-digit max_tokens", CHAT, b'{"messages": [], "max_tokens": ' + b"1" * 5000 + b"}"),
        Case("chat: form", CHAT, {}, 415, headers={"Content-Type": "application/x-www-form-urlencoded"}),
        *(Case(f"{API[p]}: no Content-Length", p, {}, 411, no_length=True) for p in PATHS),
        # Accepted: no Content-Type at all, and fields the server does not know.
        Case("chat: no Content-Type", CHAT, {}, 200, headers={"Content-Type": None}),
        Case("chat: unknown fields", CHAT, {"foo": 1, "user": "u"}, 200),
        Case("completions: unknown fields", COMPLETIONS, {"foo": 1, "user": "u"}, 200),
        Case("messages: unknown fields", MESSAGES, {"foo": 1, "metadata": {"user_id": "u"}}, 200),
        Case("responses: unknown fields", RESPONSES, {"foo": 1, "user": "u"}, 200),
    ]
    if huge:
        cases += [Case(f"{API[p]}: 10 MB body", p, _huge_body(), 413) for p in (CHAT, MESSAGES)]
    return sorted(cases, key=lambda c: PATHS.index(c.path))


def send(base_url: str, case: Case, timeout: float = 30.0) -> tuple[int, Any, float]:
    """(status, the parsed JSON body or None, seconds) of one case; a dropped
    connection or a timeout raises (httpx.HTTPError or OSError)."""
    headers = {"Content-Type": "application/json", **case.headers}
    headers = {k: v for k, v in headers.items() if v is not None}
    started = time.perf_counter()
    if case.no_length:
        status, raw = _send_raw(base_url, case.path, headers, case.content(), timeout)
    else:
        with httpx.Client(trust_env=False, timeout=timeout) as http:
            r = http.post(base_url + case.path, content=case.content(), headers=headers)
            status, raw = r.status_code, r.content
    seconds = time.perf_counter() - started
    try:
        return status, json.loads(raw), seconds
    except ValueError:
        return status, None, seconds


def _send_raw(base_url: str, path: str, headers: dict, body: bytes, timeout: float) -> tuple[int, bytes]:
    """A POST without Content-Length (httpx always frames a body): the body follows the
    headers and the write side is closed, so a server that waits for it sees its end."""
    url = urlsplit(base_url)
    head = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        s.shutdown(socket.SHUT_WR)
        deadline, chunks = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.startswith(b"HTTP/"):
        raise ConnectionError(f"no HTTP answer (read {len(raw)} bytes)")
    head_end = raw.find(b"\r\n\r\n")
    return int(raw.split(b" ", 2)[1]), raw[head_end + 4 :] if head_end >= 0 else b""


def shape_problem(path: str, status: int, body: Any, field: str | None = None) -> str | None:
    """What is wrong with an error answer in the shape of `path`'s API (OpenAI's for chat
    completions, completions and responses; Anthropic's for messages and count_tokens),
    including a message or param that does not name `field`; None when nothing is."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"no error object: {str(body)[:200]}"
    error = body["error"]
    if not isinstance(error.get("message"), str) or not error["message"]:
        return f"no message: {error}"
    if path.split("?")[0] in ANTHROPIC_PATHS:
        wanted = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else None)
        if body.get("type") != "error" or not isinstance(error.get("type"), str) or not error["type"]:
            return f"not Anthropic's shape: {body}"
        if wanted is not None and error["type"] != wanted:
            return f"error type {error['type']!r} for {status}, not {wanted!r}"
        if field is not None and field not in error["message"]:
            return f"message does not name {field!r}: {error['message']!r}"
        return None
    wanted = "server_error" if status >= 500 else "invalid_request_error"
    if error.get("type") != wanted:
        return f"error type {error.get('type')!r} for {status}, not {wanted!r}"
    for key in ("param", "code"):
        if key not in error or not isinstance(error[key], str | None):
            return f"{key} missing or not a string or null: {error}"
    if field is not None and field not in (error["param"] or ""):
        return f"param {error['param']!r} does not name {field!r} (message {error['message']!r})"
    return None


def error_shape_ok(path: str, status: int, body: Any, field: str | None = None) -> bool:
    """Whether an error answer is in its API's shape and names `field` (see shape_problem)."""
    return shape_problem(path, status, body, field) is None
