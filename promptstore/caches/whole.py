"""Whole-state kinds: sliding-window and recurrent caches.

Their state at a position cannot be cut out of a later state (a window has
dropped old tokens, a recurrence has folded them in), so a snapshot is the
whole state at its end, a merge keeps the child, and a split is impossible,
except for a window that has not yet dropped anything.
"""

from __future__ import annotations

from typing import ClassVar

from ..errors import SnapshotRangeError
from .base import (
    SnapshotChain,
    SnapshotProtocol,
    as_chain,
    as_position,
    check_consecutive,
    check_snapshot_layout,
    rewind_plan,
)
from .snapshot import Snapshot


class WholeStateKind(SnapshotProtocol):
    """Shared protocol for kinds whose snapshot is the whole state at `end`."""

    whole_state: ClassVar[bool] = True
    role: ClassVar[str] = "state"

    @classmethod
    def _reachable(cls, snapshot: Snapshot, target: int) -> bool:
        """Whether `snapshot`'s state, cut to `target`, is the state there."""
        return target == snapshot.end

    def plan_whole(self, snapshot: Snapshot, target: int) -> dict | None:
        """Attributes that install `snapshot`'s state cut to `target`, or None."""
        raise NotImplementedError

    def _plan_rewind(self, target: int) -> dict | None:
        return {} if target == self.position else None

    def plan_restore(self, snapshot: SnapshotChain | None, target: int):
        target = as_position(target, "target")
        if snapshot is None:
            return rewind_plan(self, target)
        chain = as_chain(snapshot, self.kind)
        last = chain[-1]
        check_snapshot_layout(self, last)
        type(self).validate_snapshot(last)
        if target > last.end:
            raise SnapshotRangeError(f"target {target} is past the snapshot's end {last.end}")
        if type(self)._reachable(last, target):
            return self.plan_whole(last, target)
        if target <= self.position:
            return self._plan_rewind(target)
        return None

    @classmethod
    def merge_chain(cls, chain) -> Snapshot:
        chain = as_chain(chain, cls.kind)
        for a, b in zip(chain, chain[1:]):
            check_consecutive(a, b)
        last = chain[-1]
        cls.validate_snapshot(last)
        if len(chain) == 1:
            return last
        return Snapshot(cls.kind, chain[0].start, last.end, True, last.arrays, last.scalars, last.children)

    @classmethod
    def split_inside(cls, snapshot: Snapshot, at: int):
        return None, snapshot  # a state at its end: nothing to cut


def _window_length(snapshot: Snapshot) -> int:
    keys = snapshot.arrays.get("keys")
    return 0 if keys is None else keys.shape[2]
