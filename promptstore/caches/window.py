"""Window snapshots as ranges: which positions a sliding-window snapshot holds, and
building one from whatever holds positions (snapshots, a live window).

A window at position t is the `keep` first positions and the last
`max_size - keep` before t. A snapshot over [start, end) holds a head (keep
positions from `start`) and a run ending at `end` (from `data_start`); a
snapshot of the first format holds the whole window at `end`, positions before
its start included. Used by the rotating kind, cache lists and node operations.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .snapshot import Snapshot, own

# Where positions [lo, hi) of a snapshot or live buffer lie: (lo, hi, keys, values, index of lo).
Source = tuple[int, int, mx.array, mx.array, int]


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
