"""What clients asked the store to keep (retention.py), applied to this process's
nodes and recorded in the records of those on disk, so other processes
(compact) and a restart keep them too; an in_memory class is this process's
alone and never written."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from ..errors import CorruptRecordError, PromptStoreError
from ..index import Index, Node
from .filing import Filing
from .retention import CLASSES, NONE, Retained, Retention, RetentionFigures, keys_of, record_fields, retention_class

log = logging.getLogger("promptstore.store")


class Keeping:
    """The retention of one store's nodes in this process, read against `clock()`."""

    def __init__(self, index: Index, filing: Filing, clock: Callable[[], float]):
        self.index, self.filing, self.clock = index, filing, clock
        self.retained = Retained(clock)

    def retain(self, key_or_nodes, retention: Retention | str | None) -> None:
        """Keep these nodes (a key, a node, or an iterable of either) as `retention`
        asks, from now; a class a node has that outlasts it stays. A node on disk
        has its time written in its record."""
        r = retention_class(retention)
        if r is NONE:
            return
        applied = r.applied(self.clock())
        for key in keys_of(key_or_nodes):
            if self.retained.apply(key, applied) is applied and not applied.never_write:
                self._record(key, applied)

    def of(self, key: bytes) -> Retention | None:
        """The class this process keeps a node by (`never_write`, `keep_until`), None without one."""
        return self.retained.of(key)

    def kept(self, key: bytes) -> bool:
        """Whether the node is retained now (memory evicts it last)."""
        return self.retained.kept(key)

    def never_write(self, key: bytes) -> bool:
        return self.retained.never_write(key)

    def kept_class(self, key: bytes) -> Retention | None:
        """The class a spill records in the node's file record: a timed one that may be written."""
        r = self.retained.of(key)
        return r if r is not None and r.keep_until is not None and not r.never_write else None

    def split(self, key: bytes, upper_key: bytes) -> None:
        """A node was split: its upper half is kept as the node was."""
        self.retained.move(key, upper_key)

    def drop(self, key: bytes, unwritten: bool = False) -> None:
        """The node left this process (`unwritten`: an in_memory node leaving memory unwritten)."""
        self.retained.drop(key)
        if unwritten:
            self.retained.count("never_written")

    def passed_over(self, n: int) -> None:
        """An eviction passed over `n` retained nodes it would otherwise have taken."""
        self.retained.count("kept", n)

    def recorded(self, node: Node) -> None:
        """A node read from disk is kept as its record says, while that lasts."""
        try:
            record = node.record
        except CorruptRecordError:
            return
        r = CLASSES.get(record.retention or "")
        if r is not None and record.keep_until is not None and record.keep_until > self.clock():
            self.retained.apply(node.key, replace(r, keep_until=record.keep_until))

    def kept_on_disk(self, node: Node) -> bool:
        """Whether the disk budget passes over this node for now (retained here, or by its record)."""
        if self.retained.kept(node.key):
            return True
        try:
            until = node.record.keep_until
        except CorruptRecordError:
            return False
        return until is not None and until > self.clock()

    def figures(self, spared_by_memory: int) -> RetentionFigures:
        figures = self.retained.figures()
        return replace(figures, kept=figures.kept + spared_by_memory)

    def _record(self, key: bytes, r: Retention) -> None:
        """Write a filed node's keep_until in its record, unless it says about as
        much already (within a minute, or a tenth of the class: a prefix used by
        every request is written at most that often). A node not filed yet gets
        it when its file is published."""
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
