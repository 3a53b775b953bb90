"""Tiers: a node's snapshots in memory, on disk, and the moves between them.

The mechanics: place a node (the hot tier), read it (reads.py), spill it
(spills.py), flush and close. When a node held in memory goes to disk is the
durability strategy's verdict (durability.py); what clients asked to keep is
keeping.py's, the disk budget eviction.py's, the remote tier remote_link.py's,
and what the index records of each node's file changes only through Filing
(filing.py). Anything wrong with a file is a miss plus a report, never an
exception. Budgets are per tenant (the namespaces of one salt, or of none):
each tenant's nodes are evicted against its own budget, by an order nothing of
another tenant's enters, so one tenant can neither evict nor time another's data.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import mlx.core as mx

from ..caches import Snapshot
from ..config import Settings
from ..errors import IndexStoreError, PromptStoreError
from ..identity import NodeId
from ..index import Index, Node
from ..snapshots import ColdTier, HotTier, SpillJob
from .admission import Event, Ticker
from .durability import Candidate, Placement, durability
from .eviction import ColdBudget
from .filing import Filing
from .keeping import Keeping
from .metrics import DiskFigures, Meter, Report, StoreMetrics
from .reads import PathRead, Reads
from .remote_link import RemoteLink
from .retention import Retention
from .spills import Spills

log = logging.getLogger("promptstore.store")


class Tiers:
    """Snapshots of every namespace of one store, for this process."""

    def __init__(self, root: Path, index: Index, settings: Settings):
        self.index, self.settings = index, settings
        self.cold = ColdTier(
            root / "cold", file_mode=settings.file_mode, dir_mode=settings.dir_mode, fsync=settings.fsync
        )
        self.hot = HotTier(settings.hot_bytes)
        self.clock: Callable[[], float] = time.time  # what retention and idle timers read; tests set it
        self.counts: Counter = Counter()
        self.meter = Meter()  # what PromptStore.metrics() reports
        self.reports: deque[Report] = deque(maxlen=1000)
        self.filing = Filing(index, self.cold, self.counts)
        self.keeping = Keeping(index, self.filing, lambda: self.clock())
        self.hot.kept = self.keeping.kept  # what clients asked to keep leaves memory last
        self.remote = RemoteLink(settings, index, self.cold, self.report)
        self.spills = Spills(
            settings, index, self.cold, self.hot, self.filing, self.keeping, self.remote, self.meter, self.counts
        )
        self.disk = self.spills.disk  # whether the disk takes writes (snapshots/disk_health.py)
        self.reads = Reads(
            index,
            self.cold,
            self.hot,
            self.filing,
            self.spills,
            self.keeping,
            self.meter,
            self.counts,
            self._hold_read,
            self.report,
        )
        self.budget = ColdBudget(
            index, self.filing, self.keeping, self.tenant, self.forget, lambda n, b: self.meter.evicted("cold", n, b)
        )
        self.durability = durability(settings)
        self._over_budget: set[bytes] = set()  # nodes the write budget skipped, counted once each
        self._tick_lock = threading.Lock()
        tick = self.durability.tick_seconds
        self._ticker = Ticker(self.write_due, tick) if tick is not None else None

    # --- placing --------------------------------------------------------------------

    def put(
        self,
        node: NodeId,
        snapshots: list[Snapshot],
        prefill_seconds: float = 0.0,
        retention: Retention | None = None,
        parent: bytes | None = None,
        turn: bool = False,
    ) -> None:
        """Hold a node's snapshots, and write them as the durability says (never a
        node retained in_memory); `retention`: the class the node gets;
        `parent`: the key of the node it goes on from (admit tells conversations by
        it); `turn`: a chat turn stored it (admit writes it when it leaves memory)."""
        mx.eval([a for s in snapshots if s is not None for a in s.all_arrays()])
        if retention is not None:
            self.keeping.retain(node.key, retention)
        only_child = lambda: len(self.index.children(parent)) == 1  # noqa: E731
        publish = self.remote.placed(node.key)
        placement = self.durability.placed(node.key, parent, only_child, self.clock(), turn, publish)
        group = self.tenant(node.namespace)
        evicted = self.hot.put(node.key, snapshots, prefill_seconds=prefill_seconds, node=node, group=group)
        written = None
        if not self.keeping.never_write(node.key) and self._carry_out(placement, SpillJob(node, snapshots)):
            written = node.key
        self._evicted(evicted, written)

    def _carry_out(self, placement: Placement, job: SpillJob) -> bool:
        """Write now, queue, or hold (False) a node as the durability placed it."""
        if placement == "now":
            self.spills.write_now(job)
        elif placement == "queue":
            self.spills.submit(job)
        return placement != "hold"

    def _hold_read(self, node: Node, snapshots: list[Snapshot]) -> None:
        """Keep snapshots read from disk in memory. A split's half read from the wider
        file it kept gets a file of its own as the durability writes a new node."""
        wider = node.record.file_node is not None
        group = self.tenant(node.namespace)
        kwargs = dict(prefill_seconds=node.record.prefill_seconds, dirty=wider, node=node.id, group=group)
        evicted = self.hot.put(node.key, snapshots, **kwargs)
        if wider:
            placement = self.durability.placed(node.key, None, lambda: False, self.clock(), False, False)
            self._carry_out("queue" if placement == "now" else placement, SpillJob(node.id, snapshots))
        self._evicted(evicted)

    def _evicted(self, evicted, written: bytes | None = None) -> None:
        """What left memory: spilled if not on disk (`written`: on its way already)
        and the durability writes it; a node retained in_memory is let go."""
        if evicted:
            self.meter.evicted("hot", len(evicted), sum(e.nbytes for e in evicted))
        now = self.clock()
        for entry in evicted:
            if self.keeping.never_write(entry.key):
                self.keeping.drop(entry.key, unwritten=entry.dirty)
            elif entry.dirty and entry.key != written and not self.spills.queued(entry):
                self._leaving("evicted", entry, now)

    def _leaving(self, event: Event, entry, now: float) -> bool:
        """A node held only in memory leaves it (evicted, or at close): written if the
        durability says so and the write budget allows (True), else let go. At
        close, what the budget alone skips is lost with the process, not declined."""
        writes = self.durability.writes(event, self._candidate(entry), now)
        if writes and self._within_budget(entry, now):
            self._admitted(event, entry)
            self.spills.submit(self.spills.job_for(entry))
            return True
        if not writes or event != "shutdown":
            self.meter.add(declined_nodes=1, declined_bytes=entry.nbytes)
            self.spills.let_go(entry.node)
        return False

    def _candidate(self, entry) -> Candidate:
        return Candidate(entry.key, entry.nbytes, entry.prefill_seconds, self.keeping.of(entry.key))

    def _within_budget(self, entry, now: float) -> bool:
        if self.durability.within_budget(entry.nbytes, now):
            return True
        if entry.key not in self._over_budget:
            self._over_budget.add(entry.key)
            self.meter.add(over_budget_nodes=1, over_budget_bytes=entry.nbytes)
        return False

    def _admitted(self, event: Event, entry) -> None:
        if self.durability.declines:  # the metrics count what admission chose to write
            self.meter.add(**{f"admitted.{event}": 1, f"admitted_bytes.{event}": entry.nbytes})

    def tenant(self, namespace: bytes) -> Hashable:
        """Whose budgets a namespace's nodes count against: its tenant digest (None
        when unsalted); a namespace the index cannot name is a tenant of its own."""
        try:
            return self.index.namespace(namespace).spec.tenant
        except IndexStoreError:
            return namespace

    def forget(self, key: bytes) -> None:
        """Drop a node's in-memory snapshots (its span changed or it was removed)."""
        self.hot.pop(key)
        self.remote.forget(key)
        self.spills.forget(key)

    def keep_states(self, key: bytes) -> None:
        """The node ends where prompts diverge: keep its states whatever its children."""
        self.spills.keep_states(key)

    # --- reading ------------------------------------------------------------------

    def get(self, node: Node) -> list[Snapshot] | None:
        """The node's snapshots from memory or a verified file; None is a miss."""
        return self.reads.get(node)

    def has(self, node: Node) -> bool:
        """Whether the node's data is held here or named on disk (without loading it)."""
        return self.reads.has(node)

    def is_held(self, node: Node) -> bool:
        """Whether this process holds the node's snapshots (no file read needed)."""
        return self.reads.is_held(node)

    def read(self, path: Sequence[Node]) -> PathRead:
        """A restore's read of a trie path: what is held, the files, the reads (PathRead)."""
        return self.reads.path(path)

    def read_into_memory(self, nodes: Sequence[Node]) -> int:
        """Read the files of `nodes` into memory (a warm start); returns the bytes read."""
        return self.reads.into_memory(nodes)

    def take_read_back(self, namespace: bytes) -> int:
        """File bytes of `namespace` read since the last call (for its persistent counters)."""
        return self.reads.take_read_back(namespace)

    def served(self, nodes: Sequence[Node]) -> None:
        """A prompt's hit went through `nodes`: they are reused (admit writes them at its next tick)."""
        if nodes:
            self.durability.used([n.key for n in nodes], self.clock())
            if self._ticker is not None:
                self._ticker.wake()

    def shared(self, key: bytes) -> None:
        """Two prompts share the node (a split made it their common prefix): it is reused."""
        self.durability.used([key], self.clock())

    # --- what the durability writes when due --------------------------------------------

    def write_due(self) -> int:
        """Queue for disk the nodes held only in memory that the durability writes
        now (admit: reused, or idle conversations), most valuable first, as far as
        the budget goes; retire the nodes let go. Never waits for the writer's
        queue (what does not fit waits for the next tick). Runs on the ticker's
        thread; a test may call it. Returns the nodes queued."""
        if self._ticker is None or (self.disk.retry_in() or 0.0) > 0.0:
            return 0  # no ticker, or the disk refuses writes: the writer tries again after its back-off
        with self._tick_lock:
            now, queued = self.clock(), 0
            held = {e.key: e for e in self.hot.dirty_entries() if not self.spills.queued(e)}
            ranked = sorted(held.values(), key=self.hot.value_of, reverse=True)
            for candidate in self.durability.due([self._candidate(e) for e in ranked], now):
                entry = held[candidate.key]
                if self.spills.writer.queue.full():
                    break
                if not self._within_budget(entry, now):
                    continue
                self._admitted("tick", entry)
                queued += self.spills.offer(SpillJob(entry.node, entry.snapshots))  # it stays in memory
            self.spills.retire_dropped()
            self.durability.forget(lambda key: key in self.hot or self.spills.waiting(key))
            return queued

    # --- counting ---------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        """Add to one of this process's counters (healed nodes, remote tokens, ...)."""
        self.counts[name] += n

    def fetched(self, model: str, prompt_tokens: int, hit) -> None:
        """A counted fetch, for PromptStore.metrics() (Meter.fetched)."""
        self.meter.fetched(model, prompt_tokens, hit)

    def report(self, reason: str, key: bytes, detail: str) -> None:
        """A miss an operator should know of: counted, kept (reports) and logged."""
        self.counts[f"miss_{reason}"] += 1
        self.reports.append(Report(reason, key.hex(), detail))
        log.warning("miss (%s) on node %s: %s", reason, key.hex()[:12], detail)

    def memory(self, tenant: Hashable | None = None) -> tuple[int, int]:
        """Nodes, and their bytes, in memory: all of them, or one tenant's (nodes: 0)."""
        if tenant is not None:
            return 0, self.hot.used[tenant]
        return len(self.hot), self.hot.nbytes

    def only_in_memory(self) -> dict[bytes, int]:
        """Nodes in memory not on disk yet that a close writes, by key: their bytes."""
        now = self.clock()
        entries = [e for e in self.hot.dirty_entries() if not self.keeping.never_write(e.key)]
        return {e.key: e.nbytes for e in entries if self.durability.writes("shutdown", self._candidate(e), now)}

    def metrics(self, **figures) -> StoreMetrics:
        """What the meter counted, with the tiers' sizes and remote counts; `figures`: the rest."""
        remote = self.remote.counts()
        nodes, nbytes = self.memory()
        return self.meter.snapshot(
            remote_written=remote.get("remote_published", 0),
            remote_written_bytes=remote.get("remote_published_bytes", 0),
            hot_nodes=nodes,
            hot_bytes=nbytes,
            retention=self.keeping.figures(self.hot.spared),
            compact_written_bytes=self.counts["compact_written_bytes"],
            disk=self.spills.figures(),
            **figures,
        )

    def disk_figures(self) -> DiskFigures:
        """What the disk refused, whether it refuses now, and what waits for it in memory."""
        return self.spills.figures()

    # --- flushing and closing -----------------------------------------------------------

    def give_way(self, busy: Callable[[], bool] | None, at_most: float = 1.0) -> None:
        """Spills pause between chunks while `busy()` is true (Writer.give_way)."""
        self.spills.writer.give_way(busy, at_most)

    def flush(self) -> None:
        """Wait for queued spills; retry ones the disk refused."""
        self.spills.flush()
        self.remote.flush()  # bounded by remote_close_seconds

    def unwritten(self) -> tuple[int, int]:
        """Nodes, and their bytes, held in memory only (after close: lost, Spills.unwritten)."""
        return self.spills.unwritten()

    def spill_all(self) -> None:
        """Write, and wait for, what the durability keeps of what only memory holds, as
        a close does (what it does not keep leaves memory unwritten); never a node
        retained in_memory: it goes with the process, and so does its index entry
        where no other node hangs under it."""
        unstored = []
        for entry in self.hot.dirty_entries():
            if self.keeping.never_write(entry.key):
                self._evicted([self.hot.pop(entry.key)])
                unstored.append(entry.node)
        now = self.clock()
        leaving = [e for e in self.hot.dirty_entries() if not self.spills.queued(e)]
        for entry in sorted(leaving, key=self.hot.value_of, reverse=True):  # the budget takes the dearest first
            if not self._leaving("shutdown", entry, now):
                self.hot.pop(entry.key)  # not written: lost with the process
        self.flush()
        self.spills.retire_dropped()
        self._unstore([n for n in unstored if n is not None])

    def close(self) -> None:
        """Write what the durability keeps (spill_all), then stop the writer and the publisher."""
        if self._ticker is not None:
            self._ticker.stop()
        self.spill_all()
        self.spills.close()
        self.reads.save_read_back()
        self.remote.close()

    def _unstore(self, nodes: list[NodeId]) -> None:
        """Remove nodes whose data is nowhere from the index, deepest first; one with
        children stays (a later prompt through it stores its data again)."""
        for node in sorted(nodes, key=lambda n: -n.end):
            try:
                self.filing.retire(self.index.namespace(node.namespace), node)
            except PromptStoreError as e:
                log.debug("node %s kept in the index: %s", node.key.hex()[:12], e)
