"""Sealing: what goes to the remote server is encrypted and authenticated.

Records and blobs are AES-256-GCM under a key of their namespace, with the
Redis key they are stored at as associated data: a value moved to another key,
from another namespace, truncated or flipped fails to open, before anything
parses it. A record is the chain of blobs that tiles a prefix, validated again
after it opens. A blob larger than a piece is stored in pieces, each sealed to
its key, its index and the count, and all carrying one random set id: a piece
moved, reordered, dropped or taken from another publish fails, never joins.
"""

from __future__ import annotations

import json
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ...errors import RemoteError

MAGIC = b"PSR1"
NONCE = 12  # random per value: two replicas may seal different bytes under one key
MAX_LINKS = 100_000
MAX_PIECES = 65_536  # of one blob: 2 TiB at 32 MiB a piece
SET_ID = 16  # random per publish of a blob in pieces: its pieces share it


class Link(BaseModel):
    """One node of a published chain: its span, blob id and what it saves."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    start: int = Field(ge=0)
    end: int = Field(ge=1)
    blob: str = Field(pattern=r"^[0-9a-f]{32}$")
    nbytes: int = Field(ge=0)
    seconds: float = Field(ge=0)
    pieces: int = Field(1, ge=1, le=MAX_PIECES)  # the blob's values (1: one value, as before pieces)


class Chain(BaseModel):
    """The nodes that tile the prefix [0, links[-1].end), in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    links: list[Link] = Field(min_length=1, max_length=MAX_LINKS)

    @model_validator(mode="after")
    def _tiles(self) -> Chain:
        at = 0
        for link in self.links:
            if link.start != at or link.end <= link.start:
                raise ValueError(f"link [{link.start}, {link.end}) does not follow position {at}")
            at = link.end
        return self

    @property
    def end(self) -> int:
        return self.links[-1].end


def seal(key: bytes, plaintext: bytes, where: str) -> bytes:
    nonce = os.urandom(NONCE)
    return MAGIC + nonce + AESGCM(key).encrypt(nonce, plaintext, where.encode())


def unseal(key: bytes, value: bytes | None, where: str) -> bytes:
    """The plaintext of a sealed value, or RemoteError("garbage")."""
    if not isinstance(value, bytes) or len(value) < len(MAGIC) + NONCE + 16 or not value.startswith(MAGIC):
        raise RemoteError(f"{where[:16]}…: not a sealed value", "garbage")
    nonce = value[len(MAGIC) : len(MAGIC) + NONCE]
    try:
        return AESGCM(key).decrypt(nonce, value[len(MAGIC) + NONCE :], where.encode())
    except InvalidTag:
        raise RemoteError(f"{where[:16]}…: fails authentication", "garbage") from None


def seal_pieces(key: bytes, data: bytes, names: list[str]) -> list[bytes]:
    """`data` cut into len(names) pieces of equal size (the last shorter), each sealed
    to its name, its index and the count; one name: a single value, sealed as before."""
    n = len(names)
    if n == 1:
        return [seal(key, data, names[0])]
    size = -(-len(data) // n)
    set_id = os.urandom(SET_ID)
    return [seal(key, set_id + data[i * size : (i + 1) * size], _piece_where(names[i], i, n)) for i in range(n)]


def unseal_pieces(key: bytes, values: list, names: list[str]) -> bytes:
    """The blob joined from its pieces, or RemoteError: "missing" (a piece is gone),
    "garbage" (one fails to open, or they come from different publishes)."""
    gone = [name for name, value in zip(names, values) if value is None]
    if gone:
        raise RemoteError(f"{gone[0][:20]}…: gone (evicted or never written), {len(gone)} of {len(names)}", "missing")
    if len(names) == 1:
        return unseal(key, values[0], names[0])
    parts = [
        unseal(key, value, _piece_where(name, i, len(names))) for i, (name, value) in enumerate(zip(names, values))
    ]
    if any(len(part) < SET_ID or part[:SET_ID] != parts[0][:SET_ID] for part in parts):
        raise RemoteError(f"{names[0][:20]}…: pieces of different publishes", "garbage")
    return b"".join(part[SET_ID:] for part in parts)


def _piece_where(name: str, index: int, count: int) -> str:
    return f"{name}#{index}/{count}"


def seal_chain(key: bytes, chain: Chain, where: str) -> bytes:
    # Defaults left out: a record of blobs in one value each reads as before pieces.
    return seal(key, chain.model_dump_json(exclude_defaults=True).encode(), where)


def unseal_chain(key: bytes, value: bytes | None, where: str) -> Chain:
    text = unseal(key, value, where)
    try:
        return Chain.model_validate(json.loads(text))
    except (ValidationError, ValueError, RecursionError) as e:
        raise RemoteError(f"{where[:16]}…: not a chain record: {str(e)[:200]}", "garbage") from None
