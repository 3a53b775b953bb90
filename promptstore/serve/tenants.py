"""Tenants: API keys mapped to namespace salts, and the requests in flight that
tell the prompt cache whose namespace an insert belongs to."""

from __future__ import annotations

import hmac
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ServeConfigError
from .options import read_json_file


@dataclass(frozen=True)
class Tenant:
    """A namespace salt (None: the model's one namespace) and a label for logs,
    which never shows the key or the salt."""

    salt: str | None
    label: str


PUBLIC = Tenant(None, "public")


def load_api_keys(path: str | Path) -> dict[str, Tenant]:
    """{api key: Tenant} from a JSON object {"<key>": "<salt>", ...}; keys that
    share a salt are one tenant."""
    raw = read_json_file(path, "API keys file")
    if not isinstance(raw, dict) or not raw:
        raise ServeConfigError(f'the API keys file {path} must be a non-empty JSON object {{"<key>": "<salt>"}}')
    labels: dict[str, str] = {}
    keys = {}
    for key, salt in raw.items():
        if not key.strip() or not isinstance(salt, str) or not salt:
            raise ServeConfigError(
                f"the API keys file {path} maps a key to {type(salt).__name__}: want a non-empty salt"
            )
        label = labels.setdefault(salt, f"tenant-{len(labels) + 1}")
        keys[key] = Tenant(salt, label)
    return keys


class KeyRing:
    """Who a request's Authorization header says it is."""

    def __init__(self, keys: dict[str, Tenant] | None):
        self.keys = keys

    @property
    def required(self) -> bool:
        return self.keys is not None

    def tenants(self) -> tuple[Tenant, ...]:
        """Every tenant a request can be (PUBLIC alone without keys)."""
        if self.keys is None:
            return (PUBLIC,)
        return tuple(dict.fromkeys(self.keys.values()))

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant of "Bearer <key>", PUBLIC without keys, None when refused."""
        if self.keys is None:
            return PUBLIC
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        found = None
        for key, tenant in self.keys.items():  # every key compared, in constant time
            if hmac.compare_digest(key.encode(), given.strip().encode()):
                found = tenant
        return found


@dataclass(eq=False)
class InFlightRequest:
    """A request between tokenization and its last cache call."""

    tenant: Tenant
    prompt: list[int]
    chat: Any = None  # a replies.ChatTurn for chat requests
    first_out: bool = False  # its first token has been handed out
    retention: tuple = ()  # (end, class) per marked prefix, (None, class) for all it stores
    vision: Any = None  # a prompt with images: its VisionPrompt (its tokens are image keys)
    timeline: dict | None = None  # the HTTP request's timeline (serve/timeline.py), where one is kept


class TrackedPrompt(list):
    """A prompt's tokens, whose lifetime ends its in-flight entry: mlx_lm.server
    keeps the list `_tokenize` returns in the request's GenerationContext for as
    long as it may still call the cache for that request."""

    request: InFlightRequest


class InFlight:
    """Requests in flight, by the tokens they cover.

    mlx_lm.server calls its prompt cache with (model key, tokens) only. Each
    request is tracked from its tokenization until mlx-lm lets go of it; an
    insert belongs to a tenant only when every tracked request whose prompt
    agrees with its tokens is that tenant's.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: set[InFlightRequest] = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def track(self, request: InFlightRequest) -> TrackedPrompt:
        """The prompt to hand mlx_lm.server; `request` is in flight while it lives."""
        tracked = TrackedPrompt(request.prompt)
        tracked.request = request
        with self._lock:
            self._requests.add(request)
        weakref.finalize(tracked, self._drop, request)
        return tracked

    def _drop(self, request: InFlightRequest) -> None:
        with self._lock:
            self._requests.discard(request)

    def awaiting_first_token(self) -> bool:
        """Whether a request in flight has not had its first token handed out."""
        with self._lock:
            return any(not r.first_out for r in self._requests)

    def owners(self, tokens: list[int]) -> list[InFlightRequest]:
        """Requests whose prompt and `tokens` agree over their common length."""
        if not tokens:
            return []
        with self._lock:
            requests = list(self._requests)
        return [r for r in requests if _agree(r.prompt, tokens)]


def _agree(a: list[int], b: list[int]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]
