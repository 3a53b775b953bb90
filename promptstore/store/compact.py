"""Maintenance of a long-lived store: what `tools/compact` runs.

Online by design: every step but the LMDB copy works while other processes
use the store, because each one is a short index transaction that other
processes already cope with (a node they were about to read is a miss). Steps
that could take data a live process still holds in memory (dropping nodes
that have no file) and the LMDB compacting copy need the store idle: they run
only when compact gets the store's lock exclusively, and are skipped (and
reported) otherwise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..caches import join_nodes, present_layers
from ..errors import (
    ColdFileError,
    CorruptRecordError,
    NodeHasChildrenError,
    NodeNotFoundError,
    PromptStoreError,
)
from ..index import Index
from ..snapshots.cold import TEMP_MARK
from ..snapshots.remote.tier import prune_ledger
from .store import PromptStore

# Files younger than this may be a spill whose index entry is being written.
ORPHAN_GRACE_S = 600.0


@dataclass
class CompactReport:
    """What compact found and did (or, in a dry run, would do)."""

    dry_run: bool
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    actions: dict = field(default_factory=dict)  # reason -> {"nodes", "files", "bytes"}
    skipped: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    seconds: float = 0.0
    remote: dict | None = None  # with a remote tier: what this store published, what is stale

    def add(self, reason: str, nodes: int = 0, files: int = 0, nbytes: int = 0) -> None:
        row = self.actions.setdefault(reason, {"nodes": 0, "files": 0, "bytes": 0})
        row["nodes"] += nodes
        row["files"] += files
        row["bytes"] += nbytes

    @property
    def changed(self) -> bool:
        return any(any(v for v in row.values()) for row in self.actions.values())

    @property
    def status(self) -> str:
        """clean (nothing to do), repaired (changes made or due), failed."""
        if self.errors:
            return "failed"
        return "repaired" if self.changed else "clean"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _temp_pid(path: Path) -> int | None:
    try:
        return int(path.name.split(TEMP_MARK, 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return None


class Compactor:
    """One compact run over an open store."""

    def __init__(self, store: PromptStore, report: CompactReport, tick: Callable[[str], None]):
        self.store, self.report, self.tick = store, report, tick
        self.index, self.tiers, self.files = store.index, store.tiers, store.tiers.filing
        self.dry = report.dry_run

    # --- inventory ------------------------------------------------------------------

    def inventory(self) -> dict:
        nodes = files = nbytes = 0
        for ns in self.index.namespaces():
            for _node in self.index.iter_nodes(ns):
                nodes += 1
        for _, size in self.files.files():
            files += 1
            nbytes += size
        return {"nodes": nodes, "files": files, "bytes": nbytes}

    def _filed(self) -> dict[str, object]:
        """Index nodes by the file they name."""
        out = {}
        for ns in self.index.namespaces():
            for node in self.index.iter_nodes(ns):
                try:
                    if node.record.file:
                        out[node.record.file] = node
                except CorruptRecordError:
                    continue
        return out

    # --- steps ------------------------------------------------------------------------

    def strays(self) -> None:
        """What stands where a snapshot file (or a fan-out directory) belongs and is
        none, such as a directory, a FIFO or a symlink: moved to quarantine, never
        read, followed or deleted."""
        for rel, kind in list(self.files.strays()):
            if not self.dry and not self.files.set_aside(rel):
                continue  # gone meanwhile
            self.report.add(f"stray {kind}", files=1)
            self.tick("strays")

    def temp_files(self) -> None:
        """Spill files a dead writer left under their temporary names."""
        for path in list(self.files.temp_files()):
            pid = _temp_pid(path)
            if pid is not None and (pid == os.getpid() or _pid_alive(pid)):
                continue  # still being written (by another process, or this one's writer)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            if not self.dry:
                path.unlink(missing_ok=True)
            self.report.add("temporary files", files=1, nbytes=size)
            self.tick("temporary files")

    def children_entries(self) -> None:
        """Children entries that lead nowhere or to the wrong node (and sound nodes
        none leads to): rebuilt from the nodes' own headers. A lookup stops at such
        an entry and an insert through it is refused, run after run, until then."""
        changed = self.index.repair_children(dry_run=self.dry)
        if changed:
            self.report.add("children entries", nodes=changed)
            self.tick("children entries")

    def dangling_entries(self) -> None:
        """Index entries whose file is missing: they point at nothing."""
        for rel, node in self._filed().items():
            if self.files.path(rel).exists():
                continue
            if not self.dry:
                self.files.unfile(node.id, rel)
            self.report.add("missing files", nodes=1)
            self.tick("missing files")

    def corrupt_records(self) -> None:
        """Index records that fail their checksum block inserts through them:
        drop them with their subtree (the files become orphans, reclaimed next)."""
        for key in self.index.corrupt_nodes():
            if self.dry:
                self.report.add("corrupt index records", nodes=1)
                continue
            removed = self.index.drop_subtree(key)
            self.report.add("corrupt index records", nodes=removed)
            self.tick("corrupt index records")

    def verify(self) -> None:
        """Read every file and check it; bad ones are quarantined, never deleted."""
        for rel, node in self._filed().items():
            try:
                self.files.load(rel, node.id)
            except ColdFileError as e:
                try:
                    size = self.files.path(rel).stat().st_size
                except OSError:
                    size = 0
                if not self.dry:
                    self.files.quarantine(node.id, e)
                self.report.add(f"failed verify ({e.reason})", nodes=1, files=1, nbytes=size)
            self.tick("verify")

    def orphan_files(self) -> None:
        """Files no index entry names (a crash between writing and publishing, or
        between unpublishing and deleting)."""
        named = set(self._filed())
        now = time.time()
        for rel, size in list(self.files.files()):
            if rel in named:
                continue
            path = self.files.path(rel)
            try:
                if now - path.stat().st_mtime < ORPHAN_GRACE_S and not self.idle:
                    continue  # possibly a spill about to be published
            except FileNotFoundError:
                continue
            if not self.dry:
                self.files.discard(rel)
            self.report.add("orphan files", files=1, nbytes=size)
            self.tick("orphan files")

    def dataless_nodes(self) -> None:
        """Leaves with no file: after a crash their data is nowhere. Idle store only:
        a live process may hold them in memory."""
        if not self.idle:
            self.report.skipped.append("nodes without files (the store is in use)")
            return
        changed = True
        while changed:
            changed = False
            for ns in self.index.namespaces():
                for node in list(self.index.iter_nodes(ns)):
                    try:
                        filed = bool(node.record.file)
                    except CorruptRecordError:
                        filed = False
                    if filed or not self.index.is_leaf(node.key):
                        continue
                    if self.dry:
                        self.report.add("nodes without data", nodes=1)
                        continue
                    try:
                        self.index.remove(ns, node.key)
                    except (NodeHasChildrenError, NodeNotFoundError):
                        continue
                    self.report.add("nodes without data", nodes=1)
                    changed = True

    def merge_chains(self) -> None:
        """Runs of single-child nodes (a conversation inserted turn by turn) become
        one node with one file, so a fetch reads fewer files. Branch points stay."""
        merged = True
        while merged:
            merged = False
            for ns in self.index.namespaces():
                for listed in list(self.index.iter_nodes(ns)):
                    node = self.index.get(listed.key)  # earlier joins change spans
                    if node is None or (node.start, node.end) != (listed.start, listed.end):
                        continue
                    kids = self.index.children(node.key)
                    # A damaged children entry may point anywhere: join only a true child.
                    linked = len(kids) == 1 and (kids[0].parent, kids[0].start) == (node.key, node.end)
                    if linked and self._join(ns, node, kids[0]):
                        merged = True
                        self.tick("merge chains")

    def _join(self, ns, node, child) -> bool:
        if node.record.nbytes + child.record.nbytes > self.tiers.settings.node_bytes:
            return False  # a chain of nodes of about node_bytes reads side by side
        upper, lower = self.tiers.get(node), self.tiers.get(child)
        if upper is None or lower is None:
            return False
        layers = join_nodes(upper, lower, node.start)
        if layers is None:
            return False
        if self.dry:
            self.report.add("merged chains", nodes=1, files=1)
            return False
        record = child.record.model_copy(
            update={
                "layers": [
                    r.model_copy(update={"present": p, "nbytes": 0 if s is None else s.nbytes})
                    for r, s, p in zip(child.record.layers, layers, present_layers(layers))
                ],
                "tier": "cold",
                "prefill_seconds": node.record.prefill_seconds + child.record.prefill_seconds,
                "hits": max(node.record.hits, child.record.hits),
            }
        )
        if not self.files.join(ns, node, child, layers, record):
            return False
        self.tiers.forget(node.key)
        self.tiers.forget(child.key)
        self.report.add("merged chains", nodes=1, files=1)
        return True

    def budget(self, max_bytes: int) -> None:
        """Evict leaves, least valuable first, until each tenant's files fit `max_bytes`."""
        tenants = self.tiers.cold_by_tenant().values()
        over = sum(max(sum(n.record.nbytes for n in nodes) - max_bytes, 0) for nodes in tenants)
        if not over:
            return
        if self.dry:
            self.report.add("over budget", nbytes=over)
            return
        nodes, freed = self.tiers.evict_cold(max_bytes)
        self.report.add("over budget", nodes=nodes, files=nodes, nbytes=freed)

    def counters(self) -> None:
        """Bring the per-namespace totals back to what the trie holds."""
        for ns in self.index.namespaces():
            actual = {"nodes": 0, "nbytes": 0, "tokens_stored": 0}
            for node in self.index.iter_nodes(ns):
                actual["nodes"] += 1
                actual["nbytes"] += node.nbytes
                actual["tokens_stored"] += node.end - node.start
            stored = self.index.counters(ns)
            drift = {k: v - stored.get(k, 0) for k, v in actual.items() if v != stored.get(k, 0)}
            if drift:
                if not self.dry:
                    self.index.bump(ns, **drift)
                self.report.add("counters", nodes=len(drift))

    def remote_ledger(self) -> None:
        """With a remote tier: forget published blobs the server no longer has, and
        report what this store published and what of it is stale."""
        remote = self.tiers.remote
        if remote is None:
            return
        if not self.dry and remote.available():
            dropped = prune_ledger(self.store.path, remote.client)
            if dropped:
                self.report.add("remote blobs gone from the server", files=dropped)
        self.report.remote = remote.summary(lambda key: self.index.get(key) is not None)

    @property
    def idle(self) -> bool:
        return self.store.exclusive


