"""Whole-state kinds: sliding-window and recurrent caches.

Their state at a position cannot be cut out of a later state (a window has
dropped old tokens, a recurrence has folded them in), so a snapshot is the
whole state at its end, a merge keeps the child, and a split is impossible,
except for a window that has not yet dropped anything.
"""

from __future__ import annotations

from typing import ClassVar

from ..errors import SnapshotRangeError
from .base import SnapshotChain, SnapshotProtocol, as_chain, as_position, check_consecutive
from .snapshot import Snapshot


class WholeStateKind(SnapshotProtocol):
    """Shared protocol for kinds whose snapshot is the whole state at `end`."""

    whole_state: ClassVar[bool] = True
    can_split: ClassVar[bool] = False

    def plan_whole(self, snapshot: Snapshot, target: int) -> dict | None:
        """Attributes that install `snapshot`'s state cut to `target`, or None."""
        raise NotImplementedError

    def plan_rewind(self, target: int) -> dict | None:
        return {} if target == self.position else None

    def plan_restore(self, snapshot: SnapshotChain | None, target: int):
        target = as_position(target, "target")
        if snapshot is None:
            return self.checked_rewind(target)
        chain = as_chain(snapshot, self.kind)
        last = chain[-1]
        self.check_snapshot_layout(last)
        type(self).validate_snapshot(last)
        if target > last.end:
            raise SnapshotRangeError(f"target {target} is past the snapshot's end {last.end}")
        if type(self).reachable(last, target):
            return self.plan_whole(last, target)
        if target <= self.position:
            return self.plan_rewind(target)
        return None

    @classmethod
    def merge_snapshots(cls, parent: Snapshot | None, child: Snapshot | None):
        if parent is None or child is None:
            return child if parent is None else parent
        check_consecutive(parent, child)
        cls.validate_snapshot(child)
        return Snapshot(cls.kind, parent.start, child.end, True, child.arrays, child.scalars, child.children)

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
    def split_snapshot(cls, snapshot: Snapshot, at: int):
        at = as_position(at, "split position")
        cls.validate_snapshot(snapshot)
        return (snapshot, None) if at >= snapshot.end else (None, snapshot)


def _window_length(snapshot: Snapshot) -> int:
    keys = snapshot.arrays.get("keys")
    return 0 if keys is None else keys.shape[2]
