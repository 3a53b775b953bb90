"""The insert path: what a cache adds to a namespace, stored as nodes.

An insert snapshots only the span not yet stored (a chain of nodes when it holds
more than `node_bytes`), splits the snapshots of an edge where a new sequence
diverges inside it, heals nodes whose data is nowhere, and fills checkpoints'
missing states; each change reaches the index through Filing (filing.py), then
the snapshots go to the hot tier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import caches as C
from ..caches import Snapshot
from ..errors import (
    CacheError,
    CorruptRecordError,
    DiskWriteError,
    IndexDiskError,
    KeyCollisionError,
    StaleInsertError,
)
from ..identity import NodeId
from ..index import Index, Namespace, Node, NodeRecord
from .model import check_arrays, check_layout
from .retention import Marks, covering, marks

if TYPE_CHECKING:
    from ..config import Settings
    from .tiers import Tiers

# A rough prefill cost per token, used to value nodes inserted without a timing.
ESTIMATED_SECONDS_PER_TOKEN = 1e-3


def _span(snapshots) -> tuple[int, int] | None:
    """The span a node's snapshots cover (of the first layer that has one)."""
    first = next((s for s in snapshots if s is not None), None)
    return None if first is None else (first.start, first.end)


class _SplitDataUnavailable(Exception):
    """The snapshots of a node whose edge an insert must split are not here."""


class _NodeChanged(Exception):
    """A node an insert read was changed by another process before its record was replaced."""


