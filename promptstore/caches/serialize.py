"""The versioned serialized form of snapshots: flat named arrays plus metadata.

The cold tier writes this as safetensors. The metadata record is validated
before any array is used; kinds are resolved through the closed registry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import SnapshotFormatError
from .registry import kind_class
from .snapshot import Snapshot

# 2: a cache list's whole-state child may be null (no state at the snapshot's end).
# 3: sliding-window (rotating) layers are stored as ranges of positions.
# Each version's files are the next one's without what it added, so all are read.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
METADATA_KEY = "promptstore.snapshots"

DTYPES: dict[str, mx.Dtype] = {
    name: getattr(mx, name)
    for name in (
        "bool_",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
    )
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_NAME = re.compile(r"^[A-Za-z0-9_.]{1,64}$")

ScalarValue = bool | int | float | str | None | list[str]


class ArraySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=_NAME.pattern)
    dtype: str
    shape: list[int] = Field(max_length=8)


class SnapshotMeta(BaseModel):
    """What a serialized snapshot says of itself."""

    model_config = ConfigDict(extra="forbid")
    kind: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    whole: bool
    scalars: dict[str, ScalarValue] = {}
    arrays: list[ArraySpec] = []
    children: list[SnapshotMeta | None] = []


class SnapshotsRecord(BaseModel):
    """The metadata of one serialized model state: one entry per layer."""

    model_config = ConfigDict(extra="forbid")
    format_version: int
    layers: list[SnapshotMeta | None]  # None: the node holds nothing for that layer


def _flatten(snap: Snapshot, prefix: str, out: dict) -> SnapshotMeta:
    specs = []
    for name, a in snap.arrays.items():
        if not _NAME.match(name):
            raise SnapshotFormatError(f"array name {name!r} cannot be serialized")
        out[f"{prefix}/{name}"] = a
        specs.append(ArraySpec(name=name, dtype=_DTYPE_NAMES[a.dtype], shape=list(a.shape)))
    children = [None if c is None else _flatten(c, f"{prefix}/c{i}", out) for i, c in enumerate(snap.children)]
    return SnapshotMeta(
        kind=snap.kind,
        start=snap.start,
        end=snap.end,
        whole=snap.whole,
        scalars=dict(snap.scalars),
        arrays=specs,
        children=children,
    )


def to_flat(snapshots: Sequence[Snapshot | None]) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Per-layer snapshots (None for a layer without one) -> (arrays by flat
    name, string metadata)."""
    arrays: dict[str, mx.array] = {}
    metas = [None if s is None else _flatten(s, f"L{i}", arrays) for i, s in enumerate(snapshots)]
    record = SnapshotsRecord(format_version=FORMAT_VERSION, layers=metas)
    return arrays, {METADATA_KEY: record.model_dump_json()}


def parse_record(metadata: dict | None) -> SnapshotsRecord:
    """The snapshots record of `to_flat` metadata, checked (no arrays needed)."""
    text = (metadata or {}).get(METADATA_KEY)
    if not isinstance(text, str):
        raise SnapshotFormatError(f"no {METADATA_KEY!r} metadata record")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SnapshotFormatError(f"metadata is not JSON: {e}") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise SnapshotFormatError(f"snapshot format version {version!r}; this code reads versions {READABLE_VERSIONS}")
    try:
        return SnapshotsRecord.model_validate(raw)
    except (ValidationError, RecursionError) as e:
        raise SnapshotFormatError(f"malformed snapshot metadata: {e}") from None


def _unflatten(meta: SnapshotMeta, prefix: str, arrays: dict, used: set) -> Snapshot:
    cls = kind_class(meta.kind)
    own = {}
    for spec in meta.arrays:
        key = f"{prefix}/{spec.name}"
        a = arrays.get(key)
        if a is None:
            raise SnapshotFormatError(f"array {key!r} is missing")
        if spec.dtype not in DTYPES or DTYPES[spec.dtype] != a.dtype or list(a.shape) != spec.shape:
            raise SnapshotFormatError(
                f"array {key!r} is {a.dtype} {tuple(a.shape)}, metadata says {spec.dtype} {tuple(spec.shape)}"
            )
        own[spec.name] = a
        used.add(key)
    children = tuple(
        None if c is None else _unflatten(c, f"{prefix}/c{i}", arrays, used) for i, c in enumerate(meta.children)
    )
    snap = Snapshot(meta.kind, meta.start, meta.end, meta.whole, own, dict(meta.scalars), children)
    if snap.end < snap.start:
        raise SnapshotFormatError(f"span [{snap.start}, {snap.end}) is reversed")
    cls.validate_snapshot(snap)  # each kind refuses the `whole` flag it does not write
    return snap


def from_flat(arrays: dict[str, mx.array], metadata) -> list[Snapshot | None]:
    """(arrays, metadata) written by `to_flat` -> per-layer snapshots, validated.
    `metadata` may also be its record, already parsed by `parse_record`."""
    record = metadata if isinstance(metadata, SnapshotsRecord) else parse_record(metadata)
    used: set = set()
    snaps = [None if m is None else _unflatten(m, f"L{i}", arrays, used) for i, m in enumerate(record.layers)]
    extra = set(arrays) - used
    if extra:
        raise SnapshotFormatError(f"arrays not named by the metadata: {sorted(extra)[:5]}")
    return snaps
