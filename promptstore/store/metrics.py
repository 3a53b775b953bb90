"""What a store did since it opened, in this process: fetches by model and the
tokens, bytes and seconds they restored by tier, evictions, files written, bytes
published, quarantined files; plus its size against the budgets and the warm
start's progress, and the Reports of misses an operator should know of. Plain counters under one lock, counted where the work happens
(space.py's fetch, tiers.py); `PromptStore.metrics()` hands out a StoreMetrics."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..index import NamespaceSpec
    from .hit import Hit
    from .retention import RetentionFigures

TIERS = ("hot", "cold", "remote")
# Where a hit's tokens came from: a tier, or computed by the fetch itself (a cold
# hit whose plan prefilled its head while the rest was read: cold_plan overlap).
SOURCES = (*TIERS, "computed")
ADMISSIONS = ("tick", "evicted", "shutdown")  # what made admission write a node (store/admission.py)


def model_label(spec: NamespaceSpec) -> str:
    """The model a namespace belongs to, as counters name it: its model_id, else its weights' digest."""
    return spec.model_id or f"weights-xxh3:{spec.weights_digest}"


def hit_sources(hit: Hit) -> dict[str, int]:
    """The hit's restored tokens by where they came from (they sum to hit.length)."""
    local = hit.length - hit.remote_tokens
    hot = local - hit.cold_tokens - hit.computed if local else 0
    return {"hot": hot, "cold": hit.cold_tokens, "remote": hit.remote_tokens, "computed": hit.computed}


def hit_tier(hit: Hit) -> str:
    """The slowest tier a hit read from: what its restore time and bytes are labelled by."""
    if hit.remote_tokens:
        return "remote"
    return "cold" if hit.cold_nodes else "hot"


@dataclass(frozen=True)
class Report:
    """Something a caller did not see as an error but an operator should know."""

    reason: str
    key: str
    detail: str
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class ModelMetrics:
    """The fetches of one model's namespaces, every tenant's together (a fetch per
    call of Space.fetch: a server with --kv-bits makes two per request).

    restored_tokens: by source (hot, cold, remote, computed); they sum to the
        lengths of the hits, the prompt tokens callers did not prefill.
    restores, restore_bytes, restore_seconds: hits, the bytes of the stored nodes
        they restored from, and the seconds their fetches took, each labelled by
        the slowest tier the hit read (hot, cold, remote): bytes over seconds is
        the restore rate of hits that read that tier.
    """

    fetches: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    restored_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    restores: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restore_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restore_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the fetches left to the caller to prefill."""
        return self.prompt_tokens - sum(self.restored_tokens.values())

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens restored (0 before any fetch)."""
        return sum(self.restored_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class WarmStart:
    """A warm start's progress: nodes and bytes read into memory of those planned."""

    nodes: int
    bytes: int
    planned_nodes: int
    planned_bytes: int
    seconds: float
    done: bool


@dataclass(frozen=True)
class DiskFigures:
    """What the disk did with this process's writes (snapshots/disk_health.py).

    refusing: the last write was refused and none has gone through since (the
        store is degraded), for `refusing_seconds`, the last refusal's `reason`.
    refused_writes, refused_bytes: writes the disk refused since the store opened;
        deferred_writes: writes held back while it refused (its back-off).
    unwritten_nodes, unwritten_bytes: nodes the disk refused that are held in
        memory only now (a stop loses them unless the disk takes them by then).
    dropped_nodes, dropped_bytes: refused nodes let go because what waited for
        the disk outgrew hot_bytes (a long spell): lost, so memory stays bounded.
    """

    refusing: bool = False
    refusing_seconds: float = 0.0
    reason: str | None = None
    refused_writes: int = 0
    refused_bytes: int = 0
    deferred_writes: int = 0
    unwritten_nodes: int = 0
    unwritten_bytes: int = 0
    dropped_nodes: int = 0
    dropped_bytes: int = 0


@dataclass(frozen=True)
class StoreMetrics:
    """What PromptStore.metrics() returns. Counters count this process's work since
    the store opened; sizes are the store's now.

    models: fetches by model (ModelMetrics).
    evictions, evicted_bytes: nodes (and their bytes) that left a tier over its
        budget: hot (left memory; spilled to disk if not there yet), cold (files
        removed over disk_bytes, which compact does).
    files_written, disk_written_bytes: node files this process wrote (what wears
        an SSD); compact_written_bytes: files compact's joins wrote in this process.
        read_back_bytes: bytes of node files read back (cold hits, warm starts);
        write_amplification: bytes written over bytes read back (None before any
        read). remote_written, remote_written_bytes: values published to the
        remote tier (0 without one).
    admitted, admitted_bytes: under the admit durability, nodes (and bytes) queued
        for disk, by what admitted them (tick: reused, idle or a retention class;
        evicted; shutdown). declined_nodes, declined_bytes: nodes admission did
        not write (one-offs), gone from memory. over_budget_nodes, over_budget_bytes:
        nodes the write budget skipped (each counted once).
    quarantined_files: files that failed their checks, moved aside, never served.
    hot_nodes, hot_bytes: held in memory; hot_budget_bytes and disk_budget_bytes
        are budgets per tenant. stored_nodes, stored_bytes: the whole store, every
        process's nodes. warm_start: None when none ran.
    retention: what clients asked the store to keep and what it did (retention.py).
    disk: what the disk refused, and whether it refuses now (DiskFigures).
    """

    models: dict[str, ModelMetrics]
    evictions: dict[str, int]
    evicted_bytes: dict[str, int]
    files_written: int
    disk_written_bytes: int
    remote_written: int
    remote_written_bytes: int
    quarantined_files: int
    hot_nodes: int
    hot_bytes: int
    hot_budget_bytes: int
    stored_nodes: int
    stored_bytes: int
    disk_budget_bytes: int
    warm_start: WarmStart | None = None
    retention: RetentionFigures | None = None
    compact_written_bytes: int = 0
    read_back_bytes: int = 0
    admitted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ADMISSIONS, 0))
    admitted_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ADMISSIONS, 0))
    declined_nodes: int = 0
    declined_bytes: int = 0
    over_budget_nodes: int = 0
    over_budget_bytes: int = 0
    disk: DiskFigures = field(default_factory=DiskFigures)

    @property
    def write_amplification(self) -> float | None:
        """Bytes written to disk (spills and compact's joins) per byte of state read back."""
        written = self.disk_written_bytes + self.compact_written_bytes
        return written / self.read_back_bytes if self.read_back_bytes else None


