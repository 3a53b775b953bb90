"""Cache lists: several caches behind one layer (hybrid blocks such as Falcon-H1).

A cache list's snapshot holds one child snapshot per sub-cache; every
operation is applied to all children or to none. A whole-state child may be
None: a snapshot cut where the recurrent sub-cache has no state still carries
the attention sub-cache's range, so later nodes' ranges stay reachable; such a
snapshot is not `complete` and restores only as part of a chain whose last
snapshot is.
"""

from __future__ import annotations

from typing import ClassVar

from mlx_lm.models import cache as mlx_cache

from ..errors import SnapshotFormatError, SnapshotKindError, SnapshotRangeError
from . import window
from .base import SnapshotChain, SnapshotProtocol, as_chain, as_position, check_consecutive, check_snapshot_layout
from .registry import adopt, from_mlx_lm_state, kind_class, register
from .snapshot import Snapshot


def _child_chain(chain: list[Snapshot], i: int, role: str) -> list[Snapshot] | None:
    """Child i's chain: every range piece, a state child's last state, a window
    child's pieces after the last absent one; None where nothing restores."""
    children = [s.children[i] for s in chain]
    if role == "state":
        return None if children[-1] is None else children[-1:]
    if role == "window":
        # A list of the first format may lack its window child (a split cut it).
        cut = max((j for j, c in enumerate(children) if c is None), default=-1)
        return children[cut + 1 :] or None
    return children


def _merged_child(chain: list[Snapshot], i: int, kind: str) -> Snapshot | None:
    cls = kind_class(kind)
    start = chain[0].start
    if cls.role == "state":
        return _respan(chain[-1].children[i], start)
    pieces = _child_chain(chain, i, cls.role)
    if pieces is None:
        return None
    merged = cls.merge_chain(pieces)
    if merged.start > start:  # a window child whose older pieces are absent
        layout = {k: merged.scalars[k] for k in ("max_size", "keep")}
        merged = window.build(layout, start, merged.end, window.sources(merged))
    return merged


def _respan(child: Snapshot | None, start: int) -> Snapshot | None:
    """A whole-state child's state, as the child of a list spanning from `start`."""
    if child is None:
        return None
    return Snapshot(child.kind, start, child.end, True, child.arrays, dict(child.scalars), child.children)


@register
class CacheList(SnapshotProtocol, mlx_cache.CacheList):
    """mlx-lm's cache list whose children are promptstore caches."""

    kind: ClassVar[str] = "cache_list"

    def __init__(self, *caches):
        super().__init__(*(adopt(c) for c in caches))

    @property
    def position(self) -> int:
        return max(c.position for c in self.caches)

    @property
    def whole(self) -> bool:
        return any(c.whole_state for c in self.caches)

    @property
    def role(self) -> str:
        """A list restores where every cache in it can (see SnapshotProtocol.role)."""
        roles = {c.role for c in self.caches}
        return next(r for r in ("state", "window", "range") if r in roles)

    def layout(self) -> dict:
        return {"kinds": [c.kind for c in self.caches]}

    def signature(self) -> tuple:
        return tuple(c.signature() for c in self.caches)

    @property
    def state(self):
        return [(c.state, type(c).__name__) for c in self.caches]

    @state.setter
    def state(self, v):
        self.caches = [from_mlx_lm_state(name, s) for s, name in v]

    def snapshot(self, from_offset: int = 0) -> Snapshot:
        lo = as_position(from_offset, "from_offset")
        pos = self.position
        if lo > pos:
            raise SnapshotRangeError(f"from_offset {lo} is past the cache's position {pos}")
        children = tuple(c.snapshot(lo) for c in self.caches)
        return Snapshot(self.kind, lo, pos, self.whole, {}, self.layout(), children)

    def plan_restore(self, snapshot: SnapshotChain | None, target: int):
        target = as_position(target, "target")
        if snapshot is None:
            chains = [None] * len(self.caches)
        else:
            chain = as_chain(snapshot, self.kind)
            for s in chain:
                check_snapshot_layout(self, s)
                type(self).validate_snapshot(s)
            chains = [_child_chain(chain, i, c.role) for i, c in enumerate(self.caches)]
            if any(sub is None for sub in chains):
                return None  # a recurrent sub-cache has no state at the chain's end
        plans = []
        for cache, sub in zip(self.caches, chains):
            plan = cache.plan_restore(sub, target)
            if plan is None:
                return None
            plans.append(plan)
        return {"children": plans}

    def apply_restore(self, plan: dict) -> None:
        for cache, sub in zip(self.caches, plan["children"]):
            cache.apply_restore(sub)

    @classmethod
    def merge_chain(cls, chain) -> Snapshot:
        chain = as_chain(chain, cls.kind)
        for a, b in zip(chain, chain[1:]):
            check_consecutive(a, b)
            if a.scalars != b.scalars:
                raise SnapshotKindError(f"cannot merge cache lists {a.scalars} and {b.scalars}")
        for s in chain:
            cls.validate_snapshot(s)
        last = chain[-1]
        children = tuple(_merged_child(chain, i, kind) for i, kind in enumerate(chain[0].scalars["kinds"]))
        return Snapshot(cls.kind, chain[0].start, last.end, last.whole, {}, dict(last.scalars), children)

    @classmethod
    def split_inside(cls, snapshot: Snapshot, at: int):
        halves = [(None, None) if c is None else kind_class(c.kind).split_snapshot(c, at) for c in snapshot.children]
        if any(
            c is not None and (upper is None or lower is None) for c, (upper, lower) in zip(snapshot.children, halves)
        ):
            return None, snapshot  # a child cannot split here, so neither can the list
        uppers, lowers = zip(*halves)
        scalars = dict(snapshot.scalars)
        return (
            Snapshot(cls.kind, snapshot.start, at, snapshot.whole, {}, scalars, tuple(uppers)),
            Snapshot(cls.kind, at, snapshot.end, snapshot.whole, {}, dict(scalars), tuple(lowers)),
        )

    @classmethod
    def validate_snapshot(cls, snapshot: Snapshot) -> None:
        kinds = snapshot.scalars.get("kinds")
        if snapshot.arrays or not isinstance(kinds, list) or len(kinds) != len(snapshot.children):
            raise SnapshotFormatError(
                f"a cache-list snapshot needs one child per kind, got kinds={kinds!r} "
                f"and {len(snapshot.children)} children"
            )
        for kind, child in zip(kinds, snapshot.children):
            if child is None and kind_class(kind).role != "range":
                continue  # no state at `end` for this recurrent sub-cache (or a first-format window)
            if child is None:
                raise SnapshotFormatError(f"a cache-list snapshot lacks its {kind!r} range child")
            if child.kind != kind or (child.start, child.end) != (snapshot.start, snapshot.end):
                raise SnapshotFormatError(
                    f"child {child!r} does not match kind {kind!r} over [{snapshot.start}, {snapshot.end})"
                )
            kind_class(kind).validate_snapshot(child)

    def extract(self, idx):
        return CacheList(*(c.extract(idx) for c in self.caches))
