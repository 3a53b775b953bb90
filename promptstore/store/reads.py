"""Reads: a node's snapshots from where this process holds them, or from its
verified file, and a restore's read of a whole trie path (`PathRead`).

A file is read once however many ask for it meanwhile (a warm start, fetches);
the first to finish a read keeps the snapshots in memory or reports a bad file
(quarantined, unnamed: a miss, never an exception). A split's half reads its
part of the wider file it kept until it has its own.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..caches import Snapshot, present_layers
from ..errors import ColdFileError, CorruptRecordError, PromptStoreError
from ..identity import NodeId
from ..index import Index, Node
from ..snapshots import ColdTier, HotTier
from ..snapshots.cold import PendingLoad
from .filing import Filing, file_id, part_of
from .keeping import Keeping
from .metrics import Meter
from .spills import Spills

log = logging.getLogger("promptstore.store")


@dataclass
class PathRead:
    """A restore's read of one trie path: how many of its first nodes this
    process holds, the rest's files and sizes, the reads begun and finished."""

    reads: Reads
    nodes: list[Node]
    held: int = 0  # the leading nodes held in memory (no file read needed)
    begun: list = field(default_factory=list)

    def files(self, first: int) -> list[tuple[Node, int, Path | None]]:
        """(node, file bytes, its path) of nodes[first:]: 0 bytes for one held here."""
        out = []
        for node in self.nodes[first:]:
            try:
                nbytes = 0 if self.reads.is_held(node) else node.record.nbytes
            except CorruptRecordError:
                nbytes = 0  # the read reports it
            out.append((node, nbytes, self.reads.file_of(node) if nbytes else None))
        return out

    def start(self, first: int = 0, upto: int | None = None) -> PathRead:
        """Begin reading nodes[first:upto] (up to the first that cannot be read); the
        caller may work meanwhile, then calls finish."""
        self.begun = self.reads.start(self.nodes[first:upto])
        return self

    def finish(self) -> tuple[list[list[Snapshot]], list[Node]]:
        """What start began: the verified snapshots up to the first miss, and the
        nodes read from disk."""
        return self.reads.finish(self.begun)

    def snapshots(self, upto: int | None = None) -> tuple[list[list[Snapshot]], list[Node]]:
        """Read nodes[:upto] at once (start, then finish)."""
        return self.start(0, upto).finish()

    def restored_at(self, node: Node) -> None:
        """A restore ended at this node's end: its states are worth keeping."""
        self.reads.restored_at(node.key)


