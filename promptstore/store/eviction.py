"""The disk budget: a tenant's files evicted, least valuable leaves first.

Only leaves go (a range snapshot is useless without its ancestors), valued by
the prefill time they save against their bytes, with ages counted among the
tenant's own nodes, so no other tenant's use reorders them. Leaves a client asked
to keep (retention.py) go after every other, and only while over budget.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Hashable

from ..index import Index, Node
from ..snapshots.value import value
from .filing import Filing, filed
from .keeping import Keeping


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


class ColdBudget:
    """Each tenant's files against the disk budget (disk_bytes, or compact's
    --max-bytes): least valuable leaves first, retained ones last.

    tenant: whose budget a namespace's nodes count against; forget: drops a
    retired node's snapshots from memory; evicted: told the (nodes, bytes) gone.
    """

    def __init__(
        self,
        index: Index,
        filing: Filing,
        keeping: Keeping,
        tenant: Callable[[bytes], Hashable],
        forget: Callable[[bytes], None],
        evicted: Callable[[int, int], None],
    ):
        self.index, self.filing, self.keeping = index, filing, keeping
        self.tenant, self.forget, self.evicted = tenant, forget, evicted

    def filed_bytes(self) -> int:
        """Bytes of every node with a file, as their records say."""
        return sum(n.record.nbytes for n in filed(self.index.iter_by_access()))

    def by_tenant(self) -> dict[Hashable, list[Node]]:
        """Nodes with files, least recently used first, by tenant."""
        out = defaultdict(list)
        for node in filed(self.index.iter_by_access()):
            out[self.tenant(node.namespace)].append(node)
        return out

    def evict(self, budget: int) -> tuple[int, int]:
        """Evict leaves with files until each tenant's are within `budget`. Returns
        (nodes, bytes) removed."""
        removed = freed = 0
        for tenant_nodes in self.by_tenant().values():
            nodes, nbytes = evict_tenant(
                tenant_nodes,
                budget,
                self.index.is_leaf,
                self._retire,
                kept=self.keeping.kept_on_disk,
                passed_over=self.keeping.passed_over,
            )
            removed, freed = removed + nodes, freed + nbytes
        return removed, freed

    def _retire(self, victim: Node) -> bool:
        """Remove a leaf over its tenant's budget; False if another process changed it meanwhile."""
        if self.filing.retire(self.index.namespace(victim.namespace), victim.id) is None:
            return False
        self.forget(victim.key)
        self.keeping.drop(victim.key)
        self.evicted(1, victim.record.nbytes)
        return True
