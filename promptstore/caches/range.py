"""Range kinds: caches whose state is a run of per-position arrays on axis 2.

Full attention (KV), quantized KV, chunked KV and batch KV all keep one entry
per token position, so a snapshot is a slice of positions, merging is a
concatenation, and splitting is two slices. A kind may keep only the newest
positions (chunked attention drops whole chunks it no longer attends to); its
snapshots then record `data_start`, the first position they hold data for.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import mlx.core as mx

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
from .snapshot import Snapshot, own

AXIS = 2


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple, dtype) -> mx.array:
    """Headroom filler, made once per shape: a restore that joins arrays concatenates a copy of it."""
    z = mx.zeros(shape, dtype=dtype)
    mx.eval(z)
    return z


def _joined(parts: list[mx.array]) -> mx.array:
    """The live buffer made of `parts`, oldest first.

    One stored array is handed over as it is: a new array object over the
    same memory (no copy). It has no room for the next token, as the caches
    mlx-lm's own load_prompt_cache makes: the cache's first write grows it by
    a copy, which a single stream makes once (a restore that copied up front
    copied again when the new tokens passed its headroom) and a server's batch
    never makes (merging copies every cache). A write into its positions
    after a trim replaces the cache's array object only, so nothing a cache
    does reaches the snapshot; MLX copies a buffer another array still uses.

    Several are joined by one concatenation, whose last part is the headroom.
    """
    if len(parts) == 1:
        return parts[0][...]
    return mx.concatenate(parts, axis=AXIS)


def data_start(snapshot: Snapshot) -> int:
    return int(snapshot.scalars.get("data_start", snapshot.start))


class RangeKind(SnapshotProtocol):
    """Generic snapshot protocol over named token arrays `[B, H, positions, D]`.

    A kind says which live buffers it has, how to install new ones, and which
    first position a restored cache must hold for a target (0 for full
    attention: everything).
    """

    whole_state: ClassVar[bool] = False
    trims_front: ClassVar[bool] = False  # data may start after the span's start
    token_axis: ClassVar[int | None] = AXIS

    # --- hooks ---------------------------------------------------------------

    def live_buffers(self) -> dict[str, mx.array] | None:
        """Token arrays by name, full capacity; None while the cache is empty."""
        raise NotImplementedError

    def live_data_start(self) -> int:
        """First position the live buffers hold (index 0 of axis 2)."""
        return 0

    def plan_install(self, buffers: dict[str, mx.array], lo: int, target: int, last: Snapshot | None) -> dict:
        """Attributes for buffers holding positions [lo, target), maybe with room after them."""
        raise NotImplementedError

    def install_from(self, target: int) -> int:
        """First position a cache at `target` must hold."""
        return 0

    def cursors(self) -> dict[str, mx.array]:
        """Per-snapshot arrays that describe the end state, not positions."""
        return {}

    @classmethod
    def cursors_at(cls, snapshot: Snapshot, at: int) -> dict[str, mx.array]:
        """The cursor arrays of `snapshot` moved back to position `at`."""
        return {}

    @classmethod
    def token_names(cls, snapshot: Snapshot) -> list[str]:
        return [n for n in snapshot.arrays if n not in cls.cursor_names]

    cursor_names: ClassVar[tuple[str, ...]] = ()

    def _state_arrays(self) -> dict:
        return self.live_buffers() or {}

    expected_names: ClassVar[tuple[str, ...]] = ("keys", "values")

    # --- protocol --------------------------------------------------------------

    def snapshot(self, from_offset: int = 0) -> Snapshot:
        pos = self.position
        lo = as_position(from_offset, "from_offset")
        if lo > pos:
            raise SnapshotRangeError(f"from_offset {lo} is past the cache's position {pos}")
        live = self.live_buffers()
        ds = max(lo, self.live_data_start())
        arrays: dict[str, mx.array] = {}
        if live is not None and pos > lo:
            base = self.live_data_start()
            arrays = {n: own(b[..., ds - base : pos - base, :]) for n, b in live.items()}
        arrays.update({n: own(c) for n, c in self.cursors().items()})
        scalars = dict(self.layout())
        if self.trims_front:
            scalars["data_start"] = ds if arrays else pos
        return Snapshot(self.kind, lo, pos, False, arrays, scalars)

    def plan_restore(self, snapshot: SnapshotChain | None, target: int):
        target = as_position(target, "target")
        if snapshot is None:
            return rewind_plan(self, target)
        chain = as_chain(snapshot, self.kind)
        for s in chain:
            check_snapshot_layout(self, s)
            type(self).validate_snapshot(s)
        start, end = chain[0].start, chain[-1].end
        if target > end:
            raise SnapshotRangeError(f"target {target} is past the snapshots' end {end}")
        if start > self.position:
            return None  # the chain builds on positions this cache lacks
        if target <= start:
            return self._plan_rewind(target)
        self._check_against_live(chain)
        lo = self.install_from(target)
        pieces = self._gather(chain, lo, target)
        if pieces is None:
            return None
        return self.plan_install({n: _joined(p) for n, p in pieces.items()}, lo, target, chain[-1])

    def _segments(self, chain: list[Snapshot]):
        """(first, last, arrays) runs of positions available, oldest first."""
        segs = []
        start = chain[0].start
        live = self.live_buffers()
        if start > 0 and live is not None:
            base = self.live_data_start()
            if base < start:
                segs.append((base, start, {n: b[..., : start - base, :] for n, b in live.items()}))
        for s in chain:
            names = self.token_names(s)
            if s.length and names:
                segs.append((data_start(s), s.end, {n: s.arrays[n] for n in names}))
        return segs

    def _gather(self, chain, lo, target):
        """Slices covering positions [lo, target) continuously, or None."""
        pieces: dict[str, list] = {}
        covered = target
        for first, last, arrays in reversed(self._segments(chain)):
            if first >= covered:
                continue
            if last < covered:
                return None  # a gap
            take_lo = max(first, lo)
            whole = take_lo == first and covered - first == next(iter(arrays.values())).shape[AXIS]
            for n, a in arrays.items():
                pieces.setdefault(n, []).insert(0, a if whole else a[..., take_lo - first : covered - first, :])
            covered = take_lo
            if covered <= lo:
                break
        if covered > lo or not pieces:
            return None
        self._check_compatible(pieces)
        if len(next(iter(pieces.values()))) > 1:
            room = headroom(target)
            for parts in pieces.values():
                t = parts[-1]
                parts.append(_zeros((*t.shape[:2], room, t.shape[3]), t.dtype))
        return pieces

    def _check_against_live(self, chain: list[Snapshot]) -> None:
        """A snapshot for another layer shape than the live buffers is refused
        even when it would replace them all."""
        live = self.live_buffers()
        if live is None:
            return
        pieces = {n: [b] for n, b in live.items()}
        for s in chain:
            for n in self.token_names(s):
                if n in pieces:
                    pieces[n].append(s.arrays[n])
        self._check_compatible(pieces)

    def _check_compatible(self, pieces: dict[str, list]) -> None:
        for n, parts in pieces.items():
            ref = parts[0]
            for p in parts[1:]:
                if p.dtype != ref.dtype or p.shape[:2] != ref.shape[:2] or p.shape[3] != ref.shape[3]:
                    raise CacheShapeError(
                        f"{n!r}: cannot join arrays of shape {tuple(ref.shape)} {ref.dtype} "
                        f"and {tuple(p.shape)} {p.dtype} (batch, heads, head dim and dtype must match)"
                    )

    @classmethod
    def merge_chain(cls, chain) -> Snapshot:
        """One concatenation for the whole chain (a fold would copy O(n^2) bytes)."""
        chain = as_chain(chain, cls.kind)
        for s in chain:
            cls.validate_snapshot(s)
        for a, b in zip(chain, chain[1:]):
            check_consecutive(a, b)
        # Data is continuous from the last snapshot that starts without its front.
        first = max((i for i, s in enumerate(chain) if data_start(s) > s.start), default=0)
        parts = [s for s in chain[first:] if s.length and cls.token_names(s)]
        last = chain[-1]
        if not parts:
            return Snapshot(cls.kind, chain[0].start, last.end, False, dict(last.arrays), dict(last.scalars))
        arrays = {
            n: mx.concatenate([s.arrays[n] for s in parts], axis=AXIS) if len(parts) > 1 else parts[0].arrays[n]
            for n in cls.token_names(parts[0])
        }
        arrays.update({n: last.arrays[n] for n in cls.cursor_names if n in last.arrays})
        scalars = dict(last.scalars)
        if cls.trims_front:
            scalars["data_start"] = data_start(chain[first])
        return Snapshot(cls.kind, chain[0].start, last.end, False, arrays, scalars)

    @classmethod
    def split_snapshot(cls, snapshot: Snapshot, at: int):
        at = as_position(at, "split position")
        cls.validate_snapshot(snapshot)
        if at <= snapshot.start:
            return None, snapshot
        if at >= snapshot.end:
            return snapshot, None
        ds = data_start(snapshot)
        k = max(at - ds, 0)
        names = cls.token_names(snapshot)
        upper = {n: own(snapshot.arrays[n][..., :k, :]) for n in names} if k else {}
        lower = {n: own(snapshot.arrays[n][..., k:, :]) for n in names}
        upper.update(cls.cursors_at(snapshot, at))
        lower.update({n: snapshot.arrays[n] for n in cls.cursor_names if n in snapshot.arrays})
        us, ls = dict(snapshot.scalars), dict(snapshot.scalars)
        if cls.trims_front:
            us["data_start"] = ds if k else at
            ls["data_start"] = max(at, ds)
        return (
            Snapshot(cls.kind, snapshot.start, at, False, upper, us),
            Snapshot(cls.kind, at, snapshot.end, False, lower, ls),
        )

    @classmethod
    def validate_snapshot(cls, snapshot: Snapshot) -> None:
        if snapshot.whole or snapshot.children:
            raise SnapshotFormatError(f"a {cls.kind!r} snapshot is a plain range snapshot")
        if not 0 <= snapshot.start <= snapshot.end:
            raise SnapshotRangeError(f"bad span [{snapshot.start}, {snapshot.end})")
        names = cls.token_names(snapshot)
        ds = data_start(snapshot)
        if not snapshot.start <= ds <= snapshot.end:
            raise SnapshotRangeError(f"data_start {ds} outside [{snapshot.start}, {snapshot.end})")
        if not names:
            if snapshot.end > ds:
                raise SnapshotFormatError(f"a {cls.kind!r} snapshot over [{ds}, {snapshot.end}) holds no arrays")
            return
        if sorted(names) != sorted(cls.expected_names):
            raise SnapshotFormatError(
                f"a {cls.kind!r} snapshot holds {sorted(names)}, expected {sorted(cls.expected_names)}"
            )
        ref = snapshot.arrays[names[0]]
        for n in names:
            a = snapshot.arrays[n]
            if a.ndim != 4:
                raise CacheShapeError(f"{n!r} has rank {a.ndim}, expected 4 [B, H, L, D]")
            if a.shape[:2] != ref.shape[:2]:
                raise CacheShapeError(
                    f"{n!r} has batch and heads {tuple(a.shape[:2])}, {names[0]!r} has {tuple(ref.shape[:2])}"
                )
            if a.shape[AXIS] != snapshot.end - ds:
                raise CacheShapeError(f"{n!r} holds {a.shape[AXIS]} positions, the span needs {snapshot.end - ds}")
        cls.validate_extra(snapshot)

    @classmethod
    def validate_extra(cls, snapshot: Snapshot) -> None:
        """Kind-specific checks on a snapshot whose token arrays are well formed."""
