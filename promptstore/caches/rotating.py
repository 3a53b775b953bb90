"""Sliding-window attention (mlx-lm's rotating KV cache), with range snapshots.

The window at position t is the keys and values of the `keep` first positions
and of the last `max_size - keep` before t: all that the next step attends to,
and all a cache built by a full prefill keeps there. A snapshot, like full
attention's, holds positions of its span: those the live window still has, as
its `head` (keep positions at the span's start) and a run ending at the span's
end (from `data_start`). A restore gathers the window at its target from a
chain of them, so a window restores anywhere its positions are stored.
Snapshots of the first format (the whole window at `end`, `whole`) are read as
the positions they hold.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..errors import CacheShapeError, SnapshotFormatError, SnapshotRangeError
from .base import (
    SnapshotChain,
    SnapshotProtocol,
    as_chain,
    as_position,
    check_consecutive,
    check_snapshot_layout,
    headroom,
    rewind_plan,
)
from .registry import kind_class, register
from .snapshot import Snapshot, own
from .window import Source, build, clip, needed, sources, take


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
class RotatingKVCache(SnapshotProtocol, mlx_cache.RotatingKVCache):
    """mlx-lm's sliding-window cache (with `keep` sink tokens), with range snapshots."""

    kind: ClassVar[str] = "rotating"
    role: ClassVar[str] = "window"
    token_axis: ClassVar[int | None] = 2

    def layout(self) -> dict:
        return {"max_size": int(self.max_size), "keep": int(self.keep)}

    def _state_arrays(self) -> dict:
        return {} if self.keys is None else {"keys": self.keys, "values": self.values}

    def _live(self) -> list[Source]:
        """The positions the live buffers hold."""
        if self.keys is None or self.offset == 0:
            return []
        k, v = self._temporal_order(self.keys), self._temporal_order(self.values)
        n, end, keep = k.shape[2], self.offset, self.keep
        if n >= end:
            return [(0, end, k, v, 0)]  # nothing dropped yet
        head = [(0, keep, k, v, 0)] if keep else []
        return head + [(end - (n - keep), end, k, v, keep)]

    def snapshot(self, from_offset: int = 0) -> Snapshot:
        lo = as_position(from_offset, "from_offset")
        if lo > self.offset:
            raise SnapshotRangeError(f"from_offset {lo} is past the cache's position {self.offset}")
        return build(self.layout(), lo, self.offset, self._live())

    def plan_restore(self, snapshot: SnapshotChain | None, target: int):
        target = as_position(target, "target")
        if snapshot is None:
            return rewind_plan(self, target)
        chain = as_chain(snapshot, self.kind)
        for s in chain:
            check_snapshot_layout(self, s)
            type(self).validate_snapshot(s)
            check_live(self.keys, s)
        if target > chain[-1].end:
            raise SnapshotRangeError(f"target {target} is past the snapshots' end {chain[-1].end}")
        srcs = [src for s in reversed(chain) for src in sources(s)]
        first = chain[0].start
        if first <= self.position:  # the chain continues this cache: its older positions count
            srcs += clip(self._live(), 0, first)
        pieces = []
        for lo, hi in needed(target, self.max_size, self.keep):
            got = take(srcs, lo, hi)
            if got is None:
                return None  # a position the window needs is stored nowhere
            pieces += got
        if not pieces:
            return {"keys": None, "values": None, "offset": 0, "_idx": 0}
        _check_pieces(pieces)
        n = sum(k.shape[2] for k, _ in pieces)
        room = window_room(n, self.max_size)
        plan = {"offset": target, "_idx": n}
        for name, i in (("keys", 0), ("values", 1)):
            parts = [p[i] for p in pieces]
            if room:
                parts.append(mx.zeros((*parts[0].shape[:2], room, parts[0].shape[3]), dtype=parts[0].dtype))
            plan[name] = mx.concatenate(parts, axis=2) if len(parts) > 1 else own(parts[0])
        return plan

    def _plan_rewind(self, target: int):
        if target == self.offset:
            return {}
        if self.keys is not None and self._idx == self.offset:
            return {"offset": target, "_idx": target}  # buffer index == position
        return None

    @classmethod
    def merge_chain(cls, chain) -> Snapshot:
        chain = as_chain(chain, cls.kind)
        for s in chain:
            cls.validate_snapshot(s)
        for a, b in zip(chain, chain[1:]):
            check_consecutive(a, b)
        if len(chain) == 1:
            return chain[0]
        layout = {k: chain[-1].scalars[k] for k in ("max_size", "keep")}
        return build(layout, chain[0].start, chain[-1].end, [src for s in reversed(chain) for src in sources(s)])

    @classmethod
    def split_inside(cls, snapshot: Snapshot, at: int):
        layout = {k: snapshot.scalars[k] for k in ("max_size", "keep")}
        srcs = sources(snapshot)
        return build(layout, snapshot.start, at, srcs), build(layout, at, snapshot.end, srcs)

    @classmethod
    def validate_snapshot(cls, snapshot: Snapshot) -> None:
        if snapshot.children:
            raise SnapshotFormatError("a rotating snapshot has no children")
        max_size, keep = snapshot.scalars.get("max_size"), snapshot.scalars.get("keep")
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size <= 0:
            raise SnapshotFormatError(f"bad window size {max_size!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or not 0 <= keep < max_size:
            raise SnapshotFormatError(f"bad keep {keep!r} for a window of {max_size}")
        if snapshot.whole:
            _validate_first_format(snapshot, max_size)
        else:
            _validate_range(snapshot, keep)

    @classmethod
    def merge(cls, caches):
        return kind_class("batch_rotating").merge(caches)


def _validate_first_format(snapshot: Snapshot, max_size: int) -> None:
    check_window(snapshot, max_size)
    if snapshot.arrays:
        length = snapshot.arrays["keys"].shape[2]
        if not (length == snapshot.end or max_size <= length < snapshot.end):
            raise CacheShapeError(
                f"a window of {length} positions cannot be the state at {snapshot.end} with max_size {max_size}"
            )


def _validate_range(snapshot: Snapshot, keep: int) -> None:
    h, ds = snapshot.scalars.get("head"), snapshot.scalars.get("data_start")
    for name, value in (("head", h), ("data_start", ds)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise SnapshotFormatError(f"bad {name} {value!r} in a rotating snapshot")
    if not (0 <= h and snapshot.start + h <= ds <= snapshot.end):
        raise SnapshotRangeError(f"head {h} and data_start {ds} do not fit [{snapshot.start}, {snapshot.end})")
    if h and snapshot.start + h > keep:
        raise SnapshotFormatError(f"a head of {h} positions from {snapshot.start} is past keep {keep}")
    n = h + snapshot.end - ds
    if not n:
        if snapshot.arrays:
            raise SnapshotFormatError("a rotating snapshot holding no positions has arrays")
        return
    keys, values = snapshot.arrays.get("keys"), snapshot.arrays.get("values")
    if keys is None or values is None or set(snapshot.arrays) != {"keys", "values"}:
        raise SnapshotFormatError(f"a rotating snapshot holds {sorted(snapshot.arrays)}, expected keys and values")
    if keys.ndim != 4 or values.ndim != 4:
        raise CacheShapeError(f"keys/values must be rank 4, got {keys.ndim} and {values.ndim}")
    if keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype:
        raise CacheShapeError(
            f"keys {tuple(keys.shape)} {keys.dtype} do not match values {tuple(values.shape)} {values.dtype}"
        )
    if keys.shape[2] != n:
        raise CacheShapeError(f"keys hold {keys.shape[2]} positions, the snapshot {n}")


def _check_pieces(pieces) -> None:
    ref = pieces[0][0]
    for k, v in pieces:
        for a in (k, v):
            if a.dtype != ref.dtype or a.shape[:2] != ref.shape[:2] or a.ndim != 4:
                raise CacheShapeError(
                    f"cannot join window pieces of shape {tuple(ref.shape)} {ref.dtype} and {tuple(a.shape)} {a.dtype}"
                )
