"""Node-level snapshot operations: what one trie node holds, one snapshot per layer.

A node holds, per layer, a snapshot spanning its edge (None where it holds
nothing for that layer). Splitting a node where an edge is cut, joining a node
with its only child, and building the chains a restore reads are one function
each here, so the store never needs to know what kind a layer is.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import window
from .registry import kind_class
from .snapshot import Snapshot

NodeSnapshots = Sequence[Snapshot | None]


def respan(snapshot: Snapshot, start: int) -> Snapshot:
    """A whole-state snapshot's state, as spanning [start, its end)."""
    s = snapshot
    return Snapshot(s.kind, start, s.end, s.whole, s.arrays, dict(s.scalars), s.children)


def split_for_edge(snapshot: Snapshot | None, at: int) -> tuple[Snapshot | None, Snapshot | None]:
    """Split one layer's snapshot of a stored node where an edge is cut.

    Range layers split; a whole-state layer has no state at `at` (the upper
    node waits for a checkpoint) and keeps its state at the end, now spanning
    [at, end). A cache list splits each child the same way: its upper part
    keeps the range children's [start, at) with None for the whole-state ones
    (not `complete`: the node's record marks the layer as waiting for a
    checkpoint), so no position of a range child is ever dropped.
    """
    if snapshot is None:
        return None, None
    upper, lower = kind_class(snapshot.kind).split_snapshot(snapshot, at)
    if upper is not None or lower is None or lower.start == at:
        return upper, lower
    if snapshot.children:
        halves = [split_for_edge(c, at) for c in snapshot.children]
        s = snapshot
        return (
            Snapshot(s.kind, s.start, at, s.whole, {}, dict(s.scalars), tuple(u for u, _ in halves)),
            Snapshot(s.kind, at, s.end, s.whole, {}, dict(s.scalars), tuple(lo for _, lo in halves)),
        )
    return None, respan(snapshot, at)


def split_node(snapshots: NodeSnapshots, at: int) -> tuple[list, list]:
    """A node's snapshots cut at `at`: (the upper node's, the lower node's), per layer."""
    halves = [split_for_edge(s, at) for s in snapshots]
    return [u for u, _ in halves], [lo for _, lo in halves]


def cut_node(snapshots: NodeSnapshots, points: Sequence[int]) -> list[list]:
    """A node's snapshots cut at every one of `points` (increasing, inside its span):
    one list of per-layer snapshots per piece, in order. Halves are cut first, so
    each byte is copied about log2(pieces) times, not once per piece after it."""
    if not points:
        return [list(snapshots)]
    mid = len(points) // 2
    upper, lower = split_node(snapshots, points[mid])
    return cut_node(upper, points[:mid]) + cut_node(lower, points[mid + 1 :])


def role_of(snapshot: Snapshot) -> str:
    """How the layer a snapshot belongs to restores (SnapshotProtocol.role)."""
    if not snapshot.children:
        return kind_class(snapshot.kind).role
    roles = {kind_class(k).role for k in snapshot.scalars.get("kinds", ())}
    return next(r for r in ("state", "window", "range") if r in roles)


def join_nodes(upper: NodeSnapshots, lower: NodeSnapshots, start: int) -> list | None:
    """The snapshots of a node [start, b) joined with its only child [b, c), per
    layer; None when the join would lose a range layer's positions. Window layers
    keep what a window at c or later can use (their positions before that are
    read only by restores inside the joined span, which compact gives up)."""
    layers = []
    for u, lo in zip(upper, lower):
        if lo is None:
            if u is not None and role_of(u) == "range":
                return None  # a range layer would lose [start, b)
            layers.append(None)  # no state at the child's end: none for the joined node
        elif lo.children or role_of(lo) != "state":
            if u is None and role_of(lo) != "window":
                return None  # the range (or a cache list's range children) over the node is not here
            joined = kind_class(lo.kind).merge_chain([u, lo]) if u is not None else _from(lo, start)
            layers.append(_window_tails(joined))
        else:  # a state layer: its state at the child's end is the joined node's
            layers.append(respan(lo, start))
    return layers


