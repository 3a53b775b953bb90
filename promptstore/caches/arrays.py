"""Recurrent state (mlx-lm's arrays cache: Mamba, gated delta nets, convolutions).

The state at a position folds in every earlier token, so a snapshot is the
whole state at exactly one offset. mlx-lm's arrays cache does not know its
offset; this one counts the tokens models report through `advance`, and the
model-level functions set it for models that never call `advance`.
"""

from __future__ import annotations

from typing import ClassVar

from mlx_lm.models import cache as mlx_cache

from ..errors import CacheShapeError, SnapshotFormatError, SnapshotRangeError
from .base import as_position
from .registry import adopt, register
from .snapshot import Snapshot, own
from .whole import WholeStateKind

_EXTRA = ("left_padding", "lengths")
MAX_STATE_SLOTS = 64  # models use 2-4; a file claiming more is malformed


@register
class ArraysCache(WholeStateKind, mlx_cache.ArraysCache):
    """mlx-lm's list of recurrent state arrays, with an offset and whole-state snapshots."""

    kind: ClassVar[str] = "arrays"
    offset: int = 0  # class default: adopted and file-loaded instances start here

    def advance(self, N):
        super().advance(N)
        self.offset = self.offset + N

    def layout(self) -> dict:
        return {"size": len(self.cache)}

    def _state_arrays(self) -> dict:
        return {f"s{i}": a for i, a in enumerate(self.cache) if a is not None}

    def snapshot(self, from_offset: int = 0) -> Snapshot:
        lo = as_position(from_offset, "from_offset")
        if lo > self.offset:
            raise SnapshotRangeError(f"from_offset {lo} is past the cache's position {self.offset}")
        arrays = {f"s{i}": own(a) for i, a in enumerate(self.cache) if a is not None}
        for name in _EXTRA:
            value = getattr(self, name)
            if value is not None:
                arrays[name] = own(value)
        return Snapshot(self.kind, lo, self.offset, True, arrays, self.layout())

    def plan_whole(self, snapshot: Snapshot, target: int):
        size = snapshot.scalars["size"]
        # Copies: the hit must not share a buffer with the stored snapshot.
        state = [None] * size
        for i in range(size):
            if f"s{i}" in snapshot.arrays:
                state[i] = own(snapshot.arrays[f"s{i}"])
        plan = {"cache": state, "offset": target}
        for name in _EXTRA:
            value = snapshot.arrays.get(name)
            plan[name] = None if value is None else own(value)
        return plan

    @classmethod
    def validate_snapshot(cls, snapshot: Snapshot) -> None:
        if not snapshot.whole or snapshot.children:
            raise SnapshotFormatError("an arrays snapshot is a whole-state snapshot")
        size = snapshot.scalars.get("size")
        if not isinstance(size, int) or size <= 0:
            raise SnapshotFormatError(f"bad state size {size!r}")
        if size > MAX_STATE_SLOTS:
            raise SnapshotFormatError(f"{size} state slots; at most {MAX_STATE_SLOTS}")
        allowed = {f"s{i}" for i in range(size)} | set(_EXTRA)
        unknown = set(snapshot.arrays) - allowed
        if unknown:
            raise SnapshotFormatError(f"unexpected arrays {sorted(unknown)} for {size} state slots")
        batch = {a.shape[0] for n, a in snapshot.arrays.items() if n.startswith("s") and a.ndim}
        if len(batch) > 1:
            raise CacheShapeError(f"state arrays disagree on batch size: {sorted(batch)}")
        if snapshot.end > 0 and not any(n.startswith("s") for n in snapshot.arrays):
            raise SnapshotFormatError(f"a recurrent state at {snapshot.end} holds no arrays")

    def extract(self, idx):
        out = adopt(super().extract(idx))
        out.offset = self.offset
        return out
