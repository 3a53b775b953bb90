"""Filing: the one owner of a node's life on disk.

Every change to which cold file a node's record names goes through here:
publishing a spilled file, re-filing a node whose snapshots changed, splitting,
joining, retiring. One staleness rule guards each change (the stored node still
has the identity it was read with, and its record still names the file it named
then), and a file is removed only after the index transaction that stops naming
it has committed: a crash in between leaves an orphan for compact, never a
record that names nothing. On the insert path (a split's old file, a file
re-filed away) the removal runs on a thread of its own: unlinking a 630 MB file
the page cache holds takes 120 ms, time a generation thread must not wait.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from ..caches import Snapshot, cut_node
from ..errors import (
    ColdFileError,
    CorruptRecordError,
    DiskWriteError,
    IndexDiskError,
    NodeHasChildrenError,
    NodeNotFoundError,
    PromptStoreError,
    StaleInsertError,
)
from ..identity import NodeId
from ..index import FileNode, Index, InsertPlan, InsertResult, Namespace, Node, NodeRecord
from ..snapshots import ColdTier, SpillJob
from ..snapshots.pool import ProcessPool
from .retention import Retention, record_fields

log = logging.getLogger("promptstore.store")

# The exceptions that mean "the node is not what it was when read": the change is dropped.
STALE = (StaleInsertError, NodeNotFoundError, CorruptRecordError)

_removing = ProcessPool(1, "promptstore-remove")  # files no record names, removed off the insert path


def unchanged(node: NodeId, file: str | None) -> Callable[[Node], bool]:
    """The staleness rule: the stored node has this identity and its record names `file`."""
    return lambda n: n.id == node and n.record.file == file


def file_id(node: Node) -> NodeId:
    """The node the file its record names was written for: itself, or (a split's
    half, until it has a file of its own) the wider node it was part of."""
    wider = node.record.file_node
    if wider is None:
        return node.id
    return NodeId(bytes.fromhex(wider.key), node.namespace, wider.start, wider.end)


def part_of(snapshots: list[Snapshot], file: NodeId, node: NodeId) -> list[Snapshot]:
    """The node's part of snapshots read from a file written for `file` (its span
    holds the node's): window and range layers cut to the node's span, a
    recurrent state only where the node ends where the file does."""
    if (file.start, file.end) == (node.start, node.end):
        return snapshots
    cuts = [p for p in (node.start, node.end) if file.start < p < file.end]
    part = cut_node(snapshots, cuts)[1 if node.start > file.start else 0]
    mx.eval([a for s in part if s is not None for a in s.all_arrays()])  # other threads (the writer) use them
    return part


class Filing:
    """Publishes, re-files and retires the cold files of one store's nodes."""

    def __init__(self, index: Index, cold: ColdTier, counts: Counter):
        self.index, self.cold, self.counts = index, cold, counts
        self._removals: list = []  # removals handed to the removing thread, not yet waited for
        self._removals_lock = threading.Lock()

    @contextmanager
    def after_commit(self, later: bool = False) -> Iterator[list[str]]:
        """Yields a list of files to remove once the block (an index transaction)
        has committed; if it raises, nothing is removed. `later`: removed on the
        removing thread (`settle` waits for them)."""
        doomed: list[str] = []
        yield doomed
        doomed = [rel for rel in doomed if rel]
        if doomed and later:
            future = _removing().submit(self._remove, doomed)
            with self._removals_lock:
                self._removals = [f for f in self._removals if not f.done()] + [future]
            return
        for rel in doomed:
            self.cold.delete(rel)

    def _remove(self, doomed: list[str]) -> None:
        for rel in doomed:
            try:
                self.cold.delete(rel)
            except OSError as e:  # an orphan for compact, as after a crash
                log.warning("could not remove %s, which no record names: %s", rel, e)

    def settle(self) -> None:
        """Wait until every file handed to the removing thread is gone."""
        with self._removals_lock:
            pending, self._removals = self._removals, []
        for future in pending:
            future.result()

    # --- naming files -------------------------------------------------------------

    def publish(self, job: SpillJob, tier: str, kept: Retention | None = None) -> bool:
        """Name the file a spill wrote in its node's record (tier: "cold", or "both"
        while memory holds it too), with how long it is `kept` (retention). A node
        that was split, joined or removed meanwhile does not get it, and the file goes."""
        ref = job.ref
        try:
            node = self.index.get(job.node.key)
            if node is None or node.id != job.node:
                raise NodeNotFoundError(f"node {job.node} changed before its spill was published")
            old = node.record.file
            update = {"file": ref.path, "file_node": None, "nbytes": ref.nbytes, "checksum": ref.checksum, "tier": tier}
            if kept is not None:
                update.update(record_fields(kept, node.record.keep_until))
            record = node.record.model_copy(update=update)
            if job.present is not None:  # the file holds less than the node did in memory
                layers = [r.model_copy(update={"present": p}) for r, p in zip(record.layers, job.present)]
                record = record.model_copy(update={"layers": layers})
            with self.after_commit(later=True) as doomed:  # a replaced file goes off the writing thread
                written = {"disk_written_bytes": ref.nbytes}  # counted with the record that names the file
                self.index.update_record(job.node.key, record, expect=unchanged(job.node, old), bump=written)
                doomed.append(old if old != ref.path else None)
        except STALE:
            self.cold.delete(ref.path)  # never named: it is not the node's file
            self.counts["spills_dropped"] += 1
            return False
        except IndexDiskError as e:  # written, but the index cannot name it: a refused write
            self.cold.delete(ref.path)
            raise DiskWriteError(f"the index could not name {ref.path}: {e}") from e
        self.counts["spills"] += 1
        return True

    def refile(self, node: NodeId, old_file: str | None, record: NodeRecord) -> bool:
        """Replace the record of a node that still names `old_file` (a checkpoint
        filled in, data healed); the old file goes once no record names it."""
        try:
            with self.after_commit(later=True) as doomed:
                self.index.update_record(node.key, record, expect=unchanged(node, old_file))
                doomed.append(old_file if old_file != record.file else None)
        except STALE:
            return False
        return True

    def unfile(self, node: NodeId, file: str) -> bool:
        """Stop the record naming `file` (missing, or quarantined by the caller)."""
        try:
            current = self.index.get(node.key)
            if current is None:
                return False
            record = current.record.model_copy(
                update={"file": None, "file_node": None, "checksum": None, "tier": "hot"}
            )
            self.index.update_record(node.key, record, expect=unchanged(node, file))
        except (*STALE, IndexDiskError):
            return False  # still named: the next read finds it bad (or missing) again
        return True

    def commit_insert(self, plan: InsertPlan, record: NodeRecord | None, split_records) -> InsertResult:
        """The index's commit_insert; a split node's old file goes after it (on the
        removing thread) unless a half names it. A second name made for a half
        (split_files) goes if the commit does not happen."""
        links = [] if split_records is None else [r.file for r in split_records if r.file_node is not None]
        try:
            with self.after_commit(later=True) as doomed:
                result = self.index.commit_insert(plan, record, split_records)
                doomed.extend(result.unnamed)
        except BaseException:
            for rel in links:
                if rel != _file_or_none(plan.match.path[-1]):
                    self.cold.delete(rel)
            raise
        return result

    def split_files(self, node: Node, at: int) -> tuple[dict, dict]:
        """What the records of a filed node's two halves, [start, at) and [at, end),
        say of files until each has one of its own: the lower half keeps naming
        the node's file, the upper a second name for it (ColdTier.link), both
        reading their part. Nothing for a node without a file, or where the
        filesystem gives no second name (the upper half then has no file until
        its own is written, as any new node)."""
        record = node.record
        if not record.file:
            return {}, {}
        wider = file_id(node)
        fields = {"file_node": FileNode(key=wider.key.hex(), start=wider.start, end=wider.end), "tier": "both"}
        lower = {"file": record.file, "checksum": record.checksum, **fields}
        link = self.cold.link(record.file, wider)
        return ({"file": link, "checksum": record.checksum, **fields} if link else {}), lower

    def join(self, ns: Namespace, node: Node, child: Node, snapshots: list[Snapshot], record: NodeRecord) -> bool:
        """Write the joined snapshots and replace node and child by one node; both old
        files go after the join commits. `record` is filled in with the new file."""
        ref = self.cold.write(NodeId(child.key, node.namespace, node.start, child.end), snapshots)
        record = record.model_copy(
            update={"file": ref.path, "file_node": None, "nbytes": ref.nbytes, "checksum": ref.checksum}
        )
        try:
            with self.after_commit() as doomed:
                _, unnamed = self.index.join_child(ns, node.key, record, expect=(node, child))
                doomed.extend(unnamed)
        except (NodeHasChildrenError, *STALE):
            self.cold.delete(ref.path)  # the trie changed under us: keep it as it is
            return False
        self.counts["compact_written_bytes"] += ref.nbytes
        try:
            self.index.bump(ns, compact_written_bytes=ref.nbytes)
        except PromptStoreError:
            pass  # counters are advisory
        return True

    # --- retiring files -------------------------------------------------------------

    def retire(self, ns: Namespace, node: NodeId) -> Node | None:
        """Remove a leaf from the index, then its file. None if it is no leaf now."""
        try:
            with self.after_commit() as doomed:
                removed = self.index.remove(ns, node.key)
                doomed.append(_file_or_none(removed))
        except (NodeHasChildrenError, NodeNotFoundError):
            return None
        return removed

    def quarantine(self, node: Node, error: ColdFileError) -> None:
        """A bad file: moved aside (when it is a name this tier gives to the files
        of the node it was written for, never any file a record happens to name),
        and unnamed."""
        if error.reason != "missing" and error.path and self.cold.owns(error.path, file_id(node)):
            self.cold.quarantine(error.path)
        if error.path:
            self.unfile(node.id, error.path)

    def discard(self, rel: str) -> None:
        """Remove a file no record names (an orphan)."""
        self.cold.delete(rel)

    def set_aside(self, rel: str) -> bool:
        """Move what stands where a file belongs and is none (see strays) to quarantine."""
        return self.cold.quarantine(rel, stray=True) is not None

    # --- what is on disk --------------------------------------------------------------

    def files(self) -> Iterator[tuple[str, int]]:
        return self.cold.iter_files()

    def temp_files(self) -> Iterator[Path]:
        return self.cold.iter_temp_files()

    def strays(self) -> Iterator[tuple[str, str]]:
        return self.cold.iter_strays()

    def path(self, rel: str) -> Path:
        return self.cold.root / rel

    def load(self, rel: str, node: Node) -> list[Snapshot]:
        """The verified snapshots of the node's file `rel` (its part of a wider one)."""
        wider = file_id(node)
        return part_of(self.cold.load(rel, wider), wider, node.id)


def _file_or_none(node: Node) -> str | None:
    try:
        return node.record.file
    except CorruptRecordError:
        return None


def filed(nodes: Iterable[Node]) -> Iterator[Node]:
    """The nodes whose record names a file (unreadable records skipped)."""
    for node in nodes:
        try:
            if node.record.file:
                yield node
        except CorruptRecordError:
            continue