def _from(snapshot: Snapshot, start: int) -> Snapshot:
    """A window snapshot as spanning from `start` (it holds nothing before its own start)."""
    layout = {k: snapshot.scalars[k] for k in ("max_size", "keep")}
    return window.build(layout, start, snapshot.end, window.sources(snapshot))


def _window_tails(snapshot: Snapshot) -> Snapshot:
    if snapshot.children:
        s = snapshot
        children = tuple(None if c is None else _window_tails(c) for c in s.children)
        return Snapshot(s.kind, s.start, s.end, s.whole, {}, dict(s.scalars), children)
    return window.window_tail(snapshot) if role_of(snapshot) == "window" else snapshot


def drop_states(snapshots: NodeSnapshots) -> tuple[list, int]:
    """The node without its recurrent states (a cache list keeps its other
    caches' positions, which later nodes build on), and the bytes dropped."""
    out, dropped = [], 0
    for s in snapshots:
        kept = _without_state(s)
        dropped += (0 if s is None else s.nbytes) - (0 if kept is None else kept.nbytes)
        out.append(kept)
    return out, dropped


def _without_state(s: Snapshot | None) -> Snapshot | None:
    if s is None or not s.children:
        return None if s is None or role_of(s) == "state" else s
    children = tuple(_without_state(c) for c in s.children)
    return Snapshot(s.kind, s.start, s.end, s.whole, {}, dict(s.scalars), children)


def state_nbytes(snapshots: NodeSnapshots) -> int:
    """Bytes of the node's recurrent states (what a checkpoint costs)."""
    return sum(0 if s is None else s.nbytes for s in snapshots) - sum(
        0 if s is None else s.nbytes for s in drop_states(snapshots)[0]
    )


def richer_windows(uppers: NodeSnapshots, caches: Sequence, start: int, at: int) -> list:
    """A split's upper snapshots [start, at), each window part holding what the
    stored node held there or what the inserting caches' windows still hold of
    it, whichever is more (so a branch point inside a long node becomes a
    restore point for window layers when the second prompt is inserted)."""
    return [_richer(u, c, start, at) for u, c in zip(uppers, caches)]


def _richer(upper: Snapshot | None, cache, start: int, at: int) -> Snapshot | None:
    if cache.role == "range" or cache.position < at:
        return upper
    if getattr(cache, "caches", None) is not None:  # a cache list: each of its caches
        if upper is None:
            return None
        children = tuple(_richer(u, c, start, at) for u, c in zip(upper.children, cache.caches))
        u = upper
        return Snapshot(u.kind, u.start, u.end, u.whole, {}, dict(u.scalars), children)
    if cache.role != "window":
        return upper
    live = kind_class(cache.kind).split_snapshot(cache.snapshot(start), at)[0]
    return live if _held(live) > _held(upper) else upper


def _held(snapshot: Snapshot | None) -> int:
    return 0 if snapshot is None else sum(hi - lo for lo, hi, *_ in window.sources(snapshot))


def restore_chains(path: Sequence[NodeSnapshots], end: int, target: int | None = None) -> list | None:
    """Per layer, the consecutive snapshots of `path` (nodes from the root down)
    that a restore to `target` (default `end`, the last node's end) reads; None
    when a layer has none ending at `end`."""
    target = end if target is None else target
    chains = []
    for layer in range(len(path[-1]) if path else 0):
        chain: list[Snapshot] = []
        for node in reversed(path):
            s = node[layer]
            if s is None:
                break
            chain.insert(0, s)
            if _enough(s, target):
                break
        if not chain or chain[-1].end != end:
            return None
        chains.append(chain)
    return chains


def _enough(s: Snapshot, target: int) -> bool:
    """Whether a restore to `target` needs nothing older than `s`."""
    if s.children:
        return False
    if s.whole:
        return True  # the state at its end (a first-format window included)
    if role_of(s) == "window":
        max_size, keep = s.scalars["max_size"], s.scalars["keep"]
        return s.start <= (0 if keep else max(0, target - max_size))
    return False


def present_layers(snapshots: NodeSnapshots) -> list[bool]:
    """Per layer: whether the node holds everything the layer needs at its end."""
    return [s is not None and s.complete for s in snapshots]


def node_nbytes(snapshots: NodeSnapshots) -> int:
    return sum(s.nbytes for s in snapshots if s is not None)
