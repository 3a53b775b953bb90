"""Sealing: what goes to the remote server is encrypted and authenticated.

Records and blobs are AES-256-GCM under a key of their namespace, with the
Redis key they are stored at as associated data: a value moved to another key,
from another namespace, truncated or flipped fails to open, before anything
parses it. A record is the chain of blobs that tiles a prefix, validated again
after it opens. A blob larger than a piece is stored in pieces, each sealed to
its key, its index and the count, and all carrying one random set id: a piece
moved, reordered, dropped or taken from another publish fails, never joins. A
reader opens each piece into its place in the blob as it arrives (Assembly).
"""

from __future__ import annotations

import json
import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ...errors import RemoteError

MAGIC = b"PSR1"
NONCE = 12  # random per value: two replicas may seal different bytes under one key
MAX_LINKS = 100_000
MAX_PIECES = 65_536  # of one blob: 512 GiB at 8 MiB a piece
SET_ID = 16  # random per publish of a blob in pieces: its pieces share it
TAG = 16  # AES-GCM's authentication tag, after the ciphertext


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


class Assembly:
    """One blob's plaintext, its values opened into one buffer as they arrive, in
    any order, each straight into its place (no joining copy). The blob is read
    (`data`) only once every piece has opened, from one publish.

    `add` runs for one blob at a time (the buffer's seams are shared): on one thread.
    limit: the most bytes the blob may have (what its record says, and room for a
        header): values that would make it longer are garbage, before any is opened.
    """

    def __init__(self, key: bytes, names: list[str], limit: int):
        self.aead, self.names, self.limit = AESGCM(key), names, limit
        self.count = len(names)
        self.lead = SET_ID if self.count > 1 else 0  # a piece's plaintext opens with the set id
        self.size: int | None = None  # plaintext bytes of each piece but the last (set id left out)
        self.buffer: np.ndarray | None = None
        self.waiting: dict[int, bytes] = {}  # the last piece, until another says how long the others are
        self.set_ids: dict[int, bytes] = {}
        self.last = 0  # bytes of the last piece
        self.nbytes = 0  # sealed bytes received
        self.error: RemoteError | None = None

    @property
    def longest(self) -> int:
        """The most bytes a value of this blob may have (a longer one is garbage)."""
        return len(MAGIC) + NONCE + TAG + self.lead + self.limit // self.count + 1

    def add(self, index: int, value) -> bool:
        """Open one piece into place; a piece gone or bad is kept as the blob's error.
        True when `value` is no longer needed (False: kept until a sibling opens)."""
        if self.error is not None:
            return True
        try:
            return self._add(index, value)
        except RemoteError as e:
            self.error = e
            self.buffer = None
            self.waiting.clear()
            return True

    def _add(self, index: int, value) -> bool:
        where = _piece_where(self.names[index], index, self.count) if self.count > 1 else self.names[0]
        if value is None:
            raise RemoteError(f"{self.names[index][:20]}…: gone (evicted or never written)", "missing")
        length = _plaintext_bytes(value, where) - self.lead
        self.nbytes += len(value)
        if length < 0:
            raise RemoteError(f"{where[:16]}…: shorter than a piece's set id", "garbage")
        last = index == self.count - 1
        if not last and self.size is not None and length != self.size:
            raise RemoteError(f"{where[:16]}…: {length} bytes, its siblings {self.size}", "garbage")
        if last:
            self.last = length
        if self.size is None:
            if last and self.count > 1:
                self.waiting[index] = value
                return False
            if self.count * length > self.limit + self.count:
                raise RemoteError(f"{where[:16]}…: pieces longer than the blob's record allows", "garbage")
            self.size = length
            # Room for every piece at the size of the first (the last is no longer), after a lead
            # that the first piece's set id opens into.
            self.buffer = np.empty(self.lead + self.count * length, np.uint8)
            for i, v in self.waiting.items():
                self._open(i, v, _piece_where(self.names[i], i, self.count))
            self.waiting.clear()
        self._open(index, value, where)
        return True

    def _open(self, index: int, value: bytes, where: str) -> None:
        size, lead = self.size, self.lead
        length = _plaintext_bytes(value, where) - lead
        if length > size:
            raise RemoteError(f"{where[:16]}…: the last piece is longer than the others", "garbage")
        view = memoryview(self.buffer)
        at = index * size  # the piece's set id lands on the end of the piece before: kept aside
        kept = bytes(view[at : at + lead])
        try:
            nonce = bytes(value[len(MAGIC) : len(MAGIC) + NONCE])
            self.aead.decrypt_into(
                nonce, memoryview(value)[len(MAGIC) + NONCE :], where.encode(), view[at : at + lead + length]
            )
        except InvalidTag:
            raise RemoteError(f"{where[:16]}…: fails authentication", "garbage") from None
        if lead:
            self.set_ids[index] = bytes(view[at : at + lead])
            view[at : at + lead] = kept

    def data(self) -> memoryview:
        """The blob's bytes; RemoteError when a piece was gone or bad, or the pieces
        come from different publishes."""
        if self.error is not None:
            raise self.error
        if self.buffer is None or len(self.set_ids) + (self.lead == 0) < self.count:
            raise RemoteError(f"{self.names[0][:20]}…: not every piece arrived", "missing")
        if len(set(self.set_ids.values())) > 1:
            raise RemoteError(f"{self.names[0][:20]}…: pieces of different publishes", "garbage")
        return memoryview(self.buffer)[self.lead : self.lead + (self.count - 1) * self.size + self.last]


def _plaintext_bytes(value, where: str) -> int:
    """Of a sealed value: bytes as a client library gives them, or a buffer read into."""
    if not isinstance(value, (bytes, memoryview)) or len(value) < len(MAGIC) + NONCE + TAG:
        raise RemoteError(f"{where[:16]}…: not a sealed value", "garbage")
    if bytes(value[: len(MAGIC)]) != MAGIC:
        raise RemoteError(f"{where[:16]}…: not a sealed value", "garbage")
    return len(value) - len(MAGIC) - NONCE - TAG


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
