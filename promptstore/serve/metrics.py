"""`promptstore serve`'s /metrics, in Prometheus's text format (prometheus-client,
a registry of the server's own): what requests got (tokens by tier, time to first
token, restore time, the retention it asked for), observed as each request ends,
and the store's counters and sizes (PromptStore.metrics()), read at each scrape. MetricsAccess says who may read
them: with --api-keys, only the operator's key, never a tenant's."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ..errors import PromptStoreError, ServeConfigError
from ..store import PromptStore
from ..store.metrics import SOURCES, TIERS, StoreMetrics, hit_sources, hit_tier
from ..store.retention import CLASSES
from .tenants import KeyRing, Tenant

log = logging.getLogger("promptstore.serve")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RESTORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class HitFigures:
    """What a request's hit restored, kept from its fetch until the request ends."""

    sources: dict[str, int]  # tokens by where they came from (store.metrics.SOURCES)
    tier: str  # the slowest tier it read
    nbytes: int
    seconds: float

    @classmethod
    def of(cls, hit) -> HitFigures | None:
        if hit is None or not hit.length:
            return None
        return cls(hit_sources(hit), hit_tier(hit), hit.nbytes, hit.seconds)


class ServeMetrics:
    """The server's registry: request metrics labelled by the served model (and,
    with --api-keys, counts by tenant label), plus a collector of the store's."""

    def __init__(
        self, store: PromptStore, model: str, keyring: KeyRing, vision: Callable[[], dict | None] = lambda: None
    ):
        self.model = model
        # *_created series are noise on a scrape; the switch is process-wide, and this process serves.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self._request_metrics()
        self.by_tenant = keyring.required
        if self.by_tenant:
            self._tenant_metrics(keyring.tenants())
        self.store_collector = StoreCollector(store)
        self.registry.register(self.store_collector)
        self.registry.register(VisionCollector(model, vision))

    def ranks(self, figures: list[StoreMetrics]) -> None:
        """Every rank's store figures, as a group last gathered them (by rank; this
        process's, rank 0's, is read live at each scrape)."""
        self.store_collector.ranks, self.store_collector.gathered = figures, time.monotonic()

    def _request_metrics(self) -> None:
        r, m = self.registry, ["model"]
        self.requests = Counter("promptstore_requests", "Completion requests served", m, registry=r)
        self.hits = Counter(
            "promptstore_request_hits", "Requests whose prompt the store partly restored", m, registry=r
        )
        self.prompt_tokens = Counter("promptstore_prompt_tokens", "Prompt tokens of the requests", m, registry=r)
        self.restored_tokens = Counter(
            "promptstore_restored_tokens",
            "Prompt tokens restored from the store (the cached_tokens responses report), by source: "
            "hot (memory), cold (disk), remote, computed (the head of an overlap cold hit)",
            [*m, "source"],
            registry=r,
        )
        self.prefilled_tokens = Counter(
            "promptstore_prefilled_tokens", "Prompt tokens the model prefilled", m, registry=r
        )
        self.generated_tokens = Counter("promptstore_generated_tokens", "Tokens generated", m, registry=r)
        self.ttft = Histogram(
            "promptstore_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.restore_seconds = Histogram(
            "promptstore_restore_seconds",
            "Seconds a hit's fetch took, by the slowest tier it read",
            [*m, "tier"],
            buckets=RESTORE_BUCKETS,
            registry=r,
        )
        self.restore_bytes = Counter(
            "promptstore_restore_bytes",
            "Bytes of stored nodes hits restored from, by the slowest tier they read",
            [*m, "tier"],
            registry=r,
        )
        self.retention_requests = Counter(
            "promptstore_retention_requests",
            "Requests by the retention class they asked for (cache_control ttl, prompt_cache_retention; "
            "none: no class); a request naming two classes counts under each",
            [*m, "retention"],
            registry=r,
        )
        self.cache_key_requests = Counter(
            "promptstore_prompt_cache_key_requests", "Requests that sent a prompt_cache_key", m, registry=r
        )
        for name in CLASSES:
            self.retention_requests.labels(self.model, name)
        self.cache_key_requests.labels(self.model)
        for metric in (self.requests, self.hits, self.prompt_tokens, self.prefilled_tokens, self.generated_tokens):
            metric.labels(self.model)  # every series from the start, at 0
        self.ttft.labels(self.model)
        for source in SOURCES:
            self.restored_tokens.labels(self.model, source)
        for tier in TIERS:
            self.restore_seconds.labels(self.model, tier)
            self.restore_bytes.labels(self.model, tier)

    def _tenant_metrics(self, tenants: tuple[Tenant, ...]) -> None:
        """Counts per tenant label (tenant-1, ...: never a key or a salt), for the operator."""
        r, labels = self.registry, ["model", "tenant"]
        self.tenant_requests = Counter("promptstore_tenant_requests", "Requests served, by tenant", labels, registry=r)
        self.tenant_prompt_tokens = Counter(
            "promptstore_tenant_prompt_tokens", "Prompt tokens, by tenant", labels, registry=r
        )
        self.tenant_restored_tokens = Counter(
            "promptstore_tenant_restored_tokens", "Prompt tokens restored from the store, by tenant", labels, registry=r
        )
        for tenant in tenants:
            for metric in (self.tenant_requests, self.tenant_prompt_tokens, self.tenant_restored_tokens):
                metric.labels(self.model, tenant.label)

    def served(
        self,
        tenant: Tenant,
        prompt: int,
        restored: int,
        hit: HitFigures | None,
        ttft: float | None,
        generated: int,
    ) -> None:
        """A request ended: `restored` of its `prompt` tokens came from the store (the
        cached_tokens it reported), `hit` says from where; ttft in seconds, None
        when no token came."""
        model = self.model
        self.requests.labels(model).inc()
        self.prompt_tokens.labels(model).inc(prompt)
        self.prefilled_tokens.labels(model).inc(prompt - restored)
        self.generated_tokens.labels(model).inc(generated)
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if restored:
            self.hits.labels(model).inc()
            self._restored(restored, hit)
        if self.by_tenant:
            self.tenant_requests.labels(model, tenant.label).inc()
            self.tenant_prompt_tokens.labels(model, tenant.label).inc(prompt)
            self.tenant_restored_tokens.labels(model, tenant.label).inc(restored)

    def asked(self, retention: tuple, cache_key: str | None) -> None:
        """A request ended that asked to keep what it stored by `retention` ((end,
        class) pairs, StoreRequest.retention) and sent `cache_key`."""
        for name in sorted({r.name for _, r in retention}) or ["none"]:
            self.retention_requests.labels(self.model, name).inc()
        if cache_key is not None:
            self.cache_key_requests.labels(self.model).inc()

    def _restored(self, restored: int, hit: HitFigures | None) -> None:
        if hit is None or sum(hit.sources.values()) != restored:
            # Not the hit fetched for it (mlx-lm restored something else): its source is unknown.
            log.debug("restored %d tokens without a matching hit: counted as hot", restored)
            self.restored_tokens.labels(self.model, "hot").inc(restored)
            return
        for source, n in hit.sources.items():
            self.restored_tokens.labels(self.model, source).inc(n)
        self.restore_seconds.labels(self.model, hit.tier).observe(hit.seconds)
        self.restore_bytes.labels(self.model, hit.tier).inc(hit.nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VisionCollector:
    """A vision-language model's prompts with images: those whose embeddings ran the
    vision tower, those whose hit covered every image so that it did not, and the
    images processed (read at each scrape; nothing for a text model)."""

    def __init__(self, model: str, counts: Callable[[], dict | None]):
        self.model, self.counts = model, counts  # None: the model takes no images

    def describe(self):
        return []

    def collect(self):
        counts = self.counts()
        if counts is None:
            return
        for name, key, doc in (
            ("promptstore_vision_encoder_runs", "vision_runs", "Prompts with images whose vision tower ran"),
            (
                "promptstore_vision_encoder_skipped",
                "vision_skipped",
                "Prompts whose hit covered every image: no vision tower",
            ),
            (
                "promptstore_vision_images_processed",
                "images_processed",
                "Images the image processor resized and cut into patches (an image a hit covers is not)",
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric([self.model], counts.get(key, 0))
            yield family


class StoreCollector:
    """The store's counters and sizes, read at each scrape (nothing while it is closed).
    In a distributed group (rank 0 serves /metrics) each family has a `rank` label:
    rank 0's read live, the others' as the group last gathered them."""

    def __init__(self, store: PromptStore):
        self.store = store
        self.ranks: list[StoreMetrics] = []  # a group's, by rank (ServeMetrics.ranks)
        self.gathered = 0.0

    def describe(self):
        return []  # the families depend on the store (a warm start, say): nothing to check at registration

    def collect(self):
        try:
            m = self.store.metrics()
        except PromptStoreError:
            return  # closed, as the server stops
        if not self.ranks:
            yield from _store_families(m)
            return
        yield from _by_rank([m, *self.ranks[1:]])
        yield GaugeMetricFamily("promptstore_group_ranks", "Ranks of the distributed group", value=len(self.ranks))
        yield GaugeMetricFamily(
            "promptstore_group_figures_age_seconds",
            "Seconds since the other ranks' store figures were gathered",
            value=time.monotonic() - self.gathered,
        )


def _store_families(m: StoreMetrics):
    yield from _store_counters(m)
    yield from _store_sizes(m)
    if m.retention is not None:
        yield from _retention(m)
    if m.warm_start is not None:
        yield from _warm_start(m)


def _by_rank(per_rank: list[StoreMetrics]):
    """Each rank's families as one, every sample labelled with its rank."""
    merged: dict[str, Metric] = {}
    for rank, m in enumerate(per_rank):
        for family in _store_families(m):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                into.add_sample(sample.name, dict(sample.labels, rank=str(rank)), sample.value)
    yield from merged.values()


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _by_tier(name: str, doc: str, values: dict[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["tier"])
    for tier, value in values.items():
        family.add_metric([tier], value)
    return family


def _store_counters(m: StoreMetrics):
    yield _by_tier(
        "promptstore_evictions", "Nodes that left a tier over its budget (hot: memory, cold: disk)", m.evictions
    )
    yield _by_tier("promptstore_evicted_bytes", "Bytes of the nodes evicted, by tier", m.evicted_bytes)
    yield _counter("promptstore_disk_files_written", "Node files written to disk (spills)", m.files_written)
    yield _counter("promptstore_disk_written_bytes", "Bytes written to disk (what wears an SSD)", m.disk_written_bytes)
    yield _counter(
        "promptstore_compact_written_bytes", "Bytes compact's joins rewrote in this process", m.compact_written_bytes
    )
    yield _counter(
        "promptstore_disk_read_back_bytes",
        "Bytes of node files read back (cold hits, warm starts): what the bytes written saved",
        m.read_back_bytes,
    )
    yield from _admission(m)
    yield _counter("promptstore_remote_written", "Values published to the remote tier", m.remote_written)
    yield _counter("promptstore_remote_written_bytes", "Bytes published to the remote tier", m.remote_written_bytes)
    yield _counter(
        "promptstore_quarantined_files", "Files that failed their checks, moved aside unserved", m.quarantined_files
    )
    yield from _disk(m)


def _disk(m: StoreMetrics):
    """What the disk refused (a full, read-only or failing disk), and what waits for it in memory."""
    d = m.disk
    yield _counter("promptstore_disk_refused_writes", "Node file writes the disk refused", d.refused_writes)
    yield _counter("promptstore_disk_refused_bytes", "Bytes of the writes the disk refused", d.refused_bytes)
    yield _counter(
        "promptstore_disk_deferred_writes", "Writes held back while the disk refused (its back-off)", d.deferred_writes
    )
    yield _counter(
        "promptstore_unwritten_dropped", "Refused nodes let go when what waited outgrew hot_bytes", d.dropped_nodes
    )
    yield _counter("promptstore_unwritten_dropped_bytes", "Bytes of the refused nodes let go", d.dropped_bytes)
    for name, doc, value in (
        ("promptstore_disk_refusing", "1 while the disk refuses writes (the store is degraded)", int(d.refusing)),
        (
            "promptstore_disk_refusing_seconds",
            "Seconds the disk has refused writes (0 when it takes them)",
            d.refusing_seconds,
        ),
        ("promptstore_unwritten_nodes", "Nodes the disk refused, held in memory only", d.unwritten_nodes),
        ("promptstore_unwritten_bytes", "Bytes of the nodes the disk refused, held in memory only", d.unwritten_bytes),
    ):
        yield GaugeMetricFamily(name, doc, value=value)


def _admission(m: StoreMetrics):
    """The admit durability's decisions (all 0 under the others)."""
    family = CounterMetricFamily(
        "promptstore_admitted", "Nodes admission queued for disk, by what admitted them", labels=["reason"]
    )
    for reason, n in m.admitted.items():
        family.add_metric([reason], n)
    yield family
    family = CounterMetricFamily("promptstore_admitted_bytes", "Bytes admission queued for disk", labels=["reason"])
    for reason, n in m.admitted_bytes.items():
        family.add_metric([reason], n)
    yield family
    yield _counter("promptstore_declined", "Nodes admission never wrote (one-offs), gone from memory", m.declined_nodes)
    yield _counter("promptstore_declined_bytes", "Bytes of the nodes admission never wrote", m.declined_bytes)
    yield _counter("promptstore_over_budget", "Nodes the disk write budget skipped", m.over_budget_nodes)
    yield _counter("promptstore_over_budget_bytes", "Bytes the disk write budget skipped", m.over_budget_bytes)
    if m.write_amplification is not None:
        yield GaugeMetricFamily(
            "promptstore_write_amplification",
            "Bytes written to disk (spills and joins) per byte of state read back",
            value=m.write_amplification,
        )


def _store_sizes(m: StoreMetrics):
    for name, doc, value in (
        ("promptstore_hot_nodes", "Nodes held in memory", m.hot_nodes),
        ("promptstore_hot_bytes", "Bytes held in memory", m.hot_bytes),
        ("promptstore_hot_budget_bytes", "The memory budget of each tenant (hot_bytes)", m.hot_budget_bytes),
        ("promptstore_stored_nodes", "Nodes in the store (every process's)", m.stored_nodes),
        ("promptstore_stored_bytes", "Bytes of the nodes in the store (every process's)", m.stored_bytes),
        ("promptstore_disk_budget_bytes", "The disk budget of each tenant (disk_bytes)", m.disk_budget_bytes),
    ):
        yield GaugeMetricFamily(name, doc, value=value)


def _retention(m: StoreMetrics):
    r = m.retention
    held = GaugeMetricFamily(
        "promptstore_retained_nodes", "Nodes kept now because a client asked, by retention class", labels=["retention"]
    )
    for name, n in r.held.items():
        held.add_metric([name], n)
    yield held
    yield _counter(
        "promptstore_retention_kept",
        "Times an eviction (memory or disk) passed over a retained node it would otherwise have taken",
        r.kept,
    )
    yield _counter("promptstore_retention_expired", "Retained nodes whose time passed", r.expired)
    yield _counter(
        "promptstore_in_memory_never_written", "Nodes retained in_memory that left memory unwritten", r.never_written
    )


def _warm_start(m: StoreMetrics):
    w = m.warm_start
    for name, doc, value in (
        ("promptstore_warm_start_running", "1 while a warm start reads the store into memory", int(not w.done)),
        ("promptstore_warm_start_nodes", "Nodes the warm start read into memory", w.nodes),
        ("promptstore_warm_start_bytes", "Bytes the warm start read into memory", w.bytes),
        ("promptstore_warm_start_planned_nodes", "Nodes the warm start plans to read", w.planned_nodes),
        ("promptstore_warm_start_planned_bytes", "Bytes the warm start plans to read", w.planned_bytes),
    ):
        yield GaugeMetricFamily(name, doc, value=value)


# --- who may read /metrics ------------------------------------------------------------------


@dataclass(frozen=True)
class MetricsAccess:
    """/metrics is off (--no-metrics), open (no API keys), or the operator's alone:
    with --metrics-key-file only that key reads it; with --api-keys and no such key
    nobody does, so no tenant ever reads another's counts."""

    enabled: bool
    key: str | None
    keyring: KeyRing

    def refusal(self, authorization: str | None) -> tuple[int, str] | None:
        """(status, message) when this Authorization header may not read /metrics."""
        if not self.enabled:
            return 404, "/metrics is off on this server (--no-metrics)"
        if self.key is None:
            if self.keyring.required:
                return 403, "/metrics needs the operator's key on a server with --api-keys (--metrics-key-file)"
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.key.encode()):
            return None
        if self.keyring.required and self.keyring.tenant(authorization) is not None:
            return 403, "an API key may not read /metrics: send the operator's key (--metrics-key-file)"
        return 401, "/metrics needs the operator's key: send 'Authorization: Bearer <key of --metrics-key-file>'"

    def warn(self) -> None:
        if self.enabled and self.key is None and self.keyring.required:
            log.warning("/metrics answers 403: with --api-keys it needs --metrics-key-file (or --no-metrics)")


def load_metrics_key(path: str | Path, keyring: KeyRing) -> str:
    """The operator's key for /metrics: the file's one line; never a tenant's API key."""
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ServeConfigError(
            f"cannot read the metrics key file {path}: {getattr(e, 'strerror', None) or e}"
        ) from None
    if not key or any(c.isspace() for c in key):
        raise ServeConfigError(f"the metrics key file {path} must hold one key (one word, no spaces)")
    if keyring.required and keyring.tenant(f"Bearer {key}") is not None:
        raise ServeConfigError(
            f"the key in {path} is also a tenant's API key (--api-keys): give /metrics a key of its own"
        )
    return key
