"""Cold hits: load them, recompute them, or both at once, whichever the measured rates say is first.

The KV of positions [a, n) read from disk does not depend on how [0, a) was
produced, so the model can prefill the first cold nodes while MLX's I/O threads
read the others (Cake, "Compute Or Load KV Cache? Why Not Both?", arXiv
2410.03065). The rates that choose are measured per namespace as the store
runs, each with its work synchronised, and kept in the index, so a restart
keeps them. A file's bytes in the page cache read at memory speed, the others
at the disk's: the plan asks the kernel which are where (snapshots/page_cache.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, ValidationError

from .. import caches as C
from ..errors import CorruptRecordError
from ..snapshots.page_cache import resident_bytes

if TYPE_CHECKING:
    from ..index import Node
    from .space import Space

log = logging.getLogger("promptstore.store")

NOTE = "cold-rates"  # the index note the rates are kept under
MAX_SAMPLES = 16  # samples kept of each kind, newest last
# Until a read or placement rate has been measured: cautious guesses (a read
# guessed too slow at worst recomputes, which is never slower than no cache).
PRIOR_BYTES_PER_S = {"warm": 2e9, "disk": 0.5e9, "place": 4e9}
WARM, DISK = 0.9, 0.1  # resident shares that make a read sample a page-cache or a disk one


class Rates(BaseModel):
    """What a namespace's prefills and cold reads have cost (all advisory), as
    recent samples.

    prefill: (from, to, seconds) of prefilling positions [from, to).
    warm, disk: (bytes, seconds) of reading and verifying files whose bytes were
        in the page cache (warm) or not (disk).
    place: (bytes, seconds) of restoring read bytes into a cache (a join, and on
        a GPU the move to its memory).
    split: (estimated, actual) seconds of split hits: how far overlapping a
        prefill with reads departs from the estimate.
    """

    prefill: list[tuple[int, int, float]] = []
    warm: list[tuple[int, float]] = []
    disk: list[tuple[int, float]] = []
    place: list[tuple[int, float]] = []
    split: list[tuple[float, float]] = []

    def add(self, kind: str, *sample) -> None:
        if sample[-1] > 0:
            setattr(self, kind, [*getattr(self, kind), tuple(sample)][-MAX_SAMPLES:])

    def bytes_per_s(self, kind: str) -> float:
        """The median rate of the samples of `kind` (warm, disk, place), else a prior."""
        samples = getattr(self, kind)
        return _median_rate(tuple(samples)) if samples else PRIOR_BYTES_PER_S[kind]

    def read_seconds(self, resident: int, other: int) -> float:
        return resident / self.bytes_per_s("warm") + other / self.bytes_per_s("disk")

    def place_seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s("place")

    def split_factor(self) -> float:
        """Actual over estimated seconds of past split hits (1 before any)."""
        return float(np.median([a / e for e, a in self.split])) if self.split else 1.0

    def prefill_seconds(self, lo: int, hi: int) -> float | None:
        """Seconds to prefill [lo, hi): t = c1 * tokens + c2 * attention pairs,
        fitted to the samples (ones far slower than the fit, such as a first
        forward compiling its kernels, are left out); None before any sample."""
        if not self.prefill:
            return None
        per_token, per_pair = _prefill_fit(tuple(self.prefill))
        return per_token * (hi - lo) + per_pair * float(_pairs(lo, hi))


# Every fetch with cold nodes plans from the same few samples until one is added:
# the medians and fits are kept per set of samples, not computed at every hit.
@functools.lru_cache(maxsize=64)
def _median_rate(samples: tuple[tuple[int, float], ...]) -> float:
    return float(np.median([b / s for b, s in samples]))


@functools.lru_cache(maxsize=64)
def _prefill_fit(samples: tuple[tuple[int, int, float], ...]) -> tuple[float, float]:
    """(seconds per token, seconds per million attention pairs) fitted to prefill samples."""
    s = np.asarray(samples, dtype=np.float64)
    x = np.stack([s[:, 1] - s[:, 0], _pairs(s[:, 0], s[:, 1])], axis=1)
    c = _fit(x, s[:, 2])
    keep = s[:, 2] <= 2 * (x @ c) + 1e-3
    if 0 < keep.sum() < len(s):
        c = _fit(x[keep], s[keep, 2])
    return float(c[0]), float(c[1])


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares in two unknowns: both terms, else the better single one."""
    if len(y) > 1 and np.linalg.matrix_rank(x) == 2:
        c, *_ = np.linalg.lstsq(x, y, rcond=None)
        if (c >= 0).all():
            return c
    best, err = np.zeros(2), np.inf
    for i in (0, 1):
        norm = x[:, i] @ x[:, i]
        if norm > 0:
            c = np.zeros(2)
            c[i] = max(x[:, i] @ y / norm, 0.0)
            e = np.sum((y - x @ c) ** 2)
            if e < err:
                best, err = c, e
    return best


