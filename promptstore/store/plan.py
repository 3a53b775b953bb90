"""Cold hits: load them, recompute them, or both at once, whichever the measured rates say is first.

The KV of positions [a, n) read from disk does not depend on how [0, a) was
produced, so the model can prefill the first cold nodes while MLX's I/O threads
read the others (Cake, "Compute Or Load KV Cache? Why Not Both?", arXiv
2410.03065). The rates that choose are measured per namespace as the store
runs, each with its work synchronised, and kept in the index, so a restart
keeps them. This module only chooses: restore.py serves the choice, and says
how much of each cold file the page cache holds (snapshots/page_cache.py).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ValidationError, model_validator

from ..index import Index, Namespace

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
    overlap: (estimated, actual) seconds of overlap hits: how far overlapping a
        prefill with reads departs from the estimate. Kept under "split" by
        stores before the plan's rename, and read from there.
    """

    prefill: list[tuple[int, int, float]] = []
    warm: list[tuple[int, float]] = []
    disk: list[tuple[int, float]] = []
    place: list[tuple[int, float]] = []
    overlap: list[tuple[float, float]] = []

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        # Rates kept before the overlap plan's rename name its samples "split".
        if isinstance(data, dict) and "split" in data:
            data = dict(data)
            old = data.pop("split")
            data.setdefault("overlap", old)
        return data

    def add(self, kind: str, *sample) -> None:
        if sample[-1] > 0:
            setattr(self, kind, [*getattr(self, kind), tuple(sample)][-MAX_SAMPLES:])

    def prefilled(self, start: int, end: int, seconds: float) -> None:
        """The model prefilled positions [start, end) in `seconds`, its work evaluated."""
        if end > start and seconds > 0:
            self.add("prefill", int(start), int(end), float(seconds))

    def add_read(self, cold: list[ColdNode], seconds: float) -> None:
        """`cold` was read and verified in `seconds`: a warm or a disk sample, when
        most of its bytes were in the page cache or most were not."""
        nbytes = sum(n.nbytes for n in cold)
        if nbytes:
            share = sum(n.resident for n in cold) / nbytes
            if share >= WARM or share <= DISK:
                self.add("warm" if share >= WARM else "disk", nbytes, seconds)

    def bytes_per_s(self, kind: str) -> float:
        """The median rate of the samples of `kind` (warm, disk, place), else a prior."""
        samples = getattr(self, kind)
        return _median_rate(tuple(samples)) if samples else PRIOR_BYTES_PER_S[kind]

    def read_seconds(self, resident: int, other: int) -> float:
        return resident / self.bytes_per_s("warm") + other / self.bytes_per_s("disk")

    def place_seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s("place")

    def overlap_factor(self) -> float:
        """Actual over estimated seconds of past overlap hits (1 before any)."""
        return float(np.median([a / e for e, a in self.overlap])) if self.overlap else 1.0

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
        memory; the caller prefills the rest), "overlap" (prefill [held end, at)
        while the nodes from `at` on are read).
    at: the first position read from disk ("recompute": the end of the held part).
    estimates: seconds each option was expected to take (absent: not known).
    """

    mode: Literal["load", "recompute", "overlap"]
    at: int
    estimates: dict[str, float] = field(default_factory=dict)


def choose(rates: Rates, base: int, cold: list[ColdNode], mode: str = "auto", margin: float = 0.05) -> Choice:
    """The quickest way to a hit whose nodes from position `base` on are `cold`.

    mode: "auto" (the quickest), or the mode to take ("overlap": at its best point).
    margin: the share of the load time another plan must save to be taken.
    Until both a prefill and a read have been measured, "auto" loads.
    """
    end = cold[-1].end
    load = rates.read_seconds(sum(n.resident for n in cold), sum(n.nbytes - n.resident for n in cold))
    load += rates.place_seconds(sum(n.nbytes for n in cold))
    recompute = rates.prefill_seconds(base, end)
    estimates = {"load": load} | ({"recompute": recompute} if recompute is not None else {})
    overlaps = {}
    for i in range(1, len(cold)):
        head = rates.prefill_seconds(base, cold[i].start)
        if head is None:
            break
        tail = cold[i:]
        read = rates.read_seconds(sum(n.resident for n in tail), sum(n.nbytes - n.resident for n in tail))
        overlaps[cold[i].start] = max(head, read) * rates.overlap_factor() + rates.place_seconds(
            sum(n.nbytes for n in tail)
        )
    estimates.update({f"overlap@{at}": t for at, t in overlaps.items()})
    measured = rates.warm or rates.disk
    if mode == "load" or (mode == "auto" and (recompute is None or not measured)):
        return Choice("load", base, estimates)  # loading is how reads get measured at all
    if mode == "recompute":
        return Choice("recompute", base, estimates)
    if mode == "overlap":
        at = min(overlaps, key=overlaps.get) if overlaps else (cold[len(cold) // 2].start if len(cold) > 1 else None)
        return Choice("overlap", at, estimates) if at is not None else Choice("load", base, estimates)
    best, at, best_s = "load", base, load * (1 - margin)
    if overlaps:
        overlap_at = min(overlaps, key=overlaps.get)
        if overlaps[overlap_at] < best_s:
            best, at, best_s = "overlap", overlap_at, overlaps[overlap_at]
    if recompute <= best_s:  # a hit is never slower than no cache
        best, at = "recompute", base
    return Choice(best, at, estimates)


# --- the rates of a namespace, kept in the index --------------------------------------------

# (store path, namespace key) -> [its rates, as last kept]: every Space of a namespace
# in this process measures into, and plans by, the same rates.
_rates: dict[tuple[str, bytes], list[Rates]] = {}
_rates_lock = threading.Lock()


def rates_of(index: Index, namespace: Namespace) -> Rates:
    """The namespace's rates, read from the index the first time."""
    key = (str(index.path), namespace.key)
    with _rates_lock:
        if key not in _rates:
            raw = index.note(namespace, NOTE)
            try:
                rates = Rates.model_validate_json(raw) if raw else Rates()
            except ValidationError:
                rates = Rates()  # advisory: a damaged note starts afresh
            _rates[key] = [rates, rates.model_copy(deep=True)]
        return _rates[key][0]


def save_rates(index: Index, namespace: Namespace) -> None:
    """Keep changed rates in the index (with the other advisory counters)."""
    with _rates_lock:
        entry = _rates.get((str(index.path), namespace.key))
        if entry is None or entry[0] == entry[1]:
            return
        value, entry[1] = entry[0].model_dump_json().encode(), entry[0].model_copy(deep=True)
    index.set_note(namespace, NOTE, value)
