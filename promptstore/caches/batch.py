"""Batch kinds: left-padded batches of sequences (mlx-lm's batch KV and batch rotating).

Positions here are buffer positions shared by the whole batch; each sequence's
own offset and left padding travel with the snapshot as cursor arrays.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..errors import CacheError, CacheShapeError, SnapshotFormatError, SnapshotRangeError
from .base import as_position
from .range import RangeKind
from .registry import adopt, register
from .rotating import check_live, check_window, window_room
from .snapshot import Snapshot, own
from .whole import WholeStateKind, _window_length

_CURSORS = ("offset", "left_padding")


def _check_cursors(snapshot: Snapshot, batch: int | None) -> None:
    for name in _CURSORS:
        a = snapshot.arrays.get(name)
        if a is None or a.ndim != 1:
            raise SnapshotFormatError(f"a batch snapshot needs a 1-D {name!r} array")
        if batch is not None and a.shape[0] != batch:
            raise CacheShapeError(f"{name!r} has {a.shape[0]} entries for a batch of {batch}")


@register
class BatchKVCache(RangeKind, mlx_cache.BatchKVCache):
    """mlx-lm's left-padded batch KV cache, with range snapshots over buffer positions."""

    kind: ClassVar[str] = "batch_kv"
    cursor_names: ClassVar[tuple[str, ...]] = _CURSORS

    @property
    def position(self) -> int:
        return self._idx

    def live_buffers(self):
        return None if self.keys is None else {"keys": self.keys, "values": self.values}

    def cursors(self):
        if self._right_padding is not None:
            raise CacheError("finalize() the batch before taking a snapshot")
        return {"offset": self.offset, "left_padding": self.left_padding}

    @classmethod
    def cursors_at(cls, snapshot, at):
        back = snapshot.end - at
        return {"offset": own(snapshot.arrays["offset"] - back), "left_padding": snapshot.arrays["left_padding"]}

    def plan_install(self, buffers, lo, target, last):
        cur = type(self).cursors_at(last, target)
        return {
            "keys": buffers["keys"],
            "values": buffers["values"],
            "_idx": target,
            "offset": cur["offset"],
            "left_padding": own(cur["left_padding"]),
            "_right_padding": None,
        }

    def _plan_rewind(self, target):
        return {"_idx": target, "offset": self.offset - (self._idx - target)}

    @classmethod
    def validate_extra(cls, snapshot: Snapshot) -> None:
        _check_cursors(snapshot, snapshot.arrays["keys"].shape[0])

    @classmethod
    def merge(cls, caches):
        return adopt(super().merge(caches))

    def extract(self, idx):
        return adopt(super().extract(idx))


@register
class BatchRotatingKVCache(WholeStateKind, mlx_cache.BatchRotatingKVCache):
    """mlx-lm's left-padded batch sliding-window cache, with whole-state snapshots."""

    kind: ClassVar[str] = "batch_rotating"

    @property
    def position(self) -> int:
        return self._offset

    token_axis: ClassVar[int | None] = 2

    def layout(self) -> dict:
        return {"max_size": int(self.max_size)}

    def _state_arrays(self) -> dict:
        return {} if self.keys is None else {"keys": self.keys, "values": self.values}

    def _window(self, v):
        return mx.roll(v, -self._idx, axis=2) if self.rotated else v[..., : self._idx, :]

    def snapshot(self, from_offset: int = 0) -> Snapshot:
        lo = as_position(from_offset, "from_offset")
        if lo > self._offset:
            raise SnapshotRangeError(f"from_offset {lo} is past the cache's position {self._offset}")
        if self._lengths is not None:
            raise CacheError("finalize() the batch before taking a snapshot")
        arrays = {"offset": own(self.offset), "left_padding": own(self.left_padding)}
        if self.keys is not None and self._offset > 0:
            arrays["keys"] = own(self._window(self.keys))
            arrays["values"] = own(self._window(self.values))
        return Snapshot(self.kind, lo, self._offset, True, arrays, self.layout())

    @classmethod
    def _reachable(cls, snapshot: Snapshot, target: int) -> bool:
        unwrapped = _window_length(snapshot) == snapshot.end
        return target == snapshot.end or (unwrapped and 0 <= target <= snapshot.end)

    def plan_whole(self, snapshot: Snapshot, target: int):
        check_live(self.keys, snapshot)
        back = snapshot.end - target
        plan = {
            "offset": own(snapshot.arrays["offset"] - back),
            "left_padding": own(snapshot.arrays["left_padding"]),
            "_offset": target,
            "rotated": False,
            "_lengths": None,
        }
        if target == 0 or "keys" not in snapshot.arrays:
            plan.update({"keys": None, "values": None, "_idx": 0})
            return plan
        for name in ("keys", "values"):
            a = snapshot.arrays[name]
            if back:
                a = a[..., :target, :]
            room = window_room(a.shape[2], self.max_size)
            pad = mx.zeros((*a.shape[:2], room, a.shape[3]), dtype=a.dtype)
            plan[name] = mx.concatenate([a, pad], axis=2) if room else own(a)
        plan["_idx"] = snapshot.arrays["keys"].shape[2] - back
        return plan

    def _plan_rewind(self, target: int):
        if target == self._offset:
            return {}
        if self.keys is not None and not self.rotated and self._idx == self._offset:
            back = self._offset - target
            return {"_offset": target, "_idx": target, "offset": self.offset - back}
        return None

    @classmethod
    def validate_snapshot(cls, snapshot: Snapshot) -> None:
        if not snapshot.whole or snapshot.children:
            raise SnapshotFormatError("a batch rotating snapshot is a whole-state snapshot")
        max_size = snapshot.scalars.get("max_size")
        window = {k: v for k, v in snapshot.arrays.items() if k not in _CURSORS}
        check_window(Snapshot(cls.kind, snapshot.start, snapshot.end, True, window), max_size)
        batch = window["keys"].shape[0] if window else None
        _check_cursors(snapshot, batch)
        length = _window_length(snapshot)
        if window and not (length == snapshot.end or max_size <= length < snapshot.end):
            raise CacheShapeError(f"a window of {length} positions cannot be the state at {snapshot.end}")

    @classmethod
    def merge(cls, caches):
        return adopt(super().merge(caches))

    def extract(self, idx):
        return adopt(super().extract(idx))