def _pairs(lo, hi):
    """Attention (query, key) pairs of prefilling [lo, hi), in millions."""
    return (np.asarray(hi, dtype=np.float64) ** 2 - np.asarray(lo, dtype=np.float64) ** 2) / 2e6


@dataclass(frozen=True)
class ColdNode:
    """A node of a hit past the part held in memory: its span, the bytes a read
    costs (0 when held here) and how many of them are in the page cache."""

    start: int
    end: int
    nbytes: int
    resident: int


@dataclass(frozen=True)
class Choice:
    """How a hit with cold nodes is served.

    mode: "load" (read every cold node), "recompute" (serve the part held in
        memory; the caller prefills the rest), "split" (prefill [held end, at)
        while the nodes from `at` on are read).
    at: the first position read from disk ("recompute": the end of the held part).
    estimates: seconds each option was expected to take (absent: not known).
    """

    mode: Literal["load", "recompute", "split"]
    at: int
    estimates: dict[str, float] = field(default_factory=dict)


def choose(rates: Rates, base: int, cold: list[ColdNode], mode: str = "auto", margin: float = 0.05) -> Choice:
    """The quickest way to a hit whose nodes from position `base` on are `cold`.

    mode: "auto" (the quickest), or the mode to take ("split": at its best point).
    margin: the share of the load time another plan must save to be taken.
    Until both a prefill and a read have been measured, "auto" loads.
    """
    end = cold[-1].end
    load = rates.read_seconds(sum(n.resident for n in cold), sum(n.nbytes - n.resident for n in cold))
    load += rates.place_seconds(sum(n.nbytes for n in cold))
    recompute = rates.prefill_seconds(base, end)
    estimates = {"load": load} | ({"recompute": recompute} if recompute is not None else {})
    splits = {}
    for i in range(1, len(cold)):
        head = rates.prefill_seconds(base, cold[i].start)
        if head is None:
            break
        tail = cold[i:]
        read = rates.read_seconds(sum(n.resident for n in tail), sum(n.nbytes - n.resident for n in tail))
        splits[cold[i].start] = max(head, read) * rates.split_factor() + rates.place_seconds(
            sum(n.nbytes for n in tail)
        )
    estimates.update({f"split@{at}": t for at, t in splits.items()})
    measured = rates.warm or rates.disk
    if mode == "load" or (mode == "auto" and (recompute is None or not measured)):
        return Choice("load", base, estimates)  # loading is how reads get measured at all
    if mode == "recompute":
        return Choice("recompute", base, estimates)
    if mode == "split":
        at = min(splits, key=splits.get) if splits else (cold[len(cold) // 2].start if len(cold) > 1 else None)
        return Choice("split", at, estimates) if at is not None else Choice("load", base, estimates)
    best, at, best_s = "load", base, load * (1 - margin)
    if splits:
        split_at = min(splits, key=splits.get)
        if splits[split_at] < best_s:
            best, at, best_s = "split", split_at, splits[split_at]
    if recompute <= best_s:  # a hit is never slower than no cache
        best, at = "recompute", base
    return Choice(best, at, estimates)


# --- the rates of a namespace, kept in the index --------------------------------------------

# (store path, namespace key) -> [its rates, as last kept]: every Space of a namespace
# in this process measures into, and plans by, the same rates.
_rates: dict[tuple[str, bytes], list[Rates]] = {}
_rates_lock = threading.Lock()


def rates_of(space: Space) -> Rates:
    """The namespace's rates, read from the index the first time."""
    key = (str(space.index.path), space.namespace.key)
    with _rates_lock:
        if key not in _rates:
            raw = space.index.note(space.namespace, NOTE)
            try:
                rates = Rates.model_validate_json(raw) if raw else Rates()
            except ValidationError:
                rates = Rates()  # advisory: a damaged note starts afresh
            _rates[key] = [rates, rates.model_copy(deep=True)]
        return _rates[key][0]


def save_rates(space: Space) -> None:
    """Keep changed rates in the index (with the other advisory counters)."""
    with _rates_lock:
        entry = _rates.get((str(space.index.path), space.namespace.key))
        if entry is None or entry[0] == entry[1]:
            return
        value, entry[1] = entry[0].model_dump_json().encode(), entry[0].model_copy(deep=True)
    space.index.set_note(space.namespace, NOTE, value)


# --- serving a hit by the plan ---------------------------------------------------------------


@dataclass
class Restored:
    """What a fetch's restore reached: the hit's length, the nodes it used, the
    nodes read from disk, the tokens the fetch prefilled itself, and the choice."""

    length: int
    used: int
    cold: list
    computed: int = 0
    choice: Choice | None = None


def restore_hit(space: Space, cache: list, path: list[Node], target: int, tokens: np.ndarray) -> Restored | None:
    """Restore `cache` along `path` to at most `target`, loading, recomputing or
    both as `choose` says; None is a miss."""
    tiers = space.tiers
    held = 0
    while held < len(path) and tiers.is_held(path[held]):
        held += 1
    if held == len(path):
        return _restored(space.restore_path(cache, path, target))
    base = path[held - 1].end if held else 0
    end = min(target, path[-1].end)
    cold = [_cold_node(space, n, min(n.end, end)) for n in path[held:]]
    choice = choose(rates_of(space), base, cold, space.settings.cold_plan)
    log.debug("cold hit of %d nodes [%d, %d): %s", len(cold), base, end, choice)
    if choice.mode == "recompute":
        got = space.restore_path(cache, path[:held], base) if held else None
        return _restored(got, choice) or Restored(0, 0, [], choice=choice)
    if choice.mode == "split":
        done = _split(space, cache, path, held, base, choice, tokens, end, cold)
        if done is not None:
            return done
    return _load(space, cache, path, target, choice, cold)


def _restored(got, choice: Choice | None = None) -> Restored | None:
    return None if got is None else Restored(*got, choice=choice)


def _cold_node(space: Space, node: Node, end: int) -> ColdNode:
    try:
        nbytes = 0 if space.tiers.is_held(node) else node.record.nbytes
    except CorruptRecordError:
        nbytes = 0  # the load reports it
    path = space.tiers.file_of(node) if nbytes else None
    resident = resident_bytes(path) if path is not None else 0
    return ColdNode(node.start, end, nbytes, min(nbytes, resident if resident is not None else 0))


def _load(space: Space, cache, path, target: int, choice: Choice, cold: list[ColdNode]) -> Restored | None:
    rates = rates_of(space)
    started = time.perf_counter()
    loaded = space.tiers.finish_path(space.tiers.start_path(path))
    read = time.perf_counter() - started
    got = space.restore_path(cache, path, target, loaded)
    if got is not None and got[2]:
        mx.eval([c.state for c in cache])  # timed whole: MLX is lazy
        _add_read(rates, cold, read)
        rates.add("place", sum(n.nbytes for n in cold), time.perf_counter() - started - read)
    return _restored(got, choice)


def _add_read(rates: Rates, cold: list[ColdNode], seconds: float) -> None:
    nbytes = sum(n.nbytes for n in cold)
    if nbytes:
        share = sum(n.resident for n in cold) / nbytes
        if share >= WARM or share <= DISK:
            rates.add("warm" if share >= WARM else "disk", nbytes, seconds)


def _split(space: Space, cache, path, held: int, base: int, choice: Choice, tokens, end: int, cold):
    """Prefill [base, choice.at) while the nodes from choice.at on are read."""
    rates = rates_of(space)
    started = time.perf_counter()
    if held:
        got = space.restore_path(cache, path[:held], base)
        if got is None or got[0] != base:
            return None  # the held part did not restore whole: load instead
    first = next(i for i, n in enumerate(path) if n.start == choice.at)
    loading = space.tiers.start_path(path[first:])  # MLX's I/O threads read while the model runs
    computing = time.perf_counter()
    prefill(space, cache, tokens, base, choice.at)
    space.record_prefill(base, choice.at, time.perf_counter() - computing)
    snaps, from_disk = space.tiers.finish_path(loading)
    computed = choice.at - base
    tail = path[first : first + len(snaps)]
    length, used = choice.at, first
    if tail:
        target = min(end, tail[-1].end)
        chains = C.restore_chains(snaps, tail[-1].end, target)
        if chains is not None and space.restored(cache, chains, target, tail[-1]):
            mx.eval([c.state for c in cache])
            length, used = target, first + len(tail)
            if target == tail[-1].end:
                space.tiers.restored_from(tail[-1].key)
    estimate = choice.estimates.get(f"split@{choice.at}")
    if estimate and length == end:
        rates.add("split", estimate / rates.split_factor(), time.perf_counter() - started)
    return Restored(length, used, from_disk, computed, choice)


def prefill(space: Space, cache, tokens, lo: int, hi: int) -> None:
    """tokens[lo:hi] through the model, in the store's prefill steps, each evaluated."""
    step = space.settings.prefill_step
    for at in range(lo, hi, step):
        space.model(mx.array(tokens[at : min(at + step, hi)])[None], cache=cache)
        mx.eval([c.state for c in cache])