def compact(
    path: str | os.PathLike,
    *,
    max_bytes: int | None = None,
    verify: bool = False,
    dry_run: bool = False,
    lmdb: bool = True,
    merge: bool = True,
    reset_index: bool = False,
    tick: Callable[[str], None] = lambda step: None,
) -> CompactReport:
    """Repair and shrink the store at `path`; see the module docstring for what runs when.

    reset_index: an index that opening refuses as damaged (IndexCorruptError) is moved
    aside and an empty one started; its snapshot files are then reclaimed as orphans.
    """
    report = CompactReport(dry_run=dry_run)
    started = time.perf_counter()
    if reset_index:
        _reset_index(Path(path), report)
        if dry_run and report.actions:
            report.seconds = time.perf_counter() - started
            return report  # the rest would run on an index that is not there yet
    with PromptStore.open(path, hot_bytes=0) as store:
        store.try_exclusive()
        work = Compactor(store, report, tick)
        report.before = work.inventory()
        steps = [work.strays, work.temp_files, work.corrupt_records, work.children_entries, work.dangling_entries]
        if verify:
            steps.append(work.verify)
        steps += [work.dataless_nodes, work.orphan_files]
        if merge:
            steps.append(work.merge_chains)
        if max_bytes is not None:
            steps.append(lambda: work.budget(max_bytes))
        steps.append(work.counters)
        steps.append(work.remote_ledger)
        for step in steps:
            try:
                step()
            except PromptStoreError as e:
                report.errors.append(f"{getattr(step, '__name__', 'budget')}: {e}")
        idle = store.exclusive
    if lmdb and not dry_run:
        if idle:
            _compact_lmdb(Path(path), report)
        else:
            report.skipped.append("LMDB compaction (the store is in use)")
    with PromptStore.open(path, hot_bytes=0) as store:
        report.after = Compactor(store, report, tick).inventory()
    report.seconds = time.perf_counter() - started
    return report


def _reset_index(root: Path, report: CompactReport) -> None:
    """Set a damaged index aside, under the store's exclusive lock."""
    with PromptStore.lock(root, exclusive=True, blocking=False) as held:
        if not held:
            report.errors.append("reset index: the store is in use; run again when it is idle")
            return
        moved = Index.set_aside(root / "index", dry_run=report.dry_run)
        if moved is not None:
            report.add(f"damaged index set aside (kept as {Path(moved).name})", files=1)


def _compact_lmdb(root: Path, report: CompactReport) -> None:
    """A compacting copy of the index swapped in, under the store's exclusive lock."""
    with PromptStore.lock(root, exclusive=True, blocking=False) as held:
        if not held:
            report.skipped.append("LMDB compaction (the store is in use)")
            return
        report.add("LMDB space", nbytes=Index.compact_in_place(root / "index"))
