"""Cold hits: load them, recompute them, or both at once, whichever the measured rates say is first.

The KV of positions [a, n) read from disk does not depend on how [0, a) was
produced, so the model can prefill the first cold nodes while the cold tier
reads the others (the idea of Cake, "Compute Or Load KV Cache? Why Not
Both?"). The rates it is chosen by (prefill seconds by prompt length, cold
restore bytes per second) are measured per namespace as the store runs and
kept in the index, so a restart keeps them.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, ValidationError

from .. import caches as C
from ..errors import ColdFileError

if TYPE_CHECKING:
    from ..index import Node
    from .space import Space

log = logging.getLogger("promptstore.store")

NOTE = "cold-rates"  # the index note rates are kept under
MAX_SAMPLES = 16  # samples kept of each kind, newest last


class Rates(BaseModel):
    """What a namespace's prefills and cold restores have cost (all advisory), as
    recent samples; costs are fitted to them by least squares."""

    prefill: list[tuple[int, int, float]] = []  # (from, to, seconds): prefilling [from, to)
    read: list[tuple[int, int, float]] = []  # (files, bytes, seconds): a cold restore, read and verified in place
    overlap_read: list[tuple[int, int, float]] = []  # the same, read while the model prefills
    join: list[tuple[int, int, float]] = []  # (0, bytes, seconds): joining a split's computed and loaded parts

    def add(self, name: str, a: int, b: int, seconds: float) -> None:
        """A sample of `name` (prefill: positions a to b; the others: a files, b bytes)."""
        if seconds > 0 and (b > a if name == "prefill" else b > 0):
            setattr(self, name, [*getattr(self, name), (a, b, seconds)][-MAX_SAMPLES:])

    def prefill_seconds(self, lo: int, hi: int) -> float | None:
        """Seconds to prefill [lo, hi): t = c1 * tokens + c2 * attention pairs; None before any sample."""
        if not self.prefill:
            return None
        s = np.asarray(self.prefill, dtype=np.float64)
        c = _fit(np.stack([s[:, 1] - s[:, 0], _pairs(s[:, 0], s[:, 1])], axis=1), s[:, 2])
        return float(c[0] * (hi - lo) + c[1] * _pairs(lo, hi))

    def read_seconds(self, files: int, nbytes: int, overlapped: bool = False) -> float | None:
        """Seconds to read `files` cold files of `nbytes` in all: t = c1 * files + c2 * bytes."""
        samples = (self.overlap_read or self.read) if overlapped else self.read
        return _linear(samples, files, nbytes)

    def join_seconds(self, nbytes: int) -> float | None:
        return _linear(self.join, 0, nbytes) if self.join else self.read_seconds(0, nbytes)


def _linear(samples, a: int, b: int) -> float | None:
    if not samples:
        return None
    s = np.asarray(samples, dtype=np.float64)
    c = _fit(s[:, :2], s[:, 2])
    return float(c[0] * a + c[1] * b)


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
class Choice:
    """How a hit with cold nodes is served.

    mode: "load" (read every cold node), "recompute" (serve the nodes held in
        memory; the caller prefills the rest), "split" (prefill [held end, at)
        while reading the cold nodes from `at` on).
    at: the first position read from disk ("recompute": the end of the hit).
    estimates: seconds each option was expected to take (absent: not known).
    """

    mode: Literal["load", "recompute", "split"]
    at: int
    estimates: dict[str, float] = field(default_factory=dict)


def choose(rates: Rates, held: int, cold: list[tuple[int, int, int]], total_bytes: int, margin: float = 0.0) -> Choice:
    """The quickest way to a hit whose nodes [held, ...) are cold.

    cold: (start, end, bytes) of each cold node, in order; the last ends where
        the hit does. total_bytes: what the restored cache holds at its end.
    margin: seconds another plan must be expected to save over loading.
    Without both a prefill and a read rate measured, the nodes are loaded.
    """
    n = cold[-1][1]
    files = [(len(cold) - i, sum(b for _, _, b in cold[i:])) for i in range(len(cold))]  # read from node i on
    load, recompute = rates.read_seconds(*files[0]), rates.prefill_seconds(held, n)
    if load is None or recompute is None:
        return Choice("load", held)
    estimates = {"load": load, "recompute": recompute}
    join = rates.join_seconds(total_bytes)
    best, at, best_s = "load", held, load - margin
    for i, (start, _, _) in enumerate(cold[1:], 1):  # prefill cold nodes [0, i), read the rest
        t = max(rates.prefill_seconds(held, start), rates.read_seconds(*files[i], overlapped=True)) + join
        estimates[f"split@{start}"] = t
        if t < best_s:
            best, at, best_s = "split", start, t
    if recompute < best_s:
        best, at = "recompute", held
    return Choice(best, at, estimates)


# --- applying the choice in a fetch ------------------------------------------------------


_rates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Space -> [its rates, as last kept]


def rates_of(space: Space) -> Rates:
    """The namespace's rates, read from the index the first time."""
    if space not in _rates:
        raw = space.index.note(space.namespace, NOTE)
        try:
            rates = Rates.model_validate_json(raw) if raw else Rates()
        except ValidationError:
            rates = Rates()  # advisory: a damaged note starts afresh
        _rates[space] = [rates, rates.model_copy(deep=True)]
    return _rates[space][0]


def save_rates(space: Space) -> None:
    """Keep changed rates in the index (with the other advisory counters)."""
    entry = _rates.get(space)
    if entry is not None and entry[0] != entry[1]:
        space.index.set_note(space.namespace, NOTE, entry[0].model_dump_json().encode())
        entry[1] = entry[0].model_copy(deep=True)