class Meter:
    """The counters of one store in this process, updated by the threads that do the
    work (generation, writer, warm start) and read at any time by another."""

    def __init__(self):
        self._lock = threading.Lock()
        self._models: defaultdict[str, Counter] = defaultdict(Counter)
        self._store: Counter = Counter()

    def fetched(self, model: str, prompt_tokens: int, hit: Hit) -> None:
        """A fetch of `prompt_tokens` tokens found `hit` (a miss when its length is 0)."""
        counts: Counter = Counter(fetches=1, prompt_tokens=prompt_tokens)
        if hit.length:
            tier = hit_tier(hit)
            counts.update({"hits": 1, f"restores.{tier}": 1, f"restore_bytes.{tier}": hit.nbytes})
            counts[f"restore_seconds.{tier}"] = hit.seconds
            counts.update({f"restored_tokens.{k}": v for k, v in hit_sources(hit).items()})
        with self._lock:
            self._models[model].update(counts)

    def evicted(self, tier: str, nodes: int, nbytes: int) -> None:
        self.add(**{f"evictions.{tier}": nodes, f"evicted_bytes.{tier}": nbytes})

    def add(self, **counts: int) -> None:
        with self._lock:
            self._store.update(counts)

    def counts(self, *names: str) -> dict[str, int]:
        """Some of the store's counters by name (readable after the store closed)."""
        with self._lock:
            return {name: self._store[name] for name in names}

    def snapshot(self, **now) -> StoreMetrics:
        """The counters as a StoreMetrics; `now`: its remaining fields (sizes,
        budgets, remote counts, the warm start), which the store reads itself."""
        with self._lock:
            models = {m: _model_metrics(c) for m, c in self._models.items()}
            store = Counter(self._store)
        return StoreMetrics(
            models=models,
            evictions={t: store[f"evictions.{t}"] for t in ("hot", "cold")},
            evicted_bytes={t: store[f"evicted_bytes.{t}"] for t in ("hot", "cold")},
            files_written=store["files_written"],
            disk_written_bytes=store["disk_written_bytes"],
            quarantined_files=store["quarantined_files"],
            read_back_bytes=store["read_back_bytes"],
            admitted={e: store[f"admitted.{e}"] for e in ADMISSIONS},
            admitted_bytes={e: store[f"admitted_bytes.{e}"] for e in ADMISSIONS},
            **{k: store[k] for k in ("declined_nodes", "declined_bytes", "over_budget_nodes", "over_budget_bytes")},
            **now,
        )


def _model_metrics(c: Counter) -> ModelMetrics:
    return ModelMetrics(
        fetches=c["fetches"],
        hits=c["hits"],
        prompt_tokens=c["prompt_tokens"],
        restored_tokens={s: c[f"restored_tokens.{s}"] for s in SOURCES},
        restores={t: c[f"restores.{t}"] for t in TIERS},
        restore_bytes={t: c[f"restore_bytes.{t}"] for t in TIERS},
        restore_seconds={t: float(c[f"restore_seconds.{t}"]) for t in TIERS},
    )
