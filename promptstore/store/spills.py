"""Spills: nodes held in memory going to disk, and what waits for a disk that refuses.

The background writer (snapshots/writer.py) writes each job; its file reaches
the index through Filing. Until then the job is what serves the node (`pending`);
a job the disk refused stays in memory (`stranded` once memory let the node go),
and the writer hands it over again after the disk's back-off. What waits is
bounded by hot_bytes: in a long spell the oldest go, counted as dropped, and
their index entries with them (`retire_dropped`, as for nodes admit declined).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from ..caches import drop_states, present_layers
from ..config import Settings
from ..errors import PromptStoreError
from ..identity import NodeId
from ..index import Index
from ..snapshots import ColdTier, HotTier, SpillJob, Writer
from .filing import Filing
from .keeping import Keeping
from .metrics import DiskFigures, Meter
from .remote_link import RemoteLink

log = logging.getLogger("promptstore.store")


class Spills:
    """The writes of one store's nodes in this process."""

    def __init__(
        self,
        settings: Settings,
        index: Index,
        cold: ColdTier,
        hot: HotTier,
        filing: Filing,
        keeping: Keeping,
        remote: RemoteLink,
        meter: Meter,
        counts: Counter,
    ):
        self.settings, self.index, self.hot, self.filing = settings, index, hot, filing
        self.keeping, self.remote, self.meter, self.counts = keeping, remote, meter, counts
        self.writer = Writer(cold, self._publish, self._failed, settings.writer_queue, self._retry_refused)
        self.disk = self.writer.health  # whether the disk takes writes (snapshots/disk_health.py)
        self.lock = threading.RLock()
        self.pending: dict[bytes, SpillJob] = {}  # handed to the writer, not in the index yet
        self.stranded: dict[bytes, SpillJob] = {}  # refused, and gone from memory: kept here
        self.refused: set[bytes] = set()  # nodes whose last write the disk refused
        self.dropped: list[NodeId] = []  # nodes let go unwritten: their index entries go (retire_dropped)
        self.branch_states: set[bytes] = set()  # nodes whose states a split made (keep_states)

    # --- handing jobs to the writer ------------------------------------------------

    def write_now(self, job: SpillJob) -> None:
        """Write in the caller's thread (the `sync` durability)."""
        self.writer.write_now(job)

    def submit(self, job: SpillJob) -> None:
        """Queue a job (waits while the writer's queue is full)."""
        with self.lock:
            self.pending[job.node.key] = job
        self.writer.submit(job)

    def offer(self, job: SpillJob) -> bool:
        """Queue a job unless the writer's queue is full (then False): never waits."""
        with self.lock:
            self.pending[job.node.key] = job
        if self.writer.offer(job):
            return True
        with self.lock:
            if self.pending.get(job.node.key) is job:
                del self.pending[job.node.key]
        return False

    def queued(self, entry) -> bool:
        """Whether these very snapshots of a hot entry are on their way to disk."""
        with self.lock:
            job = self.pending.get(entry.key)
        return job is not None and job.snapshots is entry.snapshots

    def held(self, node: NodeId):
        """The snapshots of `node` a job holds (on its way, or refused), None without one."""
        with self.lock:
            for jobs in (self.pending, self.stranded):
                job = jobs.get(node.key)
                if job is not None and job.node == node:
                    return job.snapshots
        return None

    def waiting(self, key: bytes) -> bool:
        return key in self.pending

    # --- what a job writes ---------------------------------------------------------

    def job_for(self, entry) -> SpillJob:
        """A node leaving memory. Its recurrent states are dropped when no restore
        has used them and the node is neither a leaf nor a branch point: a
        checkpoint no later prompt used is worth little (a prefill that passes
        it again stores it again)."""
        job = SpillJob(entry.node, entry.snapshots)
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
                ns = self.index.namespace(job.node.namespace)
                self.index.bump(ns, checkpoints_dropped=1, checkpoint_bytes_dropped=dropped)
            except PromptStoreError:
                pass  # counters are advisory
        return job

    def keep_states(self, key: bytes) -> None:
        """The node ends where prompts diverge: keep its states whatever its children."""
        with self.lock:
            self.branch_states.add(key)

    def forget(self, key: bytes) -> None:
        with self.lock:
            self.branch_states.discard(key)

    # --- the writer's callbacks (writer thread) ------------------------------------

    def _publish(self, job: SpillJob) -> None:
        key = job.node.key
        self.meter.add(files_written=1, disk_written_bytes=job.ref.nbytes)  # on disk, whether named or not
        try:
            if self.filing.publish(job, "both" if key in self.hot else "cold", self.keeping.kept_class(key)):
                self.hot.mark_clean(key)
                self.remote.filed(key)
        finally:
            # Only now: until the index names the file, the job is what serves the node.
            with self.lock:
                if self.pending.get(key) is job:
                    del self.pending[key]
                self.stranded.pop(key, None)
                self.refused.discard(key)

    def _failed(self, job: SpillJob) -> None:
        """A write the disk refused (or a bug): the node stays in memory, and the
        writer hands it over again after the disk's back-off (_retry_refused). Not
        a miss: nothing was asked of the node; the disk's health says it once."""
        key = job.node.key
        with self.lock:
            if self.pending.get(key) is job:
                del self.pending[key]
            if key not in self.hot:
                self.stranded[key] = job
            self.refused.add(key)
            overflow = self._stranded_over_budget()
        self.counts["spills_refused"] += 1
        for lost in overflow:
            self.meter.add(unwritten_dropped_nodes=1, unwritten_dropped_bytes=job_bytes(lost))
            self.let_go(lost.node)

    def _stranded_over_budget(self) -> list[SpillJob]:
        """What memory keeps for a disk that refuses is bounded too: past hot_bytes
        of them (a long spell), the oldest refused nodes go (lost, and counted) rather
        than the process's memory. Under self.lock."""
        total = sum(job_bytes(j) for j in self.stranded.values())
        gone = []
        for key in list(self.stranded):
            if total <= self.settings.hot_bytes:
                break
            job = self.stranded.pop(key)
            self.refused.discard(key)
            total -= job_bytes(job)
            gone.append(job)
        return gone

    def _retry_refused(self) -> int:
        """Offer the writer the nodes the disk refused (writer thread, after the
        back-off); returns how many wait for it, queued or not."""
        jobs = self._refused_jobs()
        for job in jobs:
            if not self.offer(job):
                break  # the queue is full: the rest wait for the next retry
        return len(jobs)

    def _refused_jobs(self) -> list[SpillJob]:
        with self.lock:
            keys = list(self.refused)
        jobs = []
        for key in keys:
            job = self._refused_job(key)
            if job is None:
                with self.lock:
                    self.refused.discard(key)  # written, dropped or evicted meanwhile
            else:
                jobs.append(job)
        return jobs

    def _refused_job(self, key: bytes) -> SpillJob | None:
        with self.lock:
            if key in self.pending:
                return None  # on its way already
            job = self.stranded.get(key)
        if job is not None:
            return SpillJob(job.node, job.snapshots, job.present)
        entry = self.hot.entries.get(key)
        if entry is None or not entry.dirty or entry.node is None:
            return None
        return SpillJob(entry.node, entry.snapshots)

    # --- nodes let go unwritten ----------------------------------------------------

    def let_go(self, node: NodeId | None) -> None:
        """A node memory let go without writing it (admit declined it, or a long
        spell of refusals): its index entry goes at the next retire_dropped."""
        if node is not None:
            with self.lock:
                self.dropped.append(node)

    def retire_dropped(self) -> int:
        """Remove from the index the nodes let go that are still leaves with no
        file and no data here (deepest first); how many."""
        with self.lock:
            dropped, self.dropped = sorted(self.dropped, key=lambda n: -n.end), []
        retired = 0
        for node_id in dropped:
            if node_id.key in self.hot or self.waiting(node_id.key):
                continue  # stored again meanwhile
            try:
                node = self.index.get(node_id.key)
                if node is None or node.id != node_id or node.record.file or not self.index.is_leaf(node.key):
                    continue
                retired += self.filing.retire(self.index.namespace(node.namespace), node_id) is not None
            except PromptStoreError:
                continue  # changed by another process: compact's dataless_nodes finds it
        return retired

    # --- what waits, and flushing ---------------------------------------------------

    def figures(self) -> DiskFigures:
        """What the disk refused, whether it refuses now, and what waits for it in memory."""
        state = self.disk.state()
        with self.lock:
            keys = list(self.refused)
            stranded = {k: j for k, j in self.stranded.items() if k in self.refused}
        waiting = [job_bytes(j) for j in stranded.values()]
        for key in keys:
            entry = self.hot.entries.get(key)
            if key not in stranded and entry is not None and entry.dirty:
                waiting.append(entry.nbytes)
        since = self.disk.clock() - state.since if state.since is not None else 0.0
        dropped = self.meter.counts("unwritten_dropped_nodes", "unwritten_dropped_bytes")
        return DiskFigures(
            state.refusing,
            since,
            state.reason,
            state.refused_writes,
            state.refused_bytes,
            state.deferred_writes,
            len(waiting),
            sum(waiting),
            dropped["unwritten_dropped_nodes"],
            dropped["unwritten_dropped_bytes"],
        )

    def flush(self) -> None:
        """Wait for queued spills; retry ones the disk refused (one try at once,
        whatever the back-off: the disk may have room again)."""
        self.writer.flush()
        retry = self._refused_jobs()
        if retry:
            self.disk.try_now()
        for job in retry:
            self.submit(job)
        self.writer.flush()
        self.filing.settle()

    def unwritten(self) -> tuple[int, int]:
        """Nodes, and their bytes, held in memory only: neither a file of their own
        nor one a split left them names their data. After close(), which spills
        every node, these are the ones the disk refused: lost with the process."""
        with self.lock:
            stranded = [j for k, j in self.stranded.items() if k not in self.hot]
        held = [(e.node, e.nbytes) for e in self.hot.dirty_entries()]
        held += [(j.node, job_bytes(j)) for j in stranded]
        lost = [nbytes for node, nbytes in held if not self._filed_as(node)]
        return len(lost), sum(lost)

    def _filed_as(self, node: NodeId | None) -> bool:
        """Whether the index names a file for this node as it is (its own, or a wider one)."""
        try:
            now = self.index.get(node.key) if node is not None else None
            return now is not None and now.id == node and bool(now.record.file)
        except PromptStoreError:
            return False

    def close(self) -> None:
        self.writer.close()
        self.filing.settle()


def job_bytes(job: SpillJob) -> int:
    return sum(s.nbytes for s in job.snapshots if s is not None)
