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

from collections.abc import Sequence
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

# Where positions [lo, hi) of a snapshot or live buffer lie: (lo, hi, keys, values, index of lo).
Source = tuple[int, int, mx.array, mx.array, int]


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


def needed(target: int, max_size: int, keep: int) -> list[tuple[int, int]]:
    """The positions a window at `target` holds, as [lo, hi) runs."""
    if target <= max_size:
        return [(0, target)] if target else []
    tail = (target - (max_size - keep), target)
    return [(0, keep), tail] if keep else [tail]


def sources(snapshot: Snapshot) -> list[Source]:
    """The positions a rotating snapshot holds, and where they are in its arrays."""
    keys, values = snapshot.arrays.get("keys"), snapshot.arrays.get("values")
    n = 0 if keys is None else keys.shape[2]
    if not n:
        return []
    end = snapshot.end
    if snapshot.whole:  # the first format: the window at `end`, in temporal order
        keep = snapshot.scalars["keep"]
        if n == end:
            return [(0, end, keys, values, 0)]
        head = [(0, keep, keys, values, 0)] if keep else []
        return head + [(end - (n - keep), end, keys, values, keep)]
    h, ds = snapshot.scalars["head"], snapshot.scalars["data_start"]
    out = [(snapshot.start, snapshot.start + h, keys, values, 0)] if h else []
    return out + ([(ds, end, keys, values, h)] if end > ds else [])


def take(srcs: Sequence[Source], lo: int, hi: int) -> list[tuple[mx.array, mx.array]] | None:
    """Slices covering positions [lo, hi) in order, each from the first source
    that holds it; None when a position is in none."""
    pieces, p = [], lo
    while p < hi:
        for s_lo, s_hi, k, v, i0 in srcs:
            if s_lo <= p < s_hi:
                q = min(hi, s_hi)
                a, b = i0 + p - s_lo, i0 + q - s_lo
                whole = a == 0 and b == k.shape[2]
                pieces.append((k, v) if whole else (k[..., a:b, :], v[..., a:b, :]))
                p = q
                break
        else:
            return None
    return pieces


def _runs(srcs: Sequence[Source], start: int, end: int) -> list[list[int]]:
    """The positions in [start, end) some source holds, as sorted disjoint runs."""
    spans = sorted((max(lo, start), min(hi, end)) for lo, hi, *_ in srcs if min(hi, end) > max(lo, start))
    runs: list[list[int]] = []
    for lo, hi in spans:
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    return runs


def build(layout: dict, start: int, end: int, srcs: Sequence[Source]) -> Snapshot:
    """A snapshot over [start, end) of what `srcs` hold there that a window can
    use: the run ending at `end`, and keep positions from `start` (the head)."""
    runs = _runs(srcs, start, end)
    ds = runs[-1][0] if runs and runs[-1][1] == end else end
    h = 0
    if runs and runs[0][0] == start and start < layout["keep"]:
        h = min(runs[0][1], layout["keep"], ds) - start
    if start + h == ds:
        h, ds = 0, start
    pieces = (take(srcs, start, start + h) or []) + (take(srcs, ds, end) or [])
    arrays = {}
    if pieces:
        keys = [k for k, _ in pieces]
        values = [v for _, v in pieces]
        arrays = {
            "keys": own(mx.concatenate(keys, axis=2) if len(keys) > 1 else keys[0]),
            "values": own(mx.concatenate(values, axis=2) if len(values) > 1 else values[0]),
        }
    return Snapshot("rotating", start, end, False, arrays, {**layout, "data_start": ds, "head": h})


def clip(srcs: Sequence[Source], lo: int, hi: int) -> list[Source]:
    """The sources' positions in [lo, hi) only."""
    out = []
    for s_lo, s_hi, k, v, i0 in srcs:
        a, b = max(s_lo, lo), min(s_hi, hi)
        if b > a:
            out.append((a, b, k, v, i0 + a - s_lo))
    return out


def window_tail(snapshot: Snapshot) -> Snapshot:
    """The snapshot cut to what a window at its end or later can use: its keep
    positions and its last `max_size - keep` (what compact keeps of a joined node)."""
    if snapshot.whole:
        return snapshot
    layout = {k: snapshot.scalars[k] for k in ("max_size", "keep")}
    srcs = sources(snapshot)
    first = snapshot.end - (layout["max_size"] - layout["keep"])
    kept = clip(srcs, 0, layout["keep"]) + clip(srcs, max(first, layout["keep"]), snapshot.end)
    return build(layout, snapshot.start, snapshot.end, kept)


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
    def split_snapshot(cls, snapshot: Snapshot, at: int):
        at = as_position(at, "split position")
        cls.validate_snapshot(snapshot)
        if at >= snapshot.end:
            return snapshot, None
        if at <= snapshot.start:
            return None, snapshot
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
