"""Warm start: read the most recently used nodes into the hot tier in the background.

Started when a store opens (the `warm_start` setting, on for `promptstore serve`)
or by `PromptStore.warm()`, while the caller loads its model, so the first
requests after a restart are hot hits. Each tenant's nodes fill at most its own
hot budget, most recently used first; files are read side by side and verified
like any cold read (a bad one is quarantined and never served). A fetch that
needs a node being warmed waits for that read instead of starting another.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable

import mlx.core as mx

from ..errors import CorruptRecordError, PromptStoreError
from ..index import Index, Node
from .filing import filed
from .tiers import Tiers

log = logging.getLogger("promptstore.store")

BATCH_FILES = 8  # files read side by side
BATCH_BYTES = 1 << 30


class Warmer:
    """One warm start. `done` is set when it has finished or stopped."""

    def __init__(self, index: Index, tiers: Tiers, budget: int, namespaces: Iterable[bytes] | None = None):
        self.index, self.tiers, self.budget = index, tiers, budget
        self.only: frozenset[bytes] | None = None if namespaces is None else frozenset(namespaces)
        self.stopping, self.done = threading.Event(), threading.Event()
        self.nodes = self.nbytes = 0  # read so far
        self.planned_nodes = self.planned_bytes = 0
        self.started = self.finished = None
        self.thread = threading.Thread(target=self._run, name="promptstore-warm", daemon=True)

    def start(self) -> Warmer:
        self.started = time.monotonic()
        self.thread.start()
        return self

    def restrict(self, namespaces: Iterable[bytes]) -> None:
        """From now on, warm only these namespaces (a server learns its model's once it is loaded)."""
        self.only = frozenset(namespaces)

    def stop(self, timeout: float | None = None) -> bool:
        """Stop after the files being read; True once the thread has ended."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    @property
    def running(self) -> bool:
        return self.thread.is_alive() and not self.done.is_set()

    def progress(self) -> dict:
        """Nodes and bytes read so far, of those planned, and the seconds it took."""
        end = self.finished or time.monotonic()
        return {
            "nodes": self.nodes,
            "bytes": self.nbytes,
            "planned_nodes": self.planned_nodes,
            "planned_bytes": self.planned_bytes,
            "seconds": 0.0 if self.started is None else end - self.started,
            "done": self.done.is_set(),
        }

    def _run(self) -> None:
        mx.set_default_stream(mx.new_stream(mx.default_device()))  # MLX streams belong to threads
        log.info("warm start: reading the most recently used nodes into memory (%d bytes per tenant)", self.budget)
        try:
            self._warm()
        except PromptStoreError as e:  # the store closing under it, say: a warm start is advisory
            log.info("warm start stopped: %s", e)
        except Exception:
            log.exception("warm start failed; the store serves cold hits instead")
        finally:
            self.finished = time.monotonic()
            self.done.set()
            p = self.progress()
            log.info(
                "warm start: %d nodes (%.2f GB) read into memory in %.1f s%s",
                p["nodes"],
                p["bytes"] / 1e9,
                p["seconds"],
                " (stopped)" if self.stopping.is_set() else "",
            )

    def _warm(self) -> None:
        batch: list[Node] = []
        for node in self._plan():
            if self.stopping.is_set():
                return
            batch.append(node)
            if len(batch) >= BATCH_FILES or sum(n.record.nbytes for n in batch) >= BATCH_BYTES:
                self._read(batch)
                batch = []
        if batch and not self.stopping.is_set():
            self._read(batch)

    def _plan(self):
        """Nodes with files, most recently used first, each fitting its tenant's budget."""
        used: Counter = Counter()
        candidates = list(filed(self.index.iter_by_access()))
        for node in reversed(candidates):
            if self.stopping.is_set():
                return
            if self.only is not None and node.namespace not in self.only:
                continue
            if self.tiers.is_held(node):
                continue
            try:
                nbytes = node.record.nbytes
            except CorruptRecordError:
                continue
            group = self.tiers.tenant(node.namespace)
            if group not in used:
                used[group] = self.tiers.memory(group)[1]
            if used[group] + nbytes > self.budget:
                continue  # a smaller, older node may still fit
            used[group] += nbytes
            self.planned_nodes += 1
            self.planned_bytes += nbytes
            yield node

    def _read(self, batch: list[Node]) -> None:
        wanted = [n for n in batch if self.only is None or n.namespace in self.only]
        done = self.tiers.read_into_memory(wanted)
        self.nodes += sum(1 for n in wanted if self.tiers.is_held(n))
        self.nbytes += done
