"""Joining a restore's pieces along the token axis, some of which may still be on disk.

A tier may hand a restore token arrays it has not read yet (`StoredPieces`):
they describe their shape and dtype, slice along the token axis, and join
themselves with the other pieces, so their bytes go from the file straight
into the restored cache's new buffer instead of through a copy of their own.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import mlx.core as mx

from .registry import kind_class


@runtime_checkable
class StoredPiece(Protocol):
    """A token array still in a file: as much of an mx.array as a restore reads."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def ndim(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def __getitem__(self, key) -> StoredPiece: ...

    def join(self, pieces: list, axis: int) -> mx.array:
        """`pieces` (mx arrays and stored pieces, this one among them) joined on `axis`."""
        ...


def join(pieces: list, axis: int) -> mx.array:
    """mx.concatenate, unless a piece is still on disk: then that piece's tier joins them."""
    for p in pieces:
        if not isinstance(p, mx.array):
            return p.join(pieces, axis)
    return mx.concatenate(pieces, axis=axis)


def token_array_names(layers: list, prefix: str = "L") -> set[str]:
    """Flat names (as `to_flat` writes them) of the arrays a restore only ever
    joins along the token axis: those of range kinds, without their cursors.
    `layers`: a snapshots record's per-layer metadata (SnapshotMeta or None)."""
    names: set[str] = set()
    for i, meta in enumerate(layers):
        _collect(meta, f"{prefix}{i}", names)
    return names


def _collect(meta, prefix: str, names: set[str]) -> None:
    if meta is None:
        return
    cls = kind_class(meta.kind)
    if cls.token_axis is not None and not cls.whole_state:
        cursors = set(getattr(cls, "cursor_names", ()))
        names.update(f"{prefix}/{a.name}" for a in meta.arrays if a.name not in cursors)
    for i, child in enumerate(meta.children):
        _collect(child, f"{prefix}/c{i}", names)
