"""Tiers: a node's snapshots in memory, on disk, and the moves between them.

Composes the hot tier, the cold tier, the background writer and the index
records that say where each node's file is. A file is written before the
index points at it; an evicted node leaves the index before its file goes, so
a crash leaves an orphan file (which compact reclaims), never a dangling entry.
Anything wrong with a file is a miss plus a report, never an exception.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..caches import Snapshot, drop_states, present_layers
from ..config import Settings
from ..errors import (
    ColdFileError,
    CorruptRecordError,
    NodeHasChildrenError,
    NodeNotFoundError,
    PromptStoreError,
    StaleInsertError,
)
from ..index import Index, Node
from ..snapshots import ColdTier, HotTier, SpillJob, Writer
from ..snapshots.cold import PendingLoad
from ..snapshots.value import value

log = logging.getLogger("promptstore.store")


@dataclass(frozen=True)
class Report:
    """Something a caller did not see as an error but an operator should know."""

    reason: str
    key: str
    detail: str
    at: float = field(default_factory=time.time)


def unfile(index: Index, node: Node, path: str) -> bool:
    """Stop the index pointing at `path` for this node, if it still does."""
    try:
        record = node.record.model_copy(update={"file": None, "checksum": None, "tier": "hot"})
        index.update_record(
            node.key, record, expect=lambda n: (n.start, n.end) == (node.start, node.end) and n.record.file == path
        )
        return True
    except (NodeNotFoundError, CorruptRecordError, StaleInsertError):
        return False


class Tiers:
    """Snapshots of every namespace of one store, for this process."""

    def __init__(self, root: Path, index: Index, settings: Settings):
        self.index, self.settings = index, settings
        self.cold = ColdTier(
            root / "cold", file_mode=settings.file_mode, dir_mode=settings.dir_mode, fsync=settings.fsync
        )
        self.hot = HotTier(settings.hot_bytes)
        self.writer = Writer(self.cold, self._publish, self._failed, settings.writer_queue)
        self.pending: dict[bytes, SpillJob] = {}  # evicted from memory, not yet on disk
        self.stranded: dict[bytes, SpillJob] = {}  # could not be written: kept in memory
        self.reports: deque[Report] = deque(maxlen=1000)
        self.counts: Counter = Counter()
        self.branch_states: set[bytes] = set()  # nodes whose states a split made (see keep_states)
        self.lock = threading.RLock()

    # --- placing ------------------------------------------------------------------

    def put(self, node: Node, snapshots: list[Snapshot], prefill_seconds: float = 0.0) -> None:
        """Hold a node's snapshots and spill per the durability setting."""
        mx.eval([a for s in snapshots if s is not None for a in s.all_arrays()])
        meta = {"namespace": node.namespace, "start": node.start, "end": node.end}
        evicted = self.hot.put(node.key, snapshots, prefill_seconds=prefill_seconds, meta=meta)
        mode = self.settings.durability
        if mode == "sync":
            self.writer.write_now(self._job(node.key, snapshots, meta))
        elif mode == "write_through":
            self._submit(self._job(node.key, snapshots, meta))
        for entry in evicted:
            if entry.dirty and not (entry.key == node.key and mode != "write_back"):
                self._submit(self._spill_job(entry))

    def forget(self, key: bytes) -> None:
        """Drop a node's in-memory snapshots (its span changed or it was removed)."""
        self.hot.pop(key)
        with self.lock:
            self.branch_states.discard(key)

    @staticmethod
    def _job(key, snapshots, meta) -> SpillJob:
        return SpillJob(key, meta["namespace"], meta["start"], meta["end"], snapshots)

    def _spill_job(self, entry) -> SpillJob:
        """A node leaving memory. Its recurrent states are dropped when no restore
        has used them and the node is neither a leaf nor a branch point: a
        checkpoint no later prompt used is worth little (a prefill that passes
        it again stores it again)."""
        job = self._job(entry.key, entry.snapshots, entry.meta)
        with self.lock:
            at_branch = entry.key in self.branch_states
            self.branch_states.discard(entry.key)
        if entry.restores or at_branch or len(self.index.children(entry.key)) != 1:
            return job
        kept, dropped = drop_states(entry.snapshots)
        if dropped:
            job.snapshots, job.present = kept, present_layers(kept)
            self.counts["checkpoints_dropped"] += 1
            try:
                ns = self.index.namespace(job.namespace)
                self.index.bump(ns, checkpoints_dropped=1, checkpoint_bytes_dropped=dropped)
            except PromptStoreError:
                pass  # counters are advisory
        return job

    def keep_states(self, key: bytes) -> None:
        """The node ends where prompts diverge: keep its states whatever its children."""
        with self.lock:
            self.branch_states.add(key)

    def restored_from(self, key: bytes) -> None:
        """A restore ended at this node's end: its states are worth keeping."""
        with self.hot.lock:
            entry = self.hot.entries.get(key)
            if entry is not None:
                entry.restores += 1

    def _submit(self, job: SpillJob) -> None:
        with self.lock:
            self.pending[job.key] = job
        self.writer.submit(job)

    # --- serving ------------------------------------------------------------------

    def has(self, node: Node) -> bool:
        """Whether the node's data is held here or named on disk (without loading it)."""
        span = (node.namespace, node.start, node.end)
        entry = self.hot.entries.get(node.key)
        if entry is not None and (entry.meta["namespace"], entry.meta["start"], entry.meta["end"]) == span:
            return True
        with self.lock:
            for jobs in (self.pending, self.stranded):
                job = jobs.get(node.key)
                if job is not None and (job.namespace, job.start, job.end) == span:
                    return True
        try:
            return bool(node.record.file)
        except CorruptRecordError:
            return False

    def get(self, node: Node) -> list[Snapshot] | None:
        """The node's snapshots from memory or a verified file; None is a miss."""
        held = self._held(node)
        if held is not None:
            return held
        pending = self._start_load(node)
        return None if pending is None else self._finish_load(node, pending)

    def get_path(self, nodes: Sequence[Node]) -> tuple[list[list[Snapshot]], list[Node]]:
        """The snapshots of `nodes`, in order up to the first miss, and the nodes
        that came from disk. The files of all nodes not in memory are started
        together: MLX reads them back to back while the earlier ones are verified."""
        found = []  # (node, its snapshots, or the load of its file); each node looked up once
        for node in nodes:
            held = self._held(node)
            if held is None:
                held = self._start_load(node)
                if held is None:
                    break  # a miss: nothing after it is used
            found.append((node, held))
        out, cold = [], []
        for node, held in found:
            if isinstance(held, PendingLoad):
                held = self._finish_load(node, held)
                if held is None:
                    break
                cold.append(node)
            out.append(held)
        return out, cold

    def _held(self, node: Node) -> list[Snapshot] | None:
        """The node's snapshots if this process holds them (hot, or queued for disk)."""
        span = (node.namespace, node.start, node.end)
        entry = self.hot.get(node.key)
        if entry is not None and (entry.meta["namespace"], entry.meta["start"], entry.meta["end"]) == span:
            return entry.snapshots
        with self.lock:
            for jobs in (self.pending, self.stranded):
                job = jobs.get(node.key)
                if job is not None and (job.namespace, job.start, job.end) == span:
                    return job.snapshots
        return None

    def _start_load(self, node: Node):
        try:
            record = node.record
        except CorruptRecordError as e:
            self.report("record", node.key, str(e))
            return None
        if record.file is None:
            return None
        return self.cold.start_load(record.file, key=node.key, namespace=node.namespace, start=node.start, end=node.end)

    def _finish_load(self, node: Node, pending) -> list[Snapshot] | None:
        try:
            snapshots = pending.result()
        except ColdFileError as e:
            self._bad_file(node, e)
            return None
        self.counts["cold_loads"] += 1
        meta = {"namespace": node.namespace, "start": node.start, "end": node.end}
        for entry in self.hot.put(
            node.key, snapshots, prefill_seconds=node.record.prefill_seconds, dirty=False, meta=meta
        ):
            if entry.dirty:
                self._submit(self._spill_job(entry))
        return snapshots

    def _bad_file(self, node: Node, error: ColdFileError) -> None:
        """A miss: report it, quarantine the file, and stop pointing at it."""
        self.report(error.reason, node.key, str(error))
        if error.reason != "missing" and self.cold.owns(error.path, node.key, node.start, node.end):
            self.cold.quarantine(error.path)  # never a file the record merely names
        unfile(self.index, node, error.path)

    def report(self, reason: str, key: bytes, detail: str) -> None:
        self.counts[f"miss_{reason}"] += 1
        self.reports.append(Report(reason, key.hex(), detail))
        log.warning("miss (%s) on node %s: %s", reason, key.hex()[:12], detail)

    # --- the writer's callbacks (writer thread) -----------------------------------

    def _publish(self, job: SpillJob) -> None:
        try:
            self._record_file(job)
        finally:
            # Only now: until the index names the file, the job is what serves the node.
            with self.lock:
                if self.pending.get(job.key) is job:
                    del self.pending[job.key]
                self.stranded.pop(job.key, None)

    def _record_file(self, job: SpillJob) -> None:
        ref = job.ref
        try:
            node = self.index.get(job.key)
            if node is None or (node.namespace, node.start, node.end) != (job.namespace, job.start, job.end):
                self.cold.delete(ref.path)  # the node was split or removed meanwhile
                self.counts["spills_dropped"] += 1
                return
            old = node.record.file
            tier = "both" if job.key in self.hot else "cold"
            record = node.record.model_copy(
                update={"file": ref.path, "nbytes": ref.nbytes, "checksum": ref.checksum, "tier": tier}
            )
            if job.present is not None:  # the file holds less than the node did in memory
                layers = [r.model_copy(update={"present": p}) for r, p in zip(record.layers, job.present)]
                record = record.model_copy(update={"layers": layers})
            span = (job.namespace, job.start, job.end)
            self.index.update_record(
                job.key, record, expect=lambda n: (n.namespace, n.start, n.end) == span and n.record.file == old
            )
        except (NodeNotFoundError, CorruptRecordError, StaleInsertError):
            self.cold.delete(ref.path)  # the node changed meanwhile: this file is not its
            self.counts["spills_dropped"] += 1
            return
        if old and old != ref.path:
            self.cold.delete(old)
        self.hot.mark_clean(job.key)
        self.counts["spills"] += 1

    def _failed(self, job: SpillJob) -> None:
        with self.lock:
            if self.pending.get(job.key) is job:
                del self.pending[job.key]
            if job.key not in self.hot:
                self.stranded[job.key] = job
        self.report("disk", job.key, str(job.error))

    # --- budgets and shutdown -------------------------------------------------------

    def flush(self) -> None:
        """Wait for queued spills; retry ones the disk refused."""
        self.writer.flush()
        with self.lock:
            retry = list(self.stranded.values())
        for job in retry:
            self._submit(SpillJob(job.key, job.namespace, job.start, job.end, job.snapshots))
        self.writer.flush()

    def spill_all(self) -> None:
        """Put every node that is only in memory on disk (close, whatever the durability)."""
        for entry in self.hot.dirty_entries():
            self._submit(self._spill_job(entry))
        self.flush()

    def cold_bytes(self) -> int:
        return sum(n.record.nbytes for n in self._filed())

    def _filed(self):
        for node in self.index.iter_by_access():
            try:
                if node.record.file:
                    yield node
            except CorruptRecordError:
                continue

    def evict_cold(self, budget: int | None = None) -> tuple[int, int]:
        """Evict leaves with files, least valuable first, until the cold tier is
        within `budget` (default: the setting). Returns (nodes, bytes) removed."""
        budget = self.settings.disk_bytes if budget is None else budget
        removed = freed = 0
        filed = list(self._filed())
        total = sum(n.record.nbytes for n in filed)
        if total <= budget:
            return removed, freed
        # One scan, then a heap: evicting a leaf can only make its parent a leaf.
        ages = {n.key: age for age, n in enumerate(reversed(filed))}
        nodes = {n.key: n for n in filed}

        def entry(n: Node):
            return (value(n.record.prefill_seconds, n.record.hits, n.record.nbytes, ages[n.key]), ages[n.key], n.key)

        heap = [entry(n) for n in filed if self.index.is_leaf(n.key)]
        heapq.heapify(heap)
        while total > budget and heap:
            victim = nodes.pop(heapq.heappop(heap)[2])
            try:
                ns = self.index.namespace(victim.namespace)
                self.index.remove(ns, victim.key)  # the entry first: a crash leaves an orphan file
            except (NodeHasChildrenError, NodeNotFoundError):
                continue  # another process changed it meanwhile
            self.forget(victim.key)
            self.cold.delete(victim.record.file)
            removed, freed, total = removed + 1, freed + victim.record.nbytes, total - victim.record.nbytes
            parent = nodes.get(victim.parent)
            if parent is not None and self.index.is_leaf(parent.key):
                heapq.heappush(heap, entry(parent))
        return removed, freed

    def close(self) -> None:
        self.spill_all()
        self.writer.close()
