"""Sliding-window attention (mlx-lm's rotating KV cache), with whole-state snapshots.

A snapshot is the window in temporal order plus the position it was taken at.
It restores exactly there, or anywhere before it while the window has not yet
dropped a token (then the window holds every position from 0).
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..errors import CacheShapeError, SnapshotFormatError, SnapshotRangeError
from .base import as_position, headroom
from .registry import kind_class, register
from .snapshot import Snapshot, own
from .whole import WholeStateKind, _window_length


def window_room(length: int, max_size: int) -> int:
    """Free slots after a restored window: never past max_size, where the
    cache would start trimming live positions."""
    return 0 if length >= max_size else min(headroom(length), max_size - length)


def check_window(snapshot: Snapshot, max_size) -> None:
    """Shared checks for window snapshots (single and batched)."""
    if not isinstance(max_size, int) or max_size <= 0:
        raise SnapshotFormatError(f"bad window size {max_size!r}")
    if not snapshot.arrays:
        if snapshot.end != 0:
            raise SnapshotFormatError(f"a window snapshot at {snapshot.end} holds no arrays")
        return
    keys, values = snapshot.arrays.get("keys"), snapshot.arrays.get("values")
    if keys is None or values is None:
        raise SnapshotFormatError("a window snapshot needs keys and values")
    if keys.ndim != 4 or values.ndim != 4:
        raise CacheShapeError(f"keys/values must be rank 4, got {keys.ndim} and {values.ndim}")
    if keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype:
        raise CacheShapeError(
            f"keys {tuple(keys.shape)} {keys.dtype} do not match values {tuple(values.shape)} {values.dtype}"
        )


def check_live(live_keys, snapshot: Snapshot) -> None:
    """Refuse a window of another batch, head count, head dim or dtype."""
    keys = snapshot.arrays.get("keys")
    if live_keys is None or keys is None:
        return
    a, b = live_keys, keys
    if a.dtype != b.dtype or a.shape[:2] != b.shape[:2] or a.shape[3] != b.shape[3]:
        raise CacheShapeError(
            f"a window of shape {tuple(b.shape)} {b.dtype} does not fit a cache of {tuple(a.shape)} {a.dtype}"
        )


@register
class RotatingKVCache(WholeStateKind, mlx_cache.RotatingKVCache):
    """mlx-lm's sliding-window cache (with `keep` sink tokens)."""

    kind: ClassVar[str] = "rotating"

    token_axis: ClassVar[int | None] = 2

    def layout(self) -> dict:
        return {"max_size": int(self.max_size), "keep": int(self.keep)}

    def _state_arrays(self) -> dict:
        return {} if self.keys is None else {"keys": self.keys, "values": self.values}

    def snapshot(self, from_offset: int = 0) -> Snapshot:
        lo = as_position(from_offset, "from_offset")
        if lo > self.offset:
            raise SnapshotRangeError(f"from_offset {lo} is past the cache's position {self.offset}")
        arrays = {}
        if self.keys is not None and self.offset > 0:
            arrays = {
                "keys": own(self._temporal_order(self.keys)),
                "values": own(self._temporal_order(self.values)),
            }
        return Snapshot(self.kind, lo, self.offset, True, arrays, self.layout())

    @classmethod
    def _reachable(cls, snapshot: Snapshot, target: int) -> bool:
        unwrapped = _window_length(snapshot) == snapshot.end
        return target == snapshot.end or (unwrapped and 0 <= target <= snapshot.end)

    @classmethod
    def split_snapshot(cls, snapshot: Snapshot, at: int):
        at = as_position(at, "split position")
        cls.validate_snapshot(snapshot)
        if at >= snapshot.end:
            return snapshot, None
        if at <= snapshot.start or not cls._reachable(snapshot, at):
            return None, snapshot
        upper = {n: own(a[..., :at, :]) for n, a in snapshot.arrays.items()}
        return (
            Snapshot(cls.kind, snapshot.start, at, True, upper, dict(snapshot.scalars)),
            Snapshot(cls.kind, at, snapshot.end, True, snapshot.arrays, dict(snapshot.scalars)),
        )

    def plan_whole(self, snapshot: Snapshot, target: int):
        check_live(self.keys, snapshot)
        if target == 0 or not snapshot.arrays:
            return {"keys": None, "values": None, "offset": 0, "_idx": 0}
        planned = {}
        for name in ("keys", "values"):
            a = snapshot.arrays[name]
            if target < snapshot.end:
                a = a[..., :target, :]
            room = window_room(a.shape[2], self.max_size)
            pad = mx.zeros((*a.shape[:2], room, a.shape[3]), dtype=a.dtype)
            planned[name] = mx.concatenate([a, pad], axis=2) if room else own(a)
        length = snapshot.arrays["keys"].shape[2] if target == snapshot.end else target
        planned.update({"offset": target, "_idx": length})
        return planned

    def _plan_rewind(self, target: int):
        if target == self.offset:
            return {}
        if self.keys is not None and self._idx == self.offset:
            return {"offset": target, "_idx": target}  # buffer index == position
        return None

    @classmethod
    def validate_snapshot(cls, snapshot: Snapshot) -> None:
        if not snapshot.whole or snapshot.children:
            raise SnapshotFormatError("a rotating snapshot is a whole-state snapshot")
        max_size, keep = snapshot.scalars.get("max_size"), snapshot.scalars.get("keep")
        check_window(snapshot, max_size)
        if not isinstance(keep, int) or not 0 <= keep < max_size:
            raise SnapshotFormatError(f"bad keep {keep!r} for a window of {max_size}")
        if snapshot.arrays:
            length = snapshot.arrays["keys"].shape[2]
            if not (length == snapshot.end or max_size <= length < snapshot.end):
                raise CacheShapeError(
                    f"a window of {length} positions cannot be the state at {snapshot.end} with max_size {max_size}"
                )

    @classmethod
    def merge(cls, caches):
        return kind_class("batch_rotating").merge(caches)
