"""The hot tier: evaluated snapshots in this process's memory, under a byte budget.

Counted by the bytes the snapshots hold (not buffer capacity). Over budget,
the least valuable entries leave first; pinned entries (in use by a caller
right now) never do. What leaves is returned to the caller, which spills it.
On Apple silicon the budget is wired (kept resident) with MLX's wired limit;
elsewhere nothing is wired.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx

from ..caches import Snapshot
from .value import value


@dataclass(eq=False)
class HotEntry:
    key: bytes
    snapshots: list[Snapshot]
    nbytes: int
    prefill_seconds: float = 0.0
    hits: int = 0
    used_at: int = 0
    pins: int = 0
    dirty: bool = True  # not yet on disk
    meta: dict = field(default_factory=dict)  # what the spiller needs (namespace, span)
    restores: int = 0  # restores that ended at this node's end (its states were used)


def wire(budget: int) -> int | None:
    """Keep up to `budget` bytes resident on Apple silicon; None where nothing is wired."""
    metal = getattr(mx, "metal", None)
    if metal is None or not metal.is_available():
        return None
    limit = min(budget, mx.device_info().get("max_recommended_working_set_size", budget))
    mx.set_wired_limit(limit)
    return limit


class HotTier:
    """Snapshots by node key, under `budget` bytes (over by at most one entry)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: dict[bytes, HotEntry] = {}
        self.nbytes = 0
        self.clock = 0
        self.lock = threading.RLock()
        self.wired = wire(budget) if budget > 0 else None

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def put(
        self,
        key: bytes,
        snapshots: list[Snapshot],
        *,
        prefill_seconds: float = 0.0,
        dirty: bool = True,
        meta: dict | None = None,
    ) -> list[HotEntry]:
        """Hold `snapshots` for `key`; returns the entries evicted to make room."""
        with self.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self.clock += 1
            nbytes = sum(s.nbytes for s in snapshots if s is not None)
            entry = HotEntry(
                key,
                snapshots,
                nbytes,
                prefill_seconds,
                0 if old is None else old.hits,
                self.clock,
                0 if old is None else old.pins,
                dirty,
                meta or {},
                0 if old is None else old.restores,
            )
            self.entries[key] = entry
            self.nbytes += nbytes
            return self.evict()

    def get(self, key: bytes) -> HotEntry | None:
        """The entry for `key` (counted as a use), or None."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.clock += 1
                entry.used_at, entry.hits = self.clock, entry.hits + 1
            return entry

    def pop(self, key: bytes) -> HotEntry | None:
        with self.lock:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self.nbytes -= entry.nbytes
            return entry

    def mark_clean(self, key: bytes) -> None:
        with self.lock:
            if key in self.entries:
                self.entries[key].dirty = False

    @contextmanager
    def pinned(self, keys: Iterable[bytes]) -> Iterator[None]:
        """While inside, these entries are not evicted."""
        keys = list(keys)
        with self.lock:
            for k in keys:
                if k in self.entries:
                    self.entries[k].pins += 1
        try:
            yield
        finally:
            with self.lock:
                for k in keys:
                    if k in self.entries:
                        self.entries[k].pins -= 1

    def evict(self) -> list[HotEntry]:
        """Remove the least valuable unpinned entries until within budget."""
        with self.lock:
            if self.nbytes <= self.budget:
                return []
            out = []
            for entry in sorted(self.candidates(), key=self._value):
                if self.nbytes <= self.budget:
                    break
                out.append(self.pop(entry.key))
            return out

    def candidates(self) -> list[HotEntry]:
        return [e for e in self.entries.values() if e.pins == 0]

    def _value(self, entry: HotEntry) -> float:
        return value(entry.prefill_seconds, entry.hits, entry.nbytes, self.clock - entry.used_at)

    def dirty_entries(self) -> list[HotEntry]:
        with self.lock:
            return [e for e in self.entries.values() if e.dirty]
