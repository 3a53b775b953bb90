"""Node records and their encoding in the nodes database.

A stored node is a compact, checksummed header (span, parent, per-layer presence
bits) followed by the full pydantic record as JSON. Lookups read only the header;
the record is decoded when a caller asks for it.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from promptstore.errors import CorruptRecordError, RecordLayoutError
from promptstore.identity import NodeId

from .namespace import Namespace

Tier = Literal["hot", "cold", "both"]


class LayerRef(BaseModel):
    """What a node holds for one layer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    whole: bool = Field(description="whole-state snapshot at the node's end (else a range)")
    present: bool = Field(description="False for a whole-state layer not checkpointed here yet")
    nbytes: int = Field(default=0, ge=0)


class FileNode(BaseModel):
    """The node a file was written for, when a record names a file of a wider span.

    A split does not wait for its halves' own files: each half keeps naming (a
    link to) the file of the node it was part of, and reads its part of it,
    until a file of its own replaces it. So a disk that refuses the new files
    never costs what was stored already.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(description="the node key the file was written for, hex")
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class NodeRecord(BaseModel):
    """Where a node's snapshots live and what they are worth."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: list[LayerRef]
    tier: Tier = "hot"
    file: str | None = Field(default=None, description="safetensors path relative to the store")
    file_node: FileNode | None = Field(default=None, description="the wider node `file` was written for, if another")
    nbytes: int = Field(default=0, ge=0)
    checksum: str | None = None
    created: float = Field(default_factory=time.time)
    hits: int = Field(default=0, ge=0)
    prefill_seconds: float = Field(default=0.0, ge=0.0, description="prefill time this node saves")
    retention: str | None = Field(default=None, description="the retention class a client asked for")
    keep_until: float | None = Field(default=None, description="time (epoch seconds) the disk budget keeps it until")

    @classmethod
    def blank(cls, namespace: Namespace, present: bool | Sequence[bool] = True, **fields) -> NodeRecord:
        """A record laid out for `namespace`; `present` for all layers or one flag per layer."""
        flags = [present] * namespace.n_layers if isinstance(present, bool) else list(present)
        if len(flags) != namespace.n_layers:
            raise RecordLayoutError(f"{len(flags)} presence flags for {namespace.n_layers} layers")
        layers = [LayerRef(whole=w, present=p) for w, p in zip(namespace.whole, flags)]
        return cls(layers=layers, **fields)

    def present_mask(self) -> int:
        return sum(1 << i for i, layer in enumerate(self.layers) if layer.present)


def check_record_layout(namespace: Namespace, record: NodeRecord) -> None:
    """Raise RecordLayoutError unless the record has one matching LayerRef per layer."""
    whole = tuple(layer.whole for layer in record.layers)
    if whole != namespace.whole:
        raise RecordLayoutError(
            f"record layers (whole={whole}) do not match namespace layout (whole={namespace.whole})"
        )


# checksum, magic, version, namespace, parent, start, end, n_layers, nbytes, record length.
# The checksum covers everything after it plus the edge tokens, so a torn or garbage
# value can never pass as a node.
_HEADER = struct.Struct("<Q2sB16s16sQQIQI")
_MAGIC = b"PN"
_UNKEPT = {"retention", "keep_until"}
_VERSION = 1


@dataclass(eq=False, slots=True)
class Node:
    """One trie node: the span [start, end) of its namespace, its edge tokens and record.

    A plain slotted class: lookups build one per path node, so construction must be cheap.
    """

    key: bytes
    namespace: bytes
    parent: bytes
    start: int
    end: int
    n_layers: int
    present: int  # bit i set: layer i holds data here
    nbytes: int
    edge: bytes  # packed little-endian uint32
    stored: bytes = field(repr=False)  # the whole nodes-db value
    body_at: int = field(repr=False)  # where the record JSON starts in it
    _record: NodeRecord | None = field(default=None, repr=False)

    @property
    def id(self) -> NodeId:
        return NodeId(self.key, self.namespace, self.start, self.end)

    @property
    def record_json(self) -> bytes:
        return self.stored[self.body_at :]

    @property
    def tokens(self) -> np.ndarray:
        """The edge tokens, uint32 (read-only)."""
        return np.frombuffer(self.edge, dtype="<u4")

    @property
    def record(self) -> NodeRecord:
        # Decoded on first use: a lookup touches dozens of nodes and needs only their headers.
        if self._record is None:
            try:
                self._record = NodeRecord.model_validate_json(self.record_json)
            except ValidationError as e:
                raise CorruptRecordError(f"node {self.key.hex()}: record does not validate: {e}") from e
        return self._record

    def __repr__(self) -> str:
        return f"Node({self.key.hex()[:12]}…, [{self.start}, {self.end}))"


def encode_node(
    namespace: bytes,
    parent: bytes,
    start: int,
    end: int,
    record: NodeRecord,
    edge: bytes,
) -> bytes:
    """The nodes-db value for a node; `edge` is the packed uint32 tokens stored beside it."""
    # Without retention the record is written as before it existed (older readers take it).
    body = record.model_dump_json(exclude=_UNKEPT if record.keep_until is None else None).encode()
    n_layers = len(record.layers)
    bits = record.present_mask().to_bytes((n_layers + 7) // 8, "little")
    head = _HEADER.pack(
        0,
        _MAGIC,
        _VERSION,
        namespace,
        parent,
        start,
        end,
        n_layers,
        record.nbytes,
        len(body),
    )
    unsummed = head[8:] + bits + body
    return struct.pack("<Q", _checksum(unsummed, edge)) + unsummed


def _checksum(unsummed, edge) -> int:
    # Chained through the seed: two C calls, no concatenation, no hasher object.
    return xxhash.xxh3_64_intdigest(edge, seed=xxhash.xxh3_64_intdigest(unsummed))


def stored_namespace(value) -> bytes | None:
    """The namespace in a stored node's header, unverified (None if too short to hold one)."""
    return bytes(value[11:27]) if len(value) >= _HEADER.size else None


def decode_node(key: bytes, value, edge) -> Node:
    """Parse and verify a stored node (buffers from a read txn); CorruptRecordError if bad."""
    if value is None or edge is None:
        raise CorruptRecordError(f"node {key.hex()}: missing record or edge")
    value, edge = bytes(value), bytes(edge)  # one copy each out of the txn's map
    if len(value) < _HEADER.size:
        raise CorruptRecordError(f"node {key.hex()}: record of {len(value)} bytes is truncated")
    checksum, magic, version, ns, parent, start, end, n_layers, nbytes, body_len = _HEADER.unpack_from(value)
    body_at = _HEADER.size + (n_layers + 7) // 8
    if magic != _MAGIC or version != _VERSION:
        raise CorruptRecordError(f"node {key.hex()}: unknown header {magic!r} v{version}")
    if len(value) != body_at + body_len or end <= start or len(edge) != 4 * (end - start):
        raise CorruptRecordError(f"node {key.hex()}: inconsistent lengths")
    if _checksum(memoryview(value)[8:], edge) != checksum:
        raise CorruptRecordError(f"node {key.hex()}: checksum mismatch")
    present = int.from_bytes(value[_HEADER.size : body_at], "little")
    return Node(key, ns, parent, start, end, n_layers, present, nbytes, edge, value, body_at)
