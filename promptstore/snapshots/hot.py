"""The hot tier: evaluated snapshots in this process's memory, under a byte budget.

Counted by the bytes the snapshots hold (not buffer capacity). Each group of
entries (a tenant) has a budget and a clock of its own: over budget, its least
valuable entries leave first, and nothing another group does changes which
(so one tenant's data never evicts another's). Pinned entries (in use by a
caller right now) never leave; entries `kept` says a client asked to keep leave
after every other. What leaves is returned to the caller, which spills it.
On Apple silicon the budget is wired (kept resident) with MLX's wired limit;
elsewhere nothing is wired.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

from ..caches import Snapshot
from ..identity import NodeId
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
    node: NodeId | None = None  # the node (and span) the snapshots were made for
    group: Hashable = None  # whose budget it counts against
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
    """Snapshots by node key, under `budget` bytes per group (over by at most one entry)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: dict[bytes, HotEntry] = {}
        self.nbytes = 0
        self.used: Counter = Counter()  # bytes per group
        self.clock = 0  # every put and hit
        self.clocks: Counter = Counter()  # per group: ages count only the group's own accesses
        self.lock = threading.RLock()
        self.wired = wire(budget) if budget > 0 else None
        self.kept: Callable[[bytes], bool] = lambda key: False  # retained: leaves last (store/retention.py)
        self.spared = 0  # kept entries an eviction passed over that their value alone would have sent

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
        node: NodeId | None = None,
        group: Hashable = None,
    ) -> list[HotEntry]:
        """Hold `snapshots` for `key`, counted against `group`'s budget; returns the
        entries of that group evicted to make room."""
        with self.lock:
            old = self.pop(key)
            nbytes = sum(s.nbytes for s in snapshots if s is not None)
            entry = HotEntry(
                key,
                snapshots,
                nbytes,
                prefill_seconds,
                0 if old is None else old.hits,
                self._tick(group),
                0 if old is None else old.pins,
                dirty,
                node,
                group,
                0 if old is None else old.restores,
            )
            self.entries[key] = entry
            self.nbytes += nbytes
            self.used[group] += nbytes
            return self.evict(group)

    def get(self, key: bytes) -> HotEntry | None:
        """The entry for `key` (counted as a use), or None."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                entry.used_at, entry.hits = self._tick(entry.group), entry.hits + 1
            return entry

    def _tick(self, group: Hashable) -> int:
        self.clock += 1
        self.clocks[group] += 1
        return self.clocks[group]

    def pop(self, key: bytes) -> HotEntry | None:
        with self.lock:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self.nbytes -= entry.nbytes
                self.used[entry.group] -= entry.nbytes
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

    def evict(self, group: Hashable = None) -> list[HotEntry]:
        """Remove the least valuable unpinned entries of `group` until it is within budget."""
        with self.lock:
            if self.used[group] <= self.budget:
                return []
            order = sorted((self.kept(e.key), self._value(e), i, e) for i, e in enumerate(self.candidates(group)))
            out, dearest = [], None  # dearest: the most valuable entry evicted that nobody asked to keep
            for kept, worth, _, entry in order:
                if self.used[group] <= self.budget:
                    break
                out.append(self.pop(entry.key))
                if not kept:
                    dearest = worth
            if dearest is not None:
                self.spared += sum(
                    1 for kept, worth, _, e in order if kept and worth < dearest and e.key in self.entries
                )
            return out

    def candidates(self, group: Hashable = None) -> list[HotEntry]:
        return [e for e in self.entries.values() if e.pins == 0 and e.group == group]

    def value_of(self, entry: HotEntry) -> float:
        """What the entry is worth keeping (snapshots/value.py): the order of eviction."""
        return self._value(entry)

    def _value(self, entry: HotEntry) -> float:
        return value(entry.prefill_seconds, entry.hits, entry.nbytes, self.clocks[entry.group] - entry.used_at)

    def dirty_entries(self) -> list[HotEntry]:
        with self.lock:
            return [e for e in self.entries.values() if e.dirty]
