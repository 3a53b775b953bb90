"""Node-level snapshot operations: what one trie node holds, one snapshot per layer.

A node holds, per layer, a snapshot spanning its edge (None where it holds
nothing for that layer). Splitting a node where an edge is cut, joining a node
with its only child, and building the chains a restore reads are one function
each here, so the store never needs to know what kind a layer is.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def join_nodes(upper: NodeSnapshots, lower: NodeSnapshots, start: int) -> list | None:
    """The snapshots of a node [start, b) joined with its only child [b, c), per
    layer; None when the join would lose a range layer's positions."""
    layers = []
    for u, lo in zip(upper, lower):
        if lo is None:
            if u is not None and not u.whole:
                return None  # a range layer would lose [start, b)
            layers.append(None)  # no state at the child's end: none for the joined node
        elif lo.children or not lo.whole:
            if u is None:
                return None  # the range (or a cache list's range children) over the node is not here
            layers.append(kind_class(lo.kind).merge_chain([u, lo]))
        else:  # a whole-state layer: its state at the child's end is the joined node's
            layers.append(respan(lo, start))
    return layers


def restore_chains(path: Sequence[NodeSnapshots], end: int) -> list | None:
    """Per layer, the consecutive snapshots of `path` (nodes from the root down)
    that a restore to a position in the last node reads; None when a layer has
    none ending at `end`, the last node's end."""
    chains = []
    for layer in range(len(path[-1]) if path else 0):
        chain: list[Snapshot] = []
        for node in reversed(path):
            s = node[layer]
            if s is None:
                break
            chain.insert(0, s)
            if s.whole and not s.children:
                break  # the state at the end is all a whole-state layer needs
        if not chain or chain[-1].end != end:
            return None
        chains.append(chain)
    return chains


def present_layers(snapshots: NodeSnapshots) -> list[bool]:
    """Per layer: whether the node holds everything the layer needs at its end."""
    return [s is not None and s.complete for s in snapshots]


def node_nbytes(snapshots: NodeSnapshots) -> int:
    return sum(s.nbytes for s in snapshots if s is not None)
