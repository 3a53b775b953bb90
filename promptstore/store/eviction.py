"""The disk budget: a tenant's files evicted, least valuable leaves first.

Only leaves go (a range snapshot is useless without its ancestors), valued by
the prefill time they save against their bytes, with ages counted among the
tenant's own nodes, so no other tenant's use reorders them. Leaves a client asked
to keep (retention.py) go after every other, and only while over budget.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from ..index import Node
from ..snapshots.value import value


def evict_tenant(
    filed: list[Node],
    budget: int,
    is_leaf: Callable[[bytes], bool],
    retire: Callable[[Node], bool],
    kept: Callable[[Node], bool] = lambda n: False,
    passed_over: Callable[[int], None] = lambda n: None,
) -> tuple[int, int]:
    """Retire leaves of `filed` (one tenant's nodes with files, least recently used
    first) until their files are within `budget`; returns (nodes, bytes) removed.

    retire: removes a leaf (its record, then its file), False if it is no longer one.
    kept: whether a client asked to keep the node for now (it goes last).
    passed_over: told how many kept leaves stayed that their value alone would have sent.
    """
    removed = freed = 0
    total = sum(n.record.nbytes for n in filed)
    if total <= budget:
        return removed, freed
    # One scan, then a heap: evicting a leaf can only make its parent a leaf.
    ages = {n.key: age for age, n in enumerate(reversed(filed))}
    nodes = {n.key: n for n in filed}

    def entry(n: Node):
        worth = value(n.record.prefill_seconds, n.record.hits, n.record.nbytes, ages[n.key])
        return (kept(n), worth, ages[n.key], n.key)

    # The access order is read in batches while other processes re-stamp it, so
    # a node may be listed twice: each is pushed once, and one popped twice is skipped.
    heap = [entry(n) for n in nodes.values() if is_leaf(n.key)]
    heapq.heapify(heap)
    dearest = None  # the most valuable leaf retired that nobody asked to keep
    while total > budget and heap:
        popped = heapq.heappop(heap)
        victim = nodes.pop(popped[3], None)
        if victim is None or not retire(victim):
            continue  # popped twice, or changed by another process meanwhile
        if not popped[0]:
            dearest = popped[1] if dearest is None else max(dearest, popped[1])
        removed, freed, total = removed + 1, freed + victim.record.nbytes, total - victim.record.nbytes
        parent = nodes.get(victim.parent)
        if parent is not None and is_leaf(parent.key):
            heapq.heappush(heap, entry(parent))
    if dearest is not None:
        passed_over(sum(1 for e in heap if e[0] and e[1] < dearest and e[3] in nodes))
    return removed, freed