class Inserter:
    """Stores what caches add to one namespace, bound to its model.

    new_cache: empty per-layer caches of the namespace's layout.
    account: the namespace's advisory counters (Space._account).
    step: the prefill grid checkpoints are taken on.
    """

    def __init__(
        self,
        index: Index,
        tiers: Tiers,
        settings: Settings,
        namespace: Namespace,
        model: nn.Module,
        dtype: str,
        new_cache: Callable[[], list],
        account: Callable[..., None],
        step: int,
    ):
        self.index, self.tiers, self.settings, self.namespace = index, tiers, settings, namespace
        self.model, self.dtype, self.new_cache = model, dtype, new_cache
        self.account, self.step = account, step
        self._phases = threading.local()  # the phases of the insert under way on each thread
        self._signatures: list | None = None

    def insert(
        self, toks: np.ndarray, cache: Sequence[Any], prefill_seconds: float | None = None, retention=None, turn=False
    ) -> int:
        """Store what `cache` (holding exactly `toks`, token ids the namespace accepts)
        adds; returns new tokens stored. Where its time went is then
        `last_insert_phases()` on the same thread.

        retention: a class (or its name) for the nodes on the path to the end of
        `toks`, or (end, class) pairs for the path to each end (retention.marks).
        turn: the tokens are a chat turn a client may come back to (Tiers.put).
        """
        given = marks(retention, len(toks))
        self._phases.phases = phases = {}
        self._phases.marks = given  # the classes nodes made by this insert get as they are held
        self._phases.turn = turn
        try:
            self._check_cache(cache)
            position = C.prompt_position(cache)
            if position != len(toks):
                raise CacheError(f"the cache holds {position} positions but {len(toks)} tokens were given")
            if position:
                self._check_arrays(cache)
            stored = 0
            pieces, planned = self._pieces(toks, cache, prefill_seconds)
            for end, piece, seconds in pieces:
                # A whole span is one node: its first try commits the plan just read.
                stored += self._insert_node(toks[:end], cache, seconds, position, piece, planned)
                planned = None
        finally:
            self._phases.phases = None  # a failed insert leaves nothing collecting
            self._phases.marks = ()
            self._phases.turn = False
        self._phases.last = phases
        self.retain(toks, given)  # and the nodes that held these tokens already
        return stored

    def retain(self, toks: np.ndarray, given: Marks) -> int:
        """Give the stored nodes on the path of each mark's prefix its class
        (the strongest where marks overlap); returns the nodes retained."""
        if not given:
            return 0
        path = self.index.lookup(self.namespace, toks[: max(end for end, _ in given)]).path
        for node in path:
            self.tiers.keeping.retain(node, covering(given, node.start))
        return len(path)

    def last_insert_phases(self) -> dict[str, float]:
        """Seconds the last insert that returned on this thread spent in each phase:
        `plan` (reading the trie), `snapshot` (copying the new span out of the cache,
        on the device), `index` (the index's commit, synced to disk), `hold` (into the
        hot tier, with evictions and the spill handed to the writer). Empty before one."""
        return dict(getattr(self._phases, "last", None) or {})

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            phases = getattr(self._phases, "phases", None)
            if phases is not None:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - started

    def _pieces(self, toks: np.ndarray, cache, prefill_seconds: float | None):
        """(end, its snapshots or None, prefill seconds) of each node to insert: one
        for the whole span unless it holds more than `node_bytes` or a retention
        mark ends inside it, then a chain of nodes ending at multiples of a step
        and at the marks' ends (a node has one class; the last ends at the end of
        `toks`); and the plan read, for the first node's commit when the span is
        one node."""
        with self._phase("plan"):
            planned = self.index.plan_insert(self.namespace, toks)
        start, end = planned.span
        if end - start < 2:
            return [(len(toks), None, prefill_seconds)], planned
        snaps = self._snap_span(cache, start, end)
        nbytes = C.node_nbytes(snaps)
        at_marks = {e for e, _ in getattr(self._phases, "marks", ()) if start < e < end}
        if nbytes <= self.settings.node_bytes and not at_marks:
            return [(len(toks), snaps, prefill_seconds)], planned
        cuts = set(at_marks)
        if nbytes > self.settings.node_bytes:
            step = max(self.settings.prefill_step, int(self.settings.node_bytes * (end - start) / nbytes))
            cuts.update(c for c in range((start // step + 1) * step, end, step) if c - start >= step // 4)
        cuts = sorted(cuts)
        pieces = C.cut_node(snaps, cuts)
        bounds = [start, *cuts, end]
        share = (
            (lambda lo, hi: None)
            if prefill_seconds is None
            else (lambda lo, hi: prefill_seconds * (hi - lo) / (end - start))
        )
        return [(hi, p, share(lo, hi)) for lo, hi, p in zip(bounds, bounds[1:], pieces)], None

    def _insert_node(self, toks: np.ndarray, cache, prefill_seconds, position: int, new, planned=None) -> int:
        """Insert one node ending at len(toks); `cache` is at `position` (>= it),
        `new` the snapshots of the span planned (made from `cache` when None or
        when the trie changed meanwhile), `planned` the plan of `toks` already
        read (the commit checks it is still current; a stale one is read again)."""
        for attempt in range(6):
            if planned is None or attempt:
                with self._phase("plan"):
                    planned = self.index.plan_insert(self.namespace, toks)
            try:
                # The last try splits a node whose data is nowhere rather than give up.
                return self._commit(planned, toks, cache, prefill_seconds, attempt == 5, position, new)
            except (StaleInsertError, _NodeChanged):
                continue
            except KeyCollisionError:
                return 0
            except (DiskWriteError, IndexDiskError) as e:
                # The disk refused the index's commit, or a name for a split's half:
                # the trie is as it was, and this insert stores nothing more.
                self.tiers.disk.refused(e, 0)
                self.tiers.count("inserts_refused_disk")
                return 0
            except _SplitDataUnavailable:
                # The edge to split belongs to a node another process has not
                # spilled yet; its file usually lands within moments.
                time.sleep(0.02 * 2**attempt)
        self.tiers.report("insert", toks[:8].tobytes(), "gave up: the node to split has no data here")
        return 0

    def _check_cache(self, cache) -> None:
        check_layout(cache, self.namespace, self.dtype)

    def _check_arrays(self, cache) -> None:
        check_arrays(cache, self.array_signatures())

    def array_signatures(self) -> list:
        """Per-layer `signature()` of a cache this model fills: from a one-token
        forward, made once and never evaluated (only shapes are read)."""
        if self._signatures is None:
            cache = self.new_cache()
            self.model(mx.array([[0]]), cache=cache)
            self._signatures = [c.signature() for c in cache]
        return self._signatures

    def _heal(self, planned, cache, position: int) -> None:
        """Nodes on the path whose data is nowhere (a writer died before spilling
        them) are stored again from `cache`, which holds their tokens."""
        for node in planned.match.path:
            # Only nodes these tokens match to their end: a node the tokens
            # diverge inside holds another prompt's positions.
            if node.end > min(position, planned.match.matched) or self.tiers.has(node):
                continue
            snaps = self._snap_node(cache, node, position)
            record = self._record(snaps, None, node.end - node.start)
            if self.tiers.filing.refile(node.id, None, record):
                self._put(node.id, snaps, record.prefill_seconds)
                self.tiers.count("healed")

    def _snap_node(self, cache, node: Node, position: int) -> list:
        snaps = self._snap_span(cache, node.start, position)
        if position == node.end:
            return snaps
        return C.split_node(snaps, node.end)[0]

    def _commit(self, planned, toks: np.ndarray, cache, prefill_seconds, lost_ok=False, position=None, new=None) -> int:
        position = len(toks) if position is None else position
        self._heal(planned, cache, position)
        start, end = planned.span
        split_records = None
        uppers = lowers = None
        if planned.split is not None:
            split_records, uppers, lowers = self._split(planned, cache, position, lost_ok)
            if split_records is None:
                raise _SplitDataUnavailable()
        if new is not None and _span(new) != (start, end):
            new = None  # planned for another span (the trie changed): made again below
        if new is None and end > start:
            new = self._snap_node(cache, NodeId(b"", self.namespace.key, start, end), position)
        fill = (
            self._fill_checkpoint(planned, cache)
            if end == start and planned.split is None and end == position
            else None
        )
        if new is None and planned.split is None and fill is None:
            return 0
        record = self._record(new, prefill_seconds, end - start) if new is not None else None
        with self._phase("index"):
            result = self.tiers.filing.commit_insert(planned, record, split_records)
        if len(toks) == position:
            self._count_checkpoint(position, new if new is not None else uppers if planned.split is not None else None)
        if planned.split is not None:
            self._place_split(planned, uppers, lowers)
        if new is not None:
            self._put(NodeId(result.key, self.namespace.key, start, end), new, record.prefill_seconds)
        if fill is not None:
            fill()
        return end - start  # the index counts tokens_stored itself

    def _count_checkpoint(self, position: int, snaps) -> None:
        """What checkpoints cost: recurrent states stored at grid positions."""
        if snaps is None or not self.namespace.state_mask or position % self.step:
            return
        nbytes = C.state_nbytes(snaps)
        if nbytes:
            self.account([], checkpoints=1, checkpoint_bytes=nbytes)

    def _snap_span(self, cache, start: int, end: int) -> list[Snapshot]:
        with self._phase("snapshot"):
            snaps = C.snapshot_prompt_cache(cache, start)
            mx.eval([a for s in snaps for a in s.all_arrays()])
        return snaps

    def _record(self, snaps, prefill_seconds, n_tokens) -> NodeRecord:
        record = NodeRecord.blank(self.namespace, C.present_layers(snaps))
        layers = [
            ref.model_copy(update={"nbytes": s.nbytes if s is not None else 0}) for ref, s in zip(record.layers, snaps)
        ]
        seconds = prefill_seconds if prefill_seconds is not None else n_tokens * ESTIMATED_SECONDS_PER_TOKEN
        return record.model_copy(
            update={
                "layers": layers,
                "nbytes": C.node_nbytes(snaps),
                "prefill_seconds": seconds,
            }
        )

    def _split(self, planned, cache, position: int, lost_ok: bool = False):
        """Records and snapshots of the two halves of the node an insert cuts.

        lost_ok: when the node's data is nowhere (a writer died before spilling
        it), the upper half comes from `cache` (which holds its tokens) and the
        lower half holds nothing until a prompt through it stores it again.
        """
        node = self._node(planned.split.key)
        if node is not None and (node.start, node.end) != (planned.split.start, planned.split.end):
            # Cut (or replaced) by another insert since the plan: its key now names another
            # span, which may begin past the positions this cache holds.
            raise _NodeChanged()
        snaps = self.tiers.get(node) if node is not None else None
        if snaps is None and (node is None or not lost_ok):
            return None, None, None  # another process may still spill it: try again
        if snaps is None:
            snaps = [None] * self.namespace.n_layers
        uppers, lowers = C.split_node(snaps, planned.split.at)
        if position == planned.split.at:
            # The cache is at the split point: it has every layer's state there,
            # whole-state ones included (a caller following hit.checkpoints).
            uppers = self._snap_span(cache, node.start, position)
            self.tiers.keep_states(planned.split.upper_key)  # where prompts diverge
        elif not any(s is not None for s in snaps):
            uppers = self._snap_node(cache, NodeId(node.key, node.namespace, node.start, planned.split.at), position)
        else:
            uppers = C.richer_windows(uppers, cache, node.start, planned.split.at)
        frac = (planned.split.at - node.start) / (node.end - node.start)
        seconds = node.record.prefill_seconds
        # Until each half's own file is written, both read theirs from the node's:
        # a disk that refuses the new files costs nothing that was stored.
        upper_file, lower_file = self.tiers.filing.split_files(node, planned.split.at)
        upper_rec = self._record(uppers, seconds * frac, 0).model_copy(update=upper_file)
        lower_rec = self._record(lowers, seconds * (1 - frac), 0).model_copy(update=lower_file)
        return (upper_rec, lower_rec), uppers, lowers

    def _place_split(self, planned, uppers, lowers) -> None:
        self.tiers.forget(planned.split.key)
        split, ns = planned.split, self.namespace.key
        self.tiers.keeping.split(split.key, split.upper_key)
        with self.tiers.remote.local():  # new spans: published from here, even when a remote hit's insert split them
            self._put(NodeId(split.upper_key, ns, split.start, split.at), uppers, None)
            self.tiers.shared(split.upper_key)  # the prefix two prompts share
            if any(s is not None for s in lowers):
                self._put(NodeId(split.key, ns, split.at, split.end), lowers, None)

    def _put(self, node_id: NodeId, snaps, seconds) -> None:
        """Hold snapshots for the node they were made for; if another process
        changed the node since, they are not its data."""
        node = self._node(node_id.key)
        if node is None or node.id != node_id:
            return
        retention = covering(getattr(self._phases, "marks", ()), node_id.start)
        with self._phase("hold"):
            seconds = node.record.prefill_seconds if seconds is None else seconds
            parent = node.parent if node.parent != node.namespace else None
            turn = getattr(self._phases, "turn", False)
            self.tiers.put(node_id, snaps, seconds, retention, parent=parent, turn=turn)

    def _fill_checkpoint(self, planned, cache):
        """All tokens are stored and end at a node: fill its missing whole-state layers."""
        node = planned.match.path[-1] if planned.match.path else None
        if node is None or node.end != len(planned.tokens):
            return None
        try:
            record = node.record
        except CorruptRecordError:
            return None
        missing = [i for i, ref in enumerate(record.layers) if not ref.present]
        if not missing:
            return None

        def fill():
            current = self.tiers.get(node)
            if current is None:
                return
            fresh = self._snap_span(cache, node.start, node.end)
            merged = [fresh[i] if i in missing else s for i, s in enumerate(current)]
            if any(s is None or not s.complete for s in merged):
                return
            # The node keeps naming its file (which lacks the states) until the
            # merged snapshots are on disk: a refused write loses nothing stored.
            kept = {k: getattr(record, k) for k in ("file", "file_node", "checksum", "tier")}
            new_record = self._record(merged, record.prefill_seconds, 0).model_copy(update=kept)
            if not self.tiers.filing.refile(node.id, record.file, new_record):
                raise _NodeChanged()  # another process changed it: plan the insert again
            self.tiers.forget(node.key)
            self._put(node.id, merged, record.prefill_seconds)

        return fill

    def _node(self, key: bytes) -> Node | None:
        try:
            return self.index.get(key)
        except CorruptRecordError:
            return None

    def keep_remote(self, toks: np.ndarray, cache, got, length: int) -> bool:
        """Store a remote hit here, a node per link of the chain as its publisher cut
        it, each holding the snapshots fetched for it (a node the prompt ends inside
        is cut from `cache`); arrays that do not fit this model are a miss."""
        end = len(toks)
        try:
            self._check_cache(cache)
            self._check_arrays(cache)
            with self.tiers.remote.from_remote():
                for link, snaps in zip(got.links, got.snapshots):
                    if link.end <= length or link.start >= end:
                        continue  # held here already, or past the hit
                    hi = min(link.end, end)
                    seconds = link.seconds * (hi - max(link.start, length)) / (link.end - link.start)
                    self._insert_node(toks[:hi], cache, seconds, end, snaps if hi == link.end else None)
        except CacheError as e:
            self.tiers.report("remote_layout", toks[:8].tobytes(), f"a remote hit does not fit this model: {e}")
            return False
        return True
