"""Tiers: a node's snapshots in memory, on disk, and the moves between them.

Composes the hot tier, the cold tier and the background writer; what the index
records of each node's file changes only through Filing (store/filing.py).
Anything wrong with a file is a miss plus a report, never an exception.
Budgets are per tenant (the namespaces of one salt, or of none): each tenant's
nodes are evicted against its own budget, by an order nothing of another
tenant's enters, so one tenant can neither evict nor time another's data.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..caches import Snapshot, drop_states, present_layers
from ..config import Settings
from ..errors import ColdFileError, CorruptRecordError, IndexStoreError, PromptStoreError
from ..identity import NodeId
from ..index import Index, InsertPlan, InsertResult, Node, NodeRecord
from ..snapshots import ColdTier, HotTier, SpillJob, Writer
from ..snapshots.cold import PendingLoad
from ..snapshots.remote import LocalLink, PublishItem, RemoteHit, RemoteTier, prune_ledger
from .admission import Admission, Event, Ticker, admit
from .eviction import evict_tenant
from .filing import Filing, file_id, filed, part_of
from .metrics import DiskFigures, Meter, Report, StoreMetrics
from .retention import CLASSES, NONE, Retained, Retention, RetentionFigures, keys_of, record_fields, retention_class

log = logging.getLogger("promptstore.store")


class Tiers:
    """Snapshots of every namespace of one store, for this process."""

    def __init__(self, root: Path, index: Index, settings: Settings):
        self.index, self.settings = index, settings
        self.cold = ColdTier(
            root / "cold", file_mode=settings.file_mode, dir_mode=settings.dir_mode, fsync=settings.fsync
        )
        self.hot = HotTier(settings.hot_bytes)
        self.clock: Callable[[], float] = time.time  # what retention (and idle timers) read; tests set it
        self.retained = Retained(lambda: self.clock())
        self.hot.kept = self.retained.kept  # what clients asked to keep leaves memory last
        self.counts: Counter = Counter()
        self.meter = Meter()  # what PromptStore.metrics() reports
        self.filing = Filing(index, self.cold, self.counts)
        self.writer = Writer(self.cold, self._publish, self._failed, settings.writer_queue, self._retry_refused)
        self.disk = self.writer.health  # whether the disk takes writes (snapshots/disk_health.py)
        self.pending: dict[bytes, SpillJob] = {}  # evicted from memory, not yet on disk
        self.stranded: dict[bytes, SpillJob] = {}  # could not be written: kept in memory
        self.refused: set[bytes] = set()  # nodes whose last write the disk refused (held in memory)
        self.reports: deque[Report] = deque(maxlen=1000)
        self.branch_states: set[bytes] = set()  # nodes whose states a split made (see keep_states)
        self.lock = threading.RLock()
        self.remote = self._remote_tier(settings)
        self.quiet: set[bytes] = set()  # nodes made from remote hits: the server has their data
        self._origin = threading.local()
        self.loading: dict[bytes, tuple[NodeId, str, PendingLoad]] = {}  # files being read, by node
        # The `admit` durability (store/admission.py): idle times and the write budget
        # read `clock` too; the ticker writes what is due, off the generation thread.
        self.admission = Admission(settings)
        self.dropped: list[NodeId] = []  # nodes admission declined: their index entries go (retire_dropped)
        self.read_back: defaultdict[bytes, int] = defaultdict(int)  # file bytes read, by namespace, not yet counted
        self._over_budget: set[bytes] = set()  # counted once each
        self._tick_lock = threading.Lock()
        self._ticker = (
            Ticker(self.write_due, min(1.0, settings.admit_idle_seconds / 4))
            if settings.durability == "admit"
            else None
        )

    # --- the remote tier (docs/remote.md) -----------------------------------------

    def _remote_tier(self, settings: Settings) -> RemoteTier | None:
        if settings.remote_url is None:
            return None
        return RemoteTier(
            settings.remote_url,
            self.cold,
            self._describe,
            self.report,
            secret=settings.remote_secret,
            timeout=settings.remote_timeout,
            close_seconds=settings.remote_close_seconds,
        )

    def from_remote(self):
        """Nodes put inside are copies of a remote hit: stored here, never published back."""
        return self._origin_remote(True)

    def local(self):
        """Nodes put inside are this store's own data, even while a remote hit is
        stored: the two parts of a node a remote hit's insert split have new
        spans, whose blobs the server does not hold."""
        return self._origin_remote(False)

    @contextmanager
    def _origin_remote(self, remote: bool) -> Iterator[None]:
        was = getattr(self._origin, "remote", False)
        self._origin.remote = remote
        try:
            yield
        finally:
            self._origin.remote = was

    def _describe(self, key: bytes) -> PublishItem | None:
        """A filed node worth publishing, with its path from the root (publisher thread)."""
        try:
            node = self.index.get(key)
            if node is None or node.record.prefill_seconds < self.settings.remote_publish_seconds:
                return None
            path = [node]
            while path[0].parent != node.namespace and len(path) <= node.end:
                parent = self.index.get(path[0].parent)
                if parent is None:
                    return None  # removed meanwhile
                path.insert(0, parent)
            if any(n.record.file_node is not None for n in path):
                return None  # a half reading a wider file: published once it has its own
            links = [
                LocalLink(n.key, n.start, n.end, n.record.file, n.record.nbytes, n.record.prefill_seconds) for n in path
            ]
        except CorruptRecordError:
            return None
        return PublishItem(node.namespace, np.concatenate([n.tokens for n in path]), links)

    def fetch_remote(self, namespace: bytes, tokens, beyond: int, node_key, held) -> RemoteHit | None:
        """The remote tier's deepest prefix of `tokens` past `beyond` (RemoteTier.fetch); None without one."""
        return None if self.remote is None else self.remote.fetch(namespace, tokens, beyond, node_key, held)

    def prune_remote_ledger(self) -> int:
        """Forget published blobs the server no longer has; how many (0 without a
        remote tier, or while the server is down)."""
        if self.remote is None or not self.remote.available():
            return 0
        return prune_ledger(self.cold.root.parent, self.remote.client)

    def remote_summary(self, node_exists: Callable[[bytes], bool]) -> dict | None:
        """What this store published and what of it is stale (RemoteTier.summary); None without a remote tier."""
        return None if self.remote is None else self.remote.summary(node_exists)

    # --- placing ------------------------------------------------------------------

    def put(
        self,
        node: NodeId,
        snapshots: list[Snapshot],
        prefill_seconds: float = 0.0,
        retention: Retention | None = None,
        parent: bytes | None = None,
        turn: bool = False,
    ) -> None:
        """Hold a node's snapshots and spill per the durability setting (never a
        node retained in_memory); `retention`: the class the node gets (retain);
        `parent`: the key of the node it goes on from (admit tells conversations by it);
        `turn`: a chat turn stored it (admit writes it when it leaves memory)."""
        mx.eval([a for s in snapshots if s is not None for a in s.all_arrays()])
        if retention is not None:
            self.retain(node.key, retention)
        group = self.tenant(node.namespace)
        if self.settings.durability == "admit":
            only_child = lambda: len(self.index.children(parent)) == 1  # noqa: E731
            self.admission.placed(node.key, parent, only_child, self.clock(), turn)
        evicted = self.hot.put(node.key, snapshots, prefill_seconds=prefill_seconds, node=node, group=group)
        quiet = getattr(self._origin, "remote", False)
        if quiet:
            self.quiet.add(node.key)
        mode = self.settings.durability
        # With a remote tier a node goes to disk at once, to be published from its file;
        # a copy of a remote hit waits for eviction or close (the server has it meanwhile).
        through = mode == "write_through" or (mode == "write_back" and self.remote is not None and not quiet)
        written = None
        if self.retained.never_write(node.key):
            pass  # in memory only: left dirty, and dropped when it leaves memory
        elif mode == "sync":
            self.writer.write_now(SpillJob(node, snapshots))
            written = node.key
        elif through:
            self._submit(SpillJob(node, snapshots))
            written = node.key
        self._count_evicted(evicted)
        self._spill_evicted(evicted, written)

    def _spill_evicted(self, evicted, written: bytes | None = None) -> None:
        """Spill what left memory and is not on disk (`written`: on its way already);
        a node retained in_memory is dropped instead, never written."""
        for entry in evicted:
            if self.retained.never_write(entry.key):
                self.retained.drop(entry.key)
                if entry.dirty:
                    self.retained.count("never_written")
            elif entry.dirty and entry.key != written:
                self._spill_one(entry)

    def _count_evicted(self, entries) -> None:
        if entries:
            self.meter.evicted("hot", len(entries), sum(e.nbytes for e in entries))

    def commit_insert(self, plan: InsertPlan, record: NodeRecord | None, split_records) -> InsertResult:
        """An insert's new node and split halves into the index (Filing.commit_insert)."""
        return self.filing.commit_insert(plan, record, split_records)

    def split_files(self, node: Node, at: int) -> tuple[dict, dict]:
        """What a filed node's halves' records name until each has its own file (Filing.split_files)."""
        return self.filing.split_files(node, at)

    def refile(self, node: NodeId, old_file: str | None, record: NodeRecord) -> bool:
        """Replace a node's record while it still names `old_file` (Filing.refile)."""
        return self.filing.refile(node, old_file, record)

    def tenant(self, namespace: bytes) -> Hashable:
        """Whose budgets a namespace's nodes count against: its tenant digest (None
        when unsalted); a namespace the index cannot name is a tenant of its own."""
        try:
            return self.index.namespace(namespace).spec.tenant
        except IndexStoreError:
            return namespace

    def forget(self, key: bytes) -> None:
        """Drop a node's in-memory snapshots (its span changed or it was removed).
        A node a remote hit made is then quiet no more: the server holds no blob
        of its new span."""
        self.hot.pop(key)
        self.quiet.discard(key)
        with self.lock:
            self.branch_states.discard(key)

    def _spill_job(self, entry) -> SpillJob:
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

    def restored_from(self, key: bytes) -> None:
        """A restore ended at this node's end: its states are worth keeping."""
        with self.hot.lock:
            entry = self.hot.entries.get(key)
            if entry is not None:
                entry.restores += 1

    def _submit(self, job: SpillJob) -> None:
        with self.lock:
            self.pending[job.node.key] = job
        self.writer.submit(job)

    # --- retention (store/retention.py) -------------------------------------------

    def retain(self, key_or_nodes, retention: Retention | str | None) -> None:
        """Keep these nodes (a key, a node, or an iterable of either) as `retention`
        asks, from now (`clock`); a class a node has that outlasts it stays. A node
        on disk has its time written in its record, so other processes (compact)
        and a restart keep it too; an in_memory class is this process's alone."""
        r = retention_class(retention)
        if r is NONE:
            return
        applied = r.applied(self.clock())
        for key in keys_of(key_or_nodes):
            if self.retained.apply(key, applied) is applied and not applied.never_write:
                self._record_retention(key, applied)

    def retention_of(self, key: bytes) -> Retention | None:
        """The class this process keeps a node by (`never_write`, `keep_until`), None without one."""
        return self.retained.of(key)

    def split_retention(self, key: bytes, upper_key: bytes) -> None:
        """A node was split: its upper half is kept as the node was."""
        self.retained.move(key, upper_key)

    def _record_retention(self, key: bytes, r: Retention) -> None:
        """Write a filed node's keep_until in its record, unless it says about as
        much already (within a minute, or a tenth of the class: a prefix used by
        every request is written at most that often). A node not filed yet gets
        it when its file is published (_publish)."""
        try:
            node = self.index.get(key)
            if node is None or not node.record.file:
                return
            record = node.record
            slack = max(60.0, r.keep_seconds / 10)
            if record.keep_until is not None and record.keep_until >= r.keep_until - slack:
                return
            self.filing.refile(node.id, record.file, record.model_copy(update=record_fields(r, record.keep_until)))
        except PromptStoreError as e:
            log.debug("retention of node %s not recorded: %s", key.hex()[:12], e)  # memory still keeps it

    def _recorded_retention(self, node: Node) -> None:
        """A node read from disk is kept as its record says, while that lasts."""
        try:
            record = node.record
        except CorruptRecordError:
            return
        r = CLASSES.get(record.retention or "")
        if r is not None and record.keep_until is not None and record.keep_until > self.clock():
            self.retained.apply(node.key, replace(r, keep_until=record.keep_until))

    def _kept_on_disk(self, node: Node) -> bool:
        """Whether the disk budget passes over this node for now (retained here, or by its record)."""
        if self.retained.kept(node.key):
            return True
        try:
            until = node.record.keep_until
        except CorruptRecordError:
            return False
        return until is not None and until > self.clock()

    def retention_figures(self) -> RetentionFigures:
        figures = self.retained.figures()
        return replace(figures, kept=figures.kept + self.hot.spared)

    # --- admission (the admit durability, store/admission.py) ----------------------

    def served(self, nodes: Sequence[Node]) -> None:
        """A prompt's hit went through `nodes`: they are reused (admit writes them at its next tick)."""
        if self._ticker is not None and nodes:
            self.admission.used([n.key for n in nodes], self.clock())
            self._ticker.wake()

    def shared(self, key: bytes) -> None:
        """Two prompts share the node (a split made it their common prefix): it is reused."""
        if self._ticker is not None:
            self.admission.used([key], self.clock())

    def write_due(self) -> int:
        """Queue for disk the nodes held only in memory that admission writes now,
        most valuable first, as far as the budget goes; retire the nodes it dropped.
        Never waits for the writer's queue (what does not fit waits for the next
        tick). Runs on the admission thread every second; a test may call it.
        Returns the nodes queued."""
        if self.settings.durability != "admit" or (self.disk.retry_in() or 0.0) > 0.0:
            return 0  # the disk refuses writes: the writer tries again after its back-off
        with self._tick_lock:
            now, queued = self.clock(), 0
            due = [e for e in self.hot.dirty_entries() if not self._queued(e) and self._admits("tick", e, now)]
            for entry in sorted(due, key=self.hot.value_of, reverse=True):
                if self.writer.queue.full():
                    break
                if not self._within_budget(entry, now):
                    continue
                self._admitted("tick", entry)
                queued += self._offer(SpillJob(entry.node, entry.snapshots))  # it stays in memory
            self.retire_dropped()
            self.admission.forget(lambda key: key in self.hot or key in self.pending)
            return queued

    def _admits(self, event: Event, entry, now: float) -> bool:
        retention_of = getattr(self, "retention_of", None)  # a client's retention class, where the tiers know one
        retention = retention_of(entry.key) if retention_of is not None else None
        facts = self.admission.facts(entry.key, entry.nbytes, entry.prefill_seconds, now, retention)
        return admit(event, facts, now, self.settings)

    def _within_budget(self, entry, now: float) -> bool:
        if self.admission.budget.take(entry.nbytes, now):
            return True
        if entry.key not in self._over_budget:
            self._over_budget.add(entry.key)
            self.meter.add(over_budget_nodes=1, over_budget_bytes=entry.nbytes)
        return False

    def _admitted(self, event: Event, entry) -> None:
        self.meter.add(**{f"admitted.{event}": 1, f"admitted_bytes.{event}": entry.nbytes})

    def _declined(self, entry) -> None:
        """Not written: memory no longer holds it, and its index entry goes (retire_dropped)."""
        self.meter.add(declined_nodes=1, declined_bytes=entry.nbytes)
        if entry.node is not None:
            with self.lock:
                self.dropped.append(entry.node)

    def _spill_one(self, entry) -> None:
        """A node memory evicts before it is on disk: spilled, or under admit, spilled
        if worth keeping and within the budget, else dropped."""
        if self.settings.durability != "admit":
            self._submit(self._spill_job(entry))
            return
        if self._queued(entry):
            return
        now = self.clock()
        if self._admits("evicted", entry, now) and self._within_budget(entry, now):
            self._admitted("evicted", entry)
            self._submit(self._spill_job(entry))
        else:
            self._declined(entry)

    def _spill_admitted(self) -> None:
        """At close: write what admission keeps, most valuable first, within the
        budget; what it does not keep leaves memory unwritten."""
        now = self.clock()
        entries = [e for e in self.hot.dirty_entries() if not self._queued(e)]
        kept = [e for e in entries if self._admits("shutdown", e, now)]
        kept_ids = {id(e) for e in kept}
        for entry in sorted(kept, key=self.hot.value_of, reverse=True):
            if self._within_budget(entry, now):
                self._admitted("shutdown", entry)
                self._submit(self._spill_job(entry))
            else:
                self.hot.pop(entry.key)  # not written: lost with the process, by the budget's choice
        for entry in entries:
            if id(entry) not in kept_ids:
                self.hot.pop(entry.key)
                self._declined(entry)

    def _queued(self, entry) -> bool:
        with self.lock:
            job = self.pending.get(entry.key)
        return job is not None and job.snapshots is entry.snapshots

    def _offer(self, job: SpillJob) -> bool:
        with self.lock:
            self.pending[job.node.key] = job
        if self.writer.offer(job):
            return True
        with self.lock:
            if self.pending.get(job.node.key) is job:
                del self.pending[job.node.key]
        return False

    def retire_dropped(self) -> int:
        """Remove from the index the nodes admission dropped that are still leaves
        with no file and no data here (deepest first); how many."""
        with self.lock:
            dropped, self.dropped = sorted(self.dropped, key=lambda n: -n.end), []
        retired = 0
        for node_id in dropped:
            if node_id.key in self.hot or node_id.key in self.pending:
                continue  # stored again meanwhile
            try:
                node = self.index.get(node_id.key)
                if node is None or node.id != node_id or node.record.file or not self.index.is_leaf(node.key):
                    continue
                retired += self.filing.retire(self.index.namespace(node.namespace), node_id) is not None
            except PromptStoreError:
                continue  # changed by another process: compact's dataless_nodes finds it
        return retired

    def _save_read_back(self) -> None:
        """File bytes read that no Space counted (a warm start's, of namespaces not bound here)."""
        with self.lock:
            left, self.read_back = dict(self.read_back), defaultdict(int)
        for ns_key, nbytes in left.items():
            try:
                self.index.bump(self.index.namespace(ns_key), disk_read_bytes=nbytes)
            except PromptStoreError:
                pass  # counters are advisory

    def take_read_back(self, namespace: bytes) -> int:
        """File bytes of `namespace` read since the last call (for its persistent counters)."""
        with self.lock:
            return self.read_back.pop(namespace, 0)

    # --- serving ------------------------------------------------------------------

    def has(self, node: Node) -> bool:
        """Whether the node's data is held here or named on disk (without loading it)."""
        if self.is_held(node):
            return True
        try:
            return bool(node.record.file)
        except CorruptRecordError:
            return False

    def get(self, node: Node) -> list[Snapshot] | None:
        """The node's snapshots from memory or a verified file; None is a miss."""
        return self._get(node)

    def _get(self, node: Node, retry: bool = True) -> list[Snapshot] | None:
        node, found = self._find(node)
        return found if not isinstance(found, PendingLoad) else self._finish_load(node, found, retry)

    def get_path(self, nodes: Sequence[Node]) -> tuple[list[list[Snapshot]], list[Node]]:
        """The snapshots of `nodes`, in order up to the first miss, and the nodes
        that came from disk. The files of all nodes not in memory are started
        together: MLX reads them side by side while the earlier ones are verified."""
        return self.finish_path(self.start_path(nodes))

    def start_path(self, nodes: Sequence[Node]) -> list[tuple[Node, object]]:
        """Start reading every node of `nodes` not held here (up to the first that
        cannot be read); the caller may work meanwhile, then calls finish_path."""
        found = []  # (node, its snapshots, or the load of its file); each node looked up once
        for node in nodes:
            node, held = self._find(node)
            if held is None:
                break  # a miss: nothing after it is used
            found.append((node, held))
        return found

    def finish_path(self, started: list[tuple[Node, object]]) -> tuple[list[list[Snapshot]], list[Node]]:
        """What start_path began: the verified snapshots up to the first miss, and
        the nodes read from disk."""
        out, cold = [], []
        for node, held in started:
            if isinstance(held, PendingLoad):
                held = self._finish_load(node, held)
                if held is None:
                    break
                cold.append(node)
            out.append(held)
        return out, cold

    def is_held(self, node: Node) -> bool:
        """Whether this process holds the node's snapshots (no file read needed)."""
        return self._held(node, use=False) is not None

    def file_of(self, node: Node) -> Path | None:
        """The absolute path of the node's file, None without one."""
        try:
            record = node.record
            return self.cold.absolute(record.file) if record.file else None
        except (CorruptRecordError, ColdFileError):
            return None

    def _held(self, node: Node, use: bool = True) -> list[Snapshot] | None:
        """The node's snapshots if this process holds them (hot, or queued for disk).
        use: False for a look that leaves the hot tier's order of use as it is."""
        entry = self.hot.get(node.key) if use else self.hot.entries.get(node.key)
        if entry is not None and entry.node == node.id:
            return entry.snapshots
        with self.lock:
            for jobs in (self.pending, self.stranded):
                job = jobs.get(node.key)
                if job is not None and job.node == node.id:
                    return job.snapshots
        return None

    def _find(self, node: Node) -> tuple[Node, object]:
        """The node's snapshots if held here, else the load of its file started, else
        None; with the node as last read. A spill published since `node` was read
        from the index no longer serves it from `pending`, and only the record as
        it is now names its file: the node is then looked for once more as that."""
        found = self._held(node)
        if found is None:
            found = self._start_load(node)
        if found is None and (now := self._republished(node)) is not None:
            node, found = now, self._held(now)
            if found is None:
                found = self._start_load(now)
        return node, found

    def _republished(self, node: Node) -> Node | None:
        """The node as the index has it now, when the record names a file `node`'s
        did not (a spill published, or the file replaced, since); None otherwise."""
        try:
            now = self.index.get(node.key)
            if now is None or now.id != node.id or not now.record.file:
                return None
            return now if now.record.file != node.record.file else None
        except PromptStoreError:
            return None  # a bad record is the first read's to report

    def _start_load(self, node: Node):
        """The node's file being read: one already under way (a warm start's, another
        fetch's) or a new one; None without a file."""
        try:
            record = node.record
        except CorruptRecordError as e:
            self.report("record", node.key, str(e))
            return None
        if record.file is None:
            return None
        with self.lock:
            entry = self.loading.get(node.key)
            if entry is not None and entry[:2] == (node.id, record.file):
                return entry[2]
            pending = self.cold.start_load(record.file, file_id(node))
            self.loading[node.key] = (node.id, record.file, pending)
            return pending

    def _finish_load(self, node: Node, pending, retry: bool = True) -> list[Snapshot] | None:
        """The verified snapshots of a load; whoever finishes it first reports a bad
        file or keeps the snapshots in memory. A file gone because the record names
        another now is read as that (once: `retry`), not reported."""
        try:
            snapshots = part_of(pending.result(), file_id(node), node.id)
        except ColdFileError as e:
            first = self._first_to_finish(node, pending)
            now = self._republished(node) if retry else None
            if now is not None:  # the file was replaced (and removed, maybe mid-read) since `node` was read
                return self._get(now, retry=False)
            if first:
                self._bad_file(node, e)
            return None
        if not self._first_to_finish(node, pending):
            return snapshots
        self._claims_what_it_holds(node, snapshots)
        self.counts["cold_loads"] += 1
        self._recorded_retention(node)
        self.meter.add(read_back_bytes=node.record.nbytes)
        with self.lock:
            self.read_back[node.namespace] += node.record.nbytes
        # A split's half read from the wider file it kept: it gets a file of its own
        # as the durability writes any new node (each later read is then its own).
        wider = node.record.file_node is not None
        evicted = self.hot.put(
            node.key,
            snapshots,
            prefill_seconds=node.record.prefill_seconds,
            dirty=wider,
            node=node.id,
            group=self.tenant(node.namespace),
        )
        if wider and self.settings.durability in ("sync", "write_through"):
            self._submit(SpillJob(node.id, snapshots))
        self._count_evicted(evicted)
        self._spill_evicted(evicted)
        return snapshots

    def _claims_what_it_holds(self, node: Node, snapshots: list[Snapshot]) -> None:
        """A record may say a layer is present that only memory held (a checkpoint
        filled in, a split's half made from a prompt's caches) while its file is
        an older or wider one; read back without it, the record says so, and the
        next prompt through the node fills it in again."""
        record = node.record
        held = present_layers(snapshots)
        if all(h or not ref.present for h, ref in zip(held, record.layers)):
            return
        layers = [ref.model_copy(update={"present": ref.present and h}) for ref, h in zip(record.layers, held)]
        try:
            if self.filing.refile(node.id, record.file, record.model_copy(update={"layers": layers})):
                self.counts["records_lowered"] += 1
        except PromptStoreError as e:  # a full disk: the next read says so again
            log.debug("record of node %s not lowered: %s", node.key.hex()[:12], e)

    def _first_to_finish(self, node: Node, pending) -> bool:
        with self.lock:
            entry = self.loading.get(node.key)
            if entry is None or entry[2] is not pending:
                return False
            del self.loading[node.key]
            return True

    def read_into_memory(self, nodes: Sequence[Node]) -> int:
        """Read the files of `nodes` side by side into the hot tier (a warm start);
        returns the bytes read. Bad files are quarantined and reported, as in a fetch."""
        started = [(node, self._start_load(node)) for node in nodes if not self.is_held(node)]
        done = 0
        for node, pending in started:
            if pending is not None and self._finish_load(node, pending) is not None:
                done += node.record.nbytes
        return done

    def _bad_file(self, node: Node, error: ColdFileError) -> None:
        """A miss: report it, quarantine the file, and stop pointing at it."""
        self.report(error.reason, node.key, str(error))
        self.filing.quarantine(node, error)
        if error.reason != "missing":  # a missing file is only unfiled
            self.meter.add(quarantined_files=1)

    def count(self, name: str, n: int = 1) -> None:
        """Add to one of this process's counters (healed nodes, remote tokens, ...)."""
        self.counts[name] += n

    def fetched(self, model: str, prompt_tokens: int, hit) -> None:
        """A counted fetch, for PromptStore.metrics() (Meter.fetched)."""
        self.meter.fetched(model, prompt_tokens, hit)

    def report(self, reason: str, key: bytes, detail: str) -> None:
        self.counts[f"miss_{reason}"] += 1
        self.reports.append(Report(reason, key.hex(), detail))
        log.warning("miss (%s) on node %s: %s", reason, key.hex()[:12], detail)

    # --- the writer's callbacks (writer thread) -----------------------------------

    def _publish(self, job: SpillJob) -> None:
        key = job.node.key
        self.meter.add(files_written=1, disk_written_bytes=job.ref.nbytes)  # on disk, whether named or not
        r = self.retained.of(key)
        kept = r if r is not None and r.keep_until is not None and not r.never_write else None
        try:
            if self.filing.publish(job, "both" if key in self.hot else "cold", kept):
                self.hot.mark_clean(key)
                if self.remote is not None and key not in self.quiet:
                    self.remote.submit(key)
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
            self.meter.add(unwritten_dropped_nodes=1, unwritten_dropped_bytes=_job_bytes(lost))
            self.dropped.append(lost.node)  # retire_dropped takes its index entry

    def _stranded_over_budget(self) -> list[SpillJob]:
        """What memory keeps for a disk that refuses is bounded too: past hot_bytes
        of them (a long spell), the oldest refused nodes go (lost, and counted) rather
        than the process's memory. Under self.lock."""
        total = sum(_job_bytes(j) for j in self.stranded.values())
        gone = []
        for key in list(self.stranded):
            if total <= self.settings.hot_bytes:
                break
            job = self.stranded.pop(key)
            self.refused.discard(key)
            total -= _job_bytes(job)
            gone.append(job)
        return gone

    def _retry_refused(self) -> int:
        """Offer the writer the nodes the disk refused (writer thread, after the
        back-off); returns how many wait for it, queued or not."""
        jobs = self._refused_jobs()
        for job in jobs:
            if not self._offer(job):
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

    # --- budgets and shutdown -------------------------------------------------------

    def give_way(self, busy: Callable[[], bool] | None, at_most: float = 1.0) -> None:
        """Spills pause between chunks while `busy()` is true (Writer.give_way)."""
        self.writer.give_way(busy, at_most)

    def in_memory(self) -> tuple[int, int]:
        """Nodes, and their bytes, in the hot tier."""
        return len(self.hot), self.hot.nbytes

    def hot_used(self, tenant: Hashable) -> int:
        """Bytes of a tenant's nodes in the hot tier."""
        return self.hot.used[tenant]

    def only_in_memory(self) -> dict[bytes, int]:
        """Nodes the hot tier holds that are not on disk yet and that a close spills, by key: their bytes."""
        entries = self.hot.dirty_entries()
        if self.settings.durability == "admit":
            now = self.clock()
            entries = [e for e in entries if self._admits("shutdown", e, now)]
        return {e.key: e.nbytes for e in entries}

    def metrics(self, **figures) -> StoreMetrics:
        """What the meter counted, with the tiers' sizes and remote counts; `figures`: the rest."""
        remote = self.remote.counts if self.remote is not None else {}
        nodes, nbytes = self.in_memory()
        return self.meter.snapshot(
            remote_written=remote.get("remote_published", 0),
            remote_written_bytes=remote.get("remote_published_bytes", 0),
            hot_nodes=nodes,
            hot_bytes=nbytes,
            retention=self.retention_figures(),
            compact_written_bytes=self.counts["compact_written_bytes"],
            disk=self.disk_figures(),
            **figures,
        )

    def disk_figures(self) -> DiskFigures:
        """What the disk refused, whether it refuses now, and what waits for it in memory."""
        state = self.disk.state()
        with self.lock:
            keys = list(self.refused)
            stranded = {k: j for k, j in self.stranded.items() if k in self.refused}
        waiting = [_job_bytes(j) for j in stranded.values()]
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
            self._submit(job)
        self.writer.flush()
        self.filing.settle()
        if self.remote is not None:
            self.remote.flush()  # bounded by remote_close_seconds

    def spill_all(self) -> None:
        """Put every node that is only in memory on disk (close, whatever the
        durability but admit, which writes what it keeps and drops the rest), but
        those retained in_memory: they go with the process, and so do their
        nodes, where no other node hangs under them."""
        dropped = []
        for entry in self.hot.dirty_entries():
            if self.retained.never_write(entry.key):
                self._spill_evicted([self.hot.pop(entry.key)])
                dropped.append(entry.node)
        if self.settings.durability == "admit":
            self._spill_admitted()
            self.flush()
            self.retire_dropped()
            self._unstore([n for n in dropped if n is not None])
            return
        for entry in self.hot.dirty_entries():
            with self.lock:
                queued = self.pending.get(entry.key)
            if queued is None or queued.snapshots is not entry.snapshots:  # not one already on its way
                self._submit(self._spill_job(entry))
        self.flush()
        self._unstore([n for n in dropped if n is not None])

    def _unstore(self, nodes: list[NodeId]) -> None:
        """Remove nodes whose data is nowhere from the index, deepest first; one with
        children stays (a later prompt through it stores its data again)."""
        for node in sorted(nodes, key=lambda n: -n.end):
            try:
                self.filing.retire(self.index.namespace(node.namespace), node)
            except PromptStoreError as e:
                log.debug("node %s kept in the index: %s", node.key.hex()[:12], e)

    def cold_bytes(self) -> int:
        return sum(n.record.nbytes for n in self._filed())

    def _filed(self):
        return filed(self.index.iter_by_access())

    def cold_by_tenant(self) -> dict[Hashable, list[Node]]:
        """Nodes with files, least recently used first, by tenant."""
        out = defaultdict(list)
        for node in self._filed():
            out[self.tenant(node.namespace)].append(node)
        return out

    def evict_cold(self, budget: int | None = None) -> tuple[int, int]:
        """Evict leaves with files, least valuable first, until each tenant's files
        are within `budget` (default: the setting). Returns (nodes, bytes) removed."""
        budget = self.settings.disk_bytes if budget is None else budget
        removed = freed = 0
        for tenant_nodes in self.cold_by_tenant().values():
            nodes, nbytes = evict_tenant(
                tenant_nodes,
                budget,
                self.index.is_leaf,
                self._retire,
                kept=self._kept_on_disk,
                passed_over=lambda n: self.retained.count("kept", n),
            )
            removed, freed = removed + nodes, freed + nbytes
        return removed, freed

    def _retire(self, victim: Node) -> bool:
        """Remove a leaf over its tenant's disk budget; False if another process changed it meanwhile."""
        if self.filing.retire(self.index.namespace(victim.namespace), victim.id) is None:
            return False
        self.forget(victim.key)
        self.retained.drop(victim.key)
        self.meter.evicted("cold", 1, victim.record.nbytes)
        return True

    def unwritten(self) -> tuple[int, int]:
        """Nodes, and their bytes, held in memory only: neither a file of their own
        nor one a split left them names their data. After close(), which spills
        every node, these are the ones the disk refused: lost with the process."""
        with self.lock:
            stranded = [j for k, j in self.stranded.items() if k not in self.hot]
        held = [(e.node, e.nbytes) for e in self.hot.dirty_entries()]
        held += [(j.node, sum(s.nbytes for s in j.snapshots if s is not None)) for j in stranded]
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
        if self._ticker is not None:
            self._ticker.stop()
        self.spill_all()
        self.retire_dropped()
        self.writer.close()
        self._save_read_back()
        self.filing.settle()
        if self.remote is not None:
            self.remote.close()  # waits (bounded) for queued publishes


def _job_bytes(job: SpillJob) -> int:
    return sum(s.nbytes for s in job.snapshots if s is not None)
