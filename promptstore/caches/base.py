"""The snapshot protocol every cache kind implements, and shared checks.

`restore` is split into `plan_restore` (validate and compute the new state,
touching nothing) and `apply_restore` (assign it), so a restore either happens
whole or not at all, for one layer, a cache list, or a whole model.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, ClassVar

from ..errors import SnapshotKindError, SnapshotRangeError
from .snapshot import Snapshot

SnapshotChain = Snapshot | Sequence[Snapshot]

# New buffers get room for this many tokens past the restored ones, so the
# first decode step writes in place instead of copying the whole buffer.
STEP = 256


def as_position(value: Any, what: str) -> int:
    """An int position >= 0, or a SnapshotRangeError saying what was given."""
    try:
        pos = operator.index(value)
    except TypeError:
        raise SnapshotRangeError(f"{what} must be an int, got {value!r}") from None
    if pos < 0:
        raise SnapshotRangeError(f"{what} must be >= 0, got {pos}")
    return pos


def headroom(target: int) -> int:
    """Free slots to allocate after `target` tokens: up to the next step, at least one."""
    return (target // STEP + 1) * STEP - target


class SnapshotProtocol:
    """Mixin giving an mlx-lm cache class the snapshot protocol.

    kind: closed-registry name, written into serialized snapshots.
    whole_state: snapshots hold the whole state at their end (not a range).
    role: how the kind restores: "range" (anywhere its positions are stored),
        "window" (where the positions its window needs are stored) or "state"
        (only where its state was stored).
    token_axis: the axis of state arrays that grows with tokens (None: none does).

    Callers use `layout`, `snapshot`, `signature`, `restore` (or `plan_restore`
    then `apply_restore`, to restore several caches all or none), and the class
    methods `merge_chain`, `split_snapshot` and `validate_snapshot`. Each kind
    also provides `_state_arrays` and `_plan_rewind` for the shared code here.
    """

    kind: ClassVar[str]
    whole_state: ClassVar[bool] = False
    role: ClassVar[str] = "range"
    token_axis: ClassVar[int | None] = None

    @property
    def position(self) -> int:
        """Token positions this cache has seen (its offset)."""
        return self.offset

    def layout(self) -> dict:
        """The settings a snapshot must share with this cache to be restored."""
        return {}

    def snapshot(self, from_offset: int = 0) -> Snapshot:
        """The state needed to go from `from_offset` to the current position."""
        raise NotImplementedError

    def signature(self) -> tuple:
        """(name, dtype, shape without the token axis) of every state array: the same
        for any two caches one model layer filled, whatever their lengths. Reads
        shapes only, so a lazily computed cache is not evaluated."""
        out = []
        for name, a in sorted(self._state_arrays().items()):
            shape = list(a.shape)
            if self.token_axis is not None and len(shape) > self.token_axis:
                del shape[self.token_axis]
            out.append((name, str(a.dtype), tuple(shape)))
        return tuple(out)

    def plan_restore(self, snapshot: SnapshotChain | None, target: int):
        """New attribute values that bring the cache to `target`, or None if
        `target` is unreachable. Raises on bad input; changes nothing."""
        raise NotImplementedError

    def apply_restore(self, plan: dict) -> None:
        for name, value in plan.items():
            setattr(self, name, value)

    def restore(self, snapshot: SnapshotChain | None, target: int) -> bool:
        """Bring the cache to `target` from `snapshot` (a snapshot or a chain of
        consecutive snapshots), or rewind in place when it is None. Returns
        False, leaving the cache unchanged, when `target` is unreachable."""
        plan = self.plan_restore(snapshot, target)
        if plan is None:
            return False
        self.apply_restore(plan)
        return True

    @classmethod
    def merge_chain(cls, chain: Sequence[Snapshot]) -> Snapshot:
        """Consecutive snapshots `[a, b)`, `[b, c)`, ... -> one `[a, z)` (whole-state
        kinds: the last one's state)."""
        raise NotImplementedError

    @classmethod
    def split_snapshot(cls, snapshot: Snapshot, at: int):
        """`[a, c)` -> (`[a, at)`, `[at, c)`); kinds that cannot: (None, snapshot).
        A position at or past either end leaves the snapshot whole on its side."""
        at = as_position(at, "split position")
        cls.validate_snapshot(snapshot)
        if at >= snapshot.end:
            return snapshot, None
        if at <= snapshot.start:
            return None, snapshot
        return cls.split_inside(snapshot, at)

    @classmethod
    def split_inside(cls, snapshot: Snapshot, at: int):
        """split_snapshot at a position strictly inside the snapshot's span."""
        raise NotImplementedError

    @classmethod
    def validate_snapshot(cls, snapshot: Snapshot) -> None:
        """Raise a typed error if the snapshot's arrays or scalars are malformed."""
        raise NotImplementedError

    # --- what each kind provides for the shared code --------------------------

    def _state_arrays(self) -> dict:
        """The arrays the cache holds, by name, as held (no copy); {} while empty."""
        raise NotImplementedError

    def _plan_rewind(self, target: int) -> dict | None:
        """Attributes for rewinding in place to `target` <= position, or None."""
        raise NotImplementedError


def rewind_plan(cache: SnapshotProtocol, target: int) -> dict | None:
    """The cache's own rewind to `target`, refusing a target past its position."""
    if target > cache.position:
        raise SnapshotRangeError(f"cannot rewind to {target}: the cache is at {cache.position}")
    return cache._plan_rewind(target)


def check_snapshot_layout(cache: SnapshotProtocol, snapshot: Snapshot) -> None:
    """A snapshot of the cache's kind and layout, or SnapshotKindError."""
    if snapshot.kind != cache.kind:
        raise SnapshotKindError(f"a {snapshot.kind!r} snapshot cannot restore a {cache.kind!r} cache")
    mine = cache.layout()
    theirs = {k: snapshot.scalars.get(k) for k in mine}
    if theirs != mine:
        raise SnapshotKindError(f"snapshot layout {theirs} does not match the cache's {mine}")


def as_chain(snapshot: SnapshotChain, kind: str) -> list[Snapshot]:
    """A non-empty list of consecutive snapshots of one kind."""
    chain = [snapshot] if isinstance(snapshot, Snapshot) else list(snapshot)
    if not chain:
        raise SnapshotRangeError("an empty chain of snapshots restores nothing")
    for s in chain:
        if not isinstance(s, Snapshot):
            raise SnapshotKindError(f"expected a Snapshot, got {type(s).__name__}")
        if s.kind != kind:
            raise SnapshotKindError(f"a {s.kind!r} snapshot cannot restore a {kind!r} cache")
    for a, b in zip(chain, chain[1:]):
        if a.end != b.start:
            raise SnapshotRangeError(f"snapshots are not consecutive: [{a.start}, {a.end}) then [{b.start}, {b.end})")
    return chain


def check_consecutive(parent: Snapshot, child: Snapshot) -> None:
    if parent.kind != child.kind:
        raise SnapshotKindError(f"cannot merge a {parent.kind!r} snapshot with a {child.kind!r} one")
    if parent.end != child.start:
        raise SnapshotRangeError(
            f"cannot merge [{parent.start}, {parent.end}) with [{child.start}, {child.end}): not consecutive"
        )
    if _layout_of(parent) != _layout_of(child) and not parent.whole:
        raise SnapshotKindError(f"cannot merge snapshots of different layouts: {parent.scalars} and {child.scalars}")


def _layout_of(snapshot: Snapshot) -> dict:
    # data_start and head say which positions a snapshot holds, not its layout.
    return {k: v for k, v in snapshot.scalars.items() if k not in ("data_start", "head")}
