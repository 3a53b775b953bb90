"""Maintenance of a long-lived store: what `tools/compact` runs.

Online by design: every step but the LMDB copy works while other processes
use the store, because each one is a short index transaction that other
processes already cope with (a node they were about to read is a miss). Steps
that could take data a live process still holds in memory (dropping nodes
that have no file) and the LMDB compacting copy need the store idle: they run
only when compact gets the store's lock exclusively, and are skipped (and
reported) otherwise.

Every action is routine upkeep or a repair of damage; the report's status
(compact_report.py) says which it found: clean, repaired, or failed when a step failed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ..caches import join_nodes, present_layers
from ..errors import (
    ColdFileError,
    CorruptRecordError,
    NodeHasChildrenError,
    NodeNotFoundError,
    PromptStoreError,
    StoreDirectoryError,
)
from ..index import Index
from ..snapshots.cold import TEMP_MARK
from .compact_report import CompactReport
from .store import PromptStore

# Files younger than this may be a spill whose index entry is being written.
ORPHAN_GRACE_S = 600.0


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


def _node(key: bytes, start: int, end: int) -> str:
    return f"node {key.hex()} [{start}, {end})"


def existing_store(path: str | os.PathLike) -> Path:
    """`path` if a store lives there, else StoreDirectoryError: what only reads or
    repairs a store (compact, stats) never creates one."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise StoreDirectoryError(f"{root} is a file; expected a store directory")
    if not (root / "index" / "data.mdb").is_file():
        raise StoreDirectoryError(
            f"no store at {root} (expected a directory a store was opened in); nothing was created"
        )
    return root