class Reads:
    """The reads of one store's nodes in this process.

    hold: keeps a node's snapshots read from disk in memory (Tiers.hold).
    report: a miss an operator should know of.
    """

    def __init__(
        self,
        index: Index,
        cold: ColdTier,
        hot: HotTier,
        filing: Filing,
        spills: Spills,
        keeping: Keeping,
        meter: Meter,
        counts: Counter,
        hold: Callable[[Node, list[Snapshot]], None],
        report: Callable[[str, bytes, str], None],
    ):
        self.index, self.cold, self.hot, self.filing, self.spills = index, cold, hot, filing, spills
        self.keeping, self.meter, self.counts, self.hold, self.report = keeping, meter, counts, hold, report
        self.lock = threading.Lock()
        self.loading: dict[bytes, tuple[NodeId, str, PendingLoad]] = {}  # files being read, by node
        self.read_back: defaultdict[bytes, int] = defaultdict(int)  # file bytes read, by namespace, not yet counted

    # --- one node ---------------------------------------------------------------------

    def get(self, node: Node, retry: bool = True) -> list[Snapshot] | None:
        """The node's snapshots from memory or a verified file; None is a miss."""
        node, found = self._find(node)
        return found if not isinstance(found, PendingLoad) else self._finish_load(node, found, retry)

    def is_held(self, node: Node) -> bool:
        """Whether this process holds the node's snapshots (no file read needed)."""
        return self._held(node, use=False) is not None

    def has(self, node: Node) -> bool:
        """Whether the node's data is held here or named on disk (without loading it)."""
        if self.is_held(node):
            return True
        try:
            return bool(node.record.file)
        except CorruptRecordError:
            return False

    def file_of(self, node: Node) -> Path | None:
        """The absolute path of the node's file, None without one."""
        try:
            record = node.record
            return self.cold.absolute(record.file) if record.file else None
        except (CorruptRecordError, ColdFileError):
            return None

    def restored_at(self, key: bytes) -> None:
        with self.hot.lock:
            entry = self.hot.entries.get(key)
            if entry is not None:
                entry.restores += 1

    # --- several nodes ----------------------------------------------------------------

    def path(self, nodes: Sequence[Node]) -> PathRead:
        """A read of a trie path, for a restore (PathRead)."""
        read = PathRead(self, list(nodes))
        while read.held < len(read.nodes) and self.is_held(read.nodes[read.held]):
            read.held += 1
        return read

    def start(self, nodes: Sequence[Node]) -> list[tuple[Node, object]]:
        """Start reading every node of `nodes` not held here (up to the first that
        cannot be read): MLX reads the files side by side."""
        found = []  # (node, its snapshots, or the load of its file); each node looked up once
        for node in nodes:
            node, held = self._find(node)
            if held is None:
                break  # a miss: nothing after it is used
            found.append((node, held))
        return found

    def finish(self, started: list[tuple[Node, object]]) -> tuple[list[list[Snapshot]], list[Node]]:
        out, cold = [], []
        for node, held in started:
            if isinstance(held, PendingLoad):
                held = self._finish_load(node, held)
                if held is None:
                    break
                cold.append(node)
            out.append(held)
        return out, cold

    def into_memory(self, nodes: Sequence[Node]) -> int:
        """Read the files of `nodes` side by side into the hot tier (a warm start);
        returns the bytes read. Bad files are quarantined and reported, as in a fetch."""
        started = [(node, self._start_load(node)) for node in nodes if not self.is_held(node)]
        done = 0
        for node, pending in started:
            if pending is not None and self._finish_load(node, pending) is not None:
                done += node.record.nbytes
        return done

    # --- the bytes read back ------------------------------------------------------------

    def take_read_back(self, namespace: bytes) -> int:
        """File bytes of `namespace` read since the last call (for its persistent counters)."""
        with self.lock:
            return self.read_back.pop(namespace, 0)

    def save_read_back(self) -> None:
        """File bytes read that no Space counted (a warm start's, of namespaces not bound here)."""
        with self.lock:
            left, self.read_back = dict(self.read_back), defaultdict(int)
        for ns_key, nbytes in left.items():
            try:
                self.index.bump(self.index.namespace(ns_key), disk_read_bytes=nbytes)
            except PromptStoreError:
                pass  # counters are advisory

    # --- finding and loading --------------------------------------------------------------

    def _held(self, node: Node, use: bool = True) -> list[Snapshot] | None:
        """The node's snapshots if this process holds them (hot, or on their way to
        disk). use: False for a look that leaves the hot tier's order of use as it is."""
        entry = self.hot.get(node.key) if use else self.hot.entries.get(node.key)
        if entry is not None and entry.node == node.id:
            return entry.snapshots
        return self.spills.held(node.id)

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
                return self.get(now, retry=False)
            if first:
                self._bad_file(node, e)
            return None
        if not self._first_to_finish(node, pending):
            return snapshots
        self._claims_what_it_holds(node, snapshots)
        self.counts["cold_loads"] += 1
        self.keeping.recorded(node)
        self.meter.add(read_back_bytes=node.record.nbytes)
        with self.lock:
            self.read_back[node.namespace] += node.record.nbytes
        self.hold(node, snapshots)
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

    def _bad_file(self, node: Node, error: ColdFileError) -> None:
        """A miss: report it, quarantine the file, and stop pointing at it."""
        self.report(error.reason, node.key, str(error))
        self.filing.quarantine(node, error)
        if error.reason != "missing":  # a missing file is only unfiled
            self.meter.add(quarantined_files=1)