def record_prefill(space: Space, lo: int, hi: int, seconds: float | None) -> None:
    """A caller prefilled [lo, hi) in `seconds` (what insert was told)."""
    if seconds is not None:
        rates_of(space).add("prefill", lo, hi, seconds)


def restore_hit(space: Space, cache: list, path: list[Node], target: int, tokens: np.ndarray):
    """Restore `cache` along `path` to at most `target`, loading, recomputing
    or both as `choose` says. Returns (length, nodes used, cold nodes,
    tokens this fetch prefilled itself, the choice); length 0 is a miss."""
    held = 0
    while held < len(path) and space.tiers.is_held(path[held]):
        held += 1
    if held == len(path):
        return _with(_restore_path(space, cache, path, target), 0, Choice("load", target))
    base = path[held - 1].end if held else 0
    end = min(target, path[-1].end)
    cold = [(n.start, min(n.end, end), _nbytes(n)) for n in path[held:]]
    if space.settings.cold_plan == "load":
        return _load(space, cache, path, target, Choice("load", base))
    choice = choose(rates_of(space), base, cold, sum(_nbytes(n) for n in path), space.settings.cold_plan_margin)
    if choice.mode == "recompute":
        return _with(_restore_path(space, cache, path[:held], base) if held else None, 0, choice)
    if choice.mode == "split":
        done = _split(space, cache, path, held, choice, tokens, end)
        if done is not None:
            return done
    return _load(space, cache, path, target, choice)


def _with(restored, computed: int, choice: Choice):
    return (*(restored or (0, 0, [])), computed, choice)


def _nbytes(node: Node) -> int:
    try:
        return node.record.nbytes
    except Exception:  # a corrupt record reads as nothing to load (the load reports it)
        return 0


def _load(space: Space, cache, path, target: int, choice: Choice):
    started = time.perf_counter()
    restored = _restore_path(space, cache, path, target)
    if restored is not None and restored[2]:
        mx.eval([c.state for c in cache])  # timed whole: MLX is lazy
        cold = [n for n in restored[2] if n.start < restored[0]]
        rates_of(space).add("read", len(cold), sum(_nbytes(n) for n in cold), time.perf_counter() - started)
    return _with(restored, 0, choice)


def _restore_path(space: Space, cache, path: list[Node], target: int):
    """Restore `cache` to the deepest position <= target every layer reaches:
    (position, nodes used, nodes read from disk), or None. A file that fails its
    checks while a restore reads it is a miss there, like one that fails before."""
    snaps, cold = space.tiers.get_path(path, deferred=True)
    path = path[: len(snaps)]
    while path:
        end = min(target, path[-1].end)
        chains = C.restore_chains(snaps, path[-1].end, end)
        try:
            if chains is not None and end > path[-1].start and space._restored(cache, chains, end, path[-1]):
                if end == path[-1].end:
                    space.tiers.restored_from(path[-1].key)  # its states were worth keeping
                return end, len(path), cold
        except ColdFileError as e:
            bad = next((i for i, n in enumerate(path) if _file_of(n) == e.path), len(path) - 1)
            space.tiers._bad_file(path[bad], e)
            path, snaps = path[: bad + 1], snaps[: bad + 1]  # the loop drops the bad node itself
        path, snaps = path[:-1], snaps[:-1]
        target = path[-1].end if path else 0
    return None


def _file_of(node: Node) -> str | None:
    try:
        return node.record.file
    except Exception:
        return None


def _split(space: Space, cache, path: list[Node], held: int, choice: Choice, tokens, end: int):
    """Prefill [held end, choice.at) while the nodes from choice.at on are read."""
    restored = _restore_path(space, cache, path[:held], path[held - 1].end) if held else None
    base = restored[0] if restored else 0  # the model computes from wherever the held part reached
    first = next(i for i, n in enumerate(path) if n.start == choice.at)
    loading = space.tiers.start_path(path[first:])  # reads while the model runs
    rates = rates_of(space)
    started = time.perf_counter()
    _prefill(space, cache, tokens, base, choice.at)
    rates.add("prefill", base, choice.at, time.perf_counter() - started)
    snaps, cold = space.tiers.finish_path(loading)
    pending = [p for _, p in loading if getattr(p, "seconds", 0)]
    if pending:  # read side by side: the slowest one is how long reading took
        rates.add("overlap_read", len(pending), sum(p.nbytes for p in pending), max(p.seconds for p in pending))
    computed = choice.at - base
    loaded = path[first : first + len(snaps)]
    if not loaded:
        return choice.at, first, cold, computed, choice
    started = time.perf_counter()
    target = min(end, loaded[-1].end)
    chains = C.restore_chains(snaps, loaded[-1].end, target)
    if chains is None or not space._restored(cache, chains, target, loaded[-1]):
        return choice.at, first, cold, computed, choice  # what the model computed still stands
    mx.eval([c.state for c in cache])
    rates.add("join", 0, sum(_nbytes(n) for n in path[: first + len(snaps)]), time.perf_counter() - started)
    return target, first + len(loaded), cold, computed, choice


def _prefill(space: Space, cache, tokens, lo: int, hi: int) -> None:
    """tokens[lo:hi] through the model, in the caller's prefill steps."""
    step = space.settings.prefill_step
    for at in range(lo, hi, step):
        space.model(mx.array(tokens[at : min(at + step, hi)])[None], cache=cache)
        mx.eval([c.state for c in cache])
