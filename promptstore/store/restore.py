"""Restoring a hit: a namespace's caches brought along a trie path from snapshots
held in memory, read from disk, or both at once (the model prefills the head
while the tail is read: an overlapped hit), as plan.py chooses.

A restore reaches the deepest position every layer can, or nothing: stored
snapshots that do not fit the namespace are a reported miss, never an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import caches as C
from ..errors import CacheError
from ..index import Node
from ..snapshots.page_cache import resident_bytes
from .plan import Choice, ColdNode, Rates, choose

if TYPE_CHECKING:
    from ..config import Settings
    from .reads import PathRead
    from .tiers import Tiers

log = logging.getLogger("promptstore.store")


@dataclass
class Restored:
    """What a fetch's restore reached: the hit's length, the nodes it used, the
    nodes read from disk, the tokens the fetch prefilled itself, and the choice."""

    length: int
    used: int
    cold: list
    computed: int = 0
    choice: Choice | None = None


class Restorer:
    """Restores the caches of one namespace, bound to its model, from the tiers.

    rates: the namespace's measured rates (plan.rates_of), asked for when a hit
        has cold nodes.
    """

    def __init__(self, tiers: Tiers, settings: Settings, model: nn.Module, rates: Callable[[], Rates]):
        self.tiers, self.settings, self.model, self.rates = tiers, settings, model, rates

    def restore_hit(self, cache: list, path: list[Node], target: int, tokens: np.ndarray) -> Restored | None:
        """Restore `cache` along `path` to at most `target`, loading, recomputing or
        both as `choose` says; None is a miss."""
        read = self.tiers.read(path)
        held = read.held
        if held == len(path):
            return _restored(self.restore_path(cache, read, target))
        base = path[held - 1].end if held else 0
        end = min(target, path[-1].end)
        cold = [_cold_node(node, min(node.end, end), nbytes, file) for node, nbytes, file in read.files(held)]
        choice = choose(self.rates(), base, cold, self.settings.cold_plan)
        log.debug("cold hit of %d nodes [%d, %d): %s", len(cold), base, end, choice)
        if choice.mode == "recompute":
            got = self.restore_path(cache, read, base, upto=held) if held else None
            return _restored(got, choice) or Restored(0, 0, [], choice=choice)
        if choice.mode == "overlap":
            done = self._overlap(cache, read, base, choice, tokens, end)
            if done is not None:
                return done
        return self._load(cache, read, target, choice, cold)

    def restore_path(self, cache, read: PathRead, target: int, loaded=None, upto: int | None = None):
        """Restore `cache` to the deepest position <= target every layer reaches along
        read.nodes[:upto]: (that position, nodes used, nodes read from disk), or None.

        loaded: what the read gave (PathRead.finish), when the caller read it already.
        """
        snaps, cold = loaded if loaded is not None else read.snapshots(upto)
        path = read.nodes[: len(snaps)]
        while path:
            end = min(target, path[-1].end)
            chains = C.restore_chains(snaps, path[-1].end, end)
            if chains is not None and end > path[-1].start and self.restored(cache, chains, end, path[-1]):
                if end == path[-1].end:
                    read.restored_at(path[-1])  # its state was worth keeping
                return end, len(path), cold
            path, snaps = path[:-1], snaps[:-1]
            target = path[-1].end if path else 0
        return None

    def restored(self, cache, chains, end: int, last: Node | None) -> bool:
        """restore_prompt_cache, with stored snapshots that do not fit (a file of
        another layout that passed its own checks) reported as a miss."""
        try:
            return C.restore_prompt_cache(cache, chains, end)
        except CacheError as e:
            self.tiers.report("layout", last.key if last else b"", f"stored snapshots do not fit this namespace: {e}")
            return False

    def _load(self, cache, read: PathRead, target: int, choice: Choice, cold: list[ColdNode]) -> Restored | None:
        rates = self.rates()
        started = time.perf_counter()
        loaded = read.start().finish()
        read_seconds = time.perf_counter() - started
        got = self.restore_path(cache, read, target, loaded)
        if got is not None and got[2]:
            mx.eval([c.state for c in cache])  # timed whole: MLX is lazy
            rates.add_read(cold, read_seconds)
            rates.add("place", sum(n.nbytes for n in cold), time.perf_counter() - started - read_seconds)
        return _restored(got, choice)

    def _overlap(self, cache, read: PathRead, base: int, choice: Choice, tokens, end: int) -> Restored | None:
        """Prefill [base, choice.at) while the nodes from choice.at on are read."""
        rates, path = self.rates(), read.nodes
        started = time.perf_counter()
        if read.held:
            got = self.restore_path(cache, read, base, upto=read.held)
            if got is None or got[0] != base:
                return None  # the held part did not restore whole: load instead
        first = next(i for i, n in enumerate(path) if n.start == choice.at)
        read.start(first)  # MLX's I/O threads read while the model runs
        computing = time.perf_counter()
        self._prefill(cache, tokens, base, choice.at)
        rates.prefilled(base, choice.at, time.perf_counter() - computing)
        snaps, from_disk = read.finish()
        computed = choice.at - base
        tail = path[first : first + len(snaps)]
        length, used = choice.at, first
        if tail:
            target = min(end, tail[-1].end)
            chains = C.restore_chains(snaps, tail[-1].end, target)
            if chains is not None and self.restored(cache, chains, target, tail[-1]):
                mx.eval([c.state for c in cache])
                length, used = target, first + len(tail)
                if target == tail[-1].end:
                    read.restored_at(tail[-1])
        estimate = choice.estimates.get(f"overlap@{choice.at}")
        if estimate and length == end:
            rates.add("overlap", estimate / rates.overlap_factor(), time.perf_counter() - started)
        return Restored(length, used, from_disk, computed, choice)

    def _prefill(self, cache, tokens, lo: int, hi: int) -> None:
        """tokens[lo:hi] through the model, in the store's prefill steps, each evaluated."""
        step = self.settings.prefill_step
        for at in range(lo, hi, step):
            self.model(mx.array(tokens[at : min(at + step, hi)])[None], cache=cache)
            mx.eval([c.state for c in cache])


def _restored(got, choice: Choice | None = None) -> Restored | None:
    return None if got is None else Restored(*got, choice=choice)


def _cold_node(node: Node, end: int, nbytes: int, file) -> ColdNode:
    """A node of a cold hit as the plan weighs it: its file's bytes, and how many of
    them the page cache holds."""
    resident = resident_bytes(file) if file is not None else 0
    return ColdNode(node.start, end, nbytes, min(nbytes, resident if resident is not None else 0))