class Compactor:
    """One compact run over an open store."""

    def __init__(self, store: PromptStore, report: CompactReport, tick: Callable[[str], None]):
        self.store, self.report, self.tick = store, report, tick
        self.index, self.tiers, self.files = store.index, store.tiers, store.tiers.filing
        self.dry = report.dry_run
        # Files this run unfiled (missing, or quarantined), or in a dry run would: later
        # steps treat their nodes as having none, and report each file once.
        self.unfiled: set[str] = set()

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

    def _names(self, node, rel: str) -> bool:
        """Whether the index still has `node` naming `rel`: what a step found may be
        another process's ordinary work meanwhile (an eviction, a join), not damage."""
        current = self.index.get(node.key)
        try:
            return current is not None and current.id == node.id and current.record.file == rel
        except CorruptRecordError:
            return False

    def _where(self, path: Path) -> str:
        """A path as the report names it: relative to the store."""
        return os.path.relpath(path, self.store.path)

    # --- steps ------------------------------------------------------------------------

    def strays(self) -> None:
        """What stands where a snapshot file (or a fan-out directory) belongs and is
        none, such as a directory, a FIFO or a symlink: moved to quarantine, never
        read, followed or deleted."""
        for rel, kind in list(self.files.strays()):
            if not self.dry and not self.files.set_aside(rel):
                continue  # gone meanwhile
            self.report.add("quarantine", self._where(self.files.path(rel)), f"stray {kind}", files=1)
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
            self.report.add("delete", self._where(path), "temporary files", files=1, nbytes=size)
            self.tick("temporary files")

    def children_entries(self) -> None:
        """Children entries that lead nowhere or to the wrong node (and sound nodes
        none leads to): rebuilt from the nodes' own headers. A lookup stops at such
        an entry and an insert through it is refused, run after run, until then."""
        changed = self.index.repair_children(dry_run=self.dry)
        if changed:
            self.report.add("rebuild", "index: children entries", "children entries", nodes=changed)
            self.tick("children entries")

    def dangling_entries(self) -> None:
        """Index entries whose file is missing: they point at nothing."""
        for rel, node in self._filed().items():
            if self.files.path(rel).exists():
                continue
            if self.dry:
                if not (self._names(node, rel) and not self.files.path(rel).exists()):
                    continue  # evicted or re-filed meanwhile
            elif not self.files.unfile(node.id, rel):
                continue
            self.unfiled.add(rel)
            self.report.add("unfile", self._where(self.files.path(rel)), "missing files", nodes=1)
            self.tick("missing files")

    def corrupt_records(self) -> None:
        """Index records that fail their checksum block inserts through them:
        drop them with their subtree (the files become orphans, reclaimed next)."""
        for key in self.index.corrupt_nodes():
            removed = 1 if self.dry else self.index.drop_subtree(key)
            self.report.add("drop", f"node {key.hex()} and its subtree", "corrupt index records", nodes=removed)
            self.tick("corrupt index records")

    def verify(self) -> None:
        """Read every file and check it; bad ones are quarantined, never deleted."""
        for rel, node in self._filed().items():
            if rel not in self.unfiled:
                self._load(node, rel)
            self.tick("verify")

    def _load(self, node, rel: str) -> list | None:
        """The node's snapshots, read from its file and verified. A bad file is damage,
        whichever step reads it: quarantined (in a dry run: would be) and reported.
        Never through the tiers, which would repair unreported, even in a dry run."""
        try:
            return self.files.load(rel, node)
        except ColdFileError as e:
            if rel in self.unfiled or not self._names(node, rel):
                return None  # reported already, or evicted or merged while it was read
            try:
                size = self.files.path(rel).stat().st_size
            except OSError:
                size = 0
            if not self.dry:
                self.files.quarantine(node, e)
            self.unfiled.add(rel)
            where = self._where(self.files.path(rel))
            self.report.add("quarantine", where, f"failed verify ({e.reason})", nodes=1, files=1, nbytes=size)
            return None

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
            self.report.add("delete", self._where(path), "orphan files", files=1, nbytes=size)
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
                        filed = bool(node.record.file) and node.record.file not in self.unfiled
                    except CorruptRecordError:
                        filed = False
                    if filed or not self.index.is_leaf(node.key):
                        continue
                    if not self.dry:
                        try:
                            self.index.remove(ns, node.key)
                        except (NodeHasChildrenError, NodeNotFoundError):
                            continue
                        changed = True
                    self.report.add("drop", _node(node.key, node.start, node.end), "nodes without data", nodes=1)

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
        if node.record.nbytes + child.record.nbytes > self.store.settings.node_bytes:
            return False  # a chain of nodes of about node_bytes reads side by side
        if not (node.record.file and child.record.file):
            return False  # data only in another process's memory: it files it
        upper = self._load(node, node.record.file)
        lower = None if upper is None else self._load(child, child.record.file)
        if upper is None or lower is None:
            return False
        layers = join_nodes(upper, lower, node.start)
        if layers is None:
            return False
        joined = _node(node.key, node.start, child.end)
        if self.dry:
            self.report.add("merge", joined, "merged chains", nodes=1, files=1)
            return False
        kept = max((node.record, child.record), key=lambda r: r.keep_until or 0.0)  # the longer retention
        record = child.record.model_copy(
            update={
                "retention": kept.retention,
                "keep_until": kept.keep_until,
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
        self.report.add("merge", joined, "merged chains", nodes=1, files=1)
        return True

    def budget(self, max_bytes: int) -> None:
        """Evict leaves, least valuable first, until each tenant's files fit `max_bytes`."""
        tenants = self.tiers.budget.by_tenant().values()
        over = sum(max(sum(n.record.nbytes for n in nodes) - max_bytes, 0) for nodes in tenants)
        if not over:
            return
        target = f"snapshot files over {max_bytes} bytes per tenant"
        if self.dry:
            self.report.add("evict", target, "over budget", nbytes=over)
            return
        nodes, freed = self.tiers.budget.evict(max_bytes)
        self.report.add("evict", target, "over budget", nodes=nodes, files=nodes, nbytes=freed)

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
                self.report.add("recount", f"namespace {ns.hex}", "counters", nodes=len(drift))

    def remote_ledger(self) -> None:
        """With a remote tier: forget published blobs the server no longer has, and
        report what this store published and what of it is stale."""
        if not self.dry:
            dropped = self.tiers.remote.prune_ledger()
            if dropped:
                self.report.add("forget", "remote ledger", "remote blobs gone from the server", files=dropped)
        self.report.remote = self.tiers.remote.summary(lambda key: self.index.get(key) is not None)

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
    A path where no store lives raises StoreDirectoryError, and nothing is created.

    dry_run: find and report everything, change nothing (the status means what a run's would).
    reset_index: an index that opening refuses as damaged (IndexCorruptError) is moved
    aside and an empty one started; its snapshot files are then reclaimed as orphans.
    """
    path = existing_store(path)
    report = CompactReport(dry_run=dry_run)
    started = time.perf_counter()
    if reset_index:
        _reset_index(path, report)
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
            kept = Path(moved).name
            report.add("set aside", f"index (kept as {kept})", f"damaged index set aside (kept as {kept})", files=1)


def _compact_lmdb(root: Path, report: CompactReport) -> None:
    """A compacting copy of the index swapped in, under the store's exclusive lock."""
    with PromptStore.lock(root, exclusive=True, blocking=False) as held:
        if not held:
            report.skipped.append("LMDB compaction (the store is in use)")
            return
        report.add("compact", "index", "LMDB space", nbytes=Index.compact_in_place(root / "index"))
