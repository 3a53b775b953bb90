"""A namespace bound to a model: fetch the longest stored prefix, insert new spans.

fetch reassembles a hit from the snapshots along the trie path (one chain per
layer, restored with one copy per array); insert snapshots only the span not
yet stored, splitting the snapshots of an edge where a new sequence diverges.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import caches as C
from ..caches import Snapshot
from ..caches.base import as_position
from ..errors import (
    CacheError,
    CacheShapeError,
    CorruptRecordError,
    KeyCollisionError,
    PromptStoreError,
    SettingsError,
    SnapshotRangeError,
    StaleInsertError,
    UnsupportedCacheError,
)
from ..identity import NodeId
from ..index import Index, LayerSpec, Namespace, NamespaceSpec, Node, NodeRecord, prefix_key
from ..snapshots import device
from ..snapshots.reader import ProcessPool
from .hit import Hit
from .metrics import model_label
from .plan import Rates, rates_of, save_rates
from .restore import Restorer
from .tokens import model_tokens, vocabulary_size

log = logging.getLogger("promptstore.store")
_stats_pool = ProcessPool(1, "promptstore-stats")  # advisory counters, written off the request path

if TYPE_CHECKING:
    from ..config import Settings
    from .tiers import Tiers

# A rough prefill cost per token, used to value nodes inserted without a timing.
ESTIMATED_SECONDS_PER_TOKEN = 1e-3
# A remote lookup costs round trips: not worth them for fewer new tokens than this.
MIN_REMOTE_GAIN = 16


def layer_spec(cache: Any, dtype: str) -> LayerSpec:
    return _spec(C.layer_description(cache), dtype)


def _spec(description: dict, dtype: str) -> LayerSpec:
    # The dtype is a property of the arrays, so of the leaves: a composite layer has none.
    children = description.get("children")
    if children:
        return LayerSpec(kind=description["kind"], children=[_spec(c, dtype) for c in children])
    return LayerSpec(**description, dtype=dtype)


def model_dtype(model: nn.Module) -> str:
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    floats = [p.dtype for _, p in params if mx.issubdtype(p.dtype, mx.floating)]
    return str(floats[0]).rsplit(".", 1)[-1] if floats else "unknown"


def weights_digest(model: nn.Module) -> str:
    """xxh3-128 over every parameter's name, dtype, shape and bytes."""
    import xxhash
    from mlx.utils import tree_flatten

    h = xxhash.xxh3_128()
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        mx.eval(p)
        h.update(f"{name}:{p.dtype}:{p.shape};".encode())
        # A copy the host reads: on CUDA the weights themselves stay on the device.
        copy = device.host_readable({"p": p})
        h.update(memoryview(mx.contiguous(copy["p"])))
        device.release_host_copies(copy)
    device.release_host_copies({}, flush=True)  # none of the copies stays in MLX's buffer cache
    return h.hexdigest()


def _nbytes(node: Node) -> int:
    try:
        return node.record.nbytes
    except CorruptRecordError:
        return 0


def _span(snapshots) -> tuple[int, int] | None:
    """The span a node's snapshots cover (of the first layer that has one)."""
    first = next((s for s in snapshots if s is not None), None)
    return None if first is None else (first.start, first.end)


def _describe(signature: tuple) -> str:
    """A `signature()` in words: 'keys float16 [1, 8, 64], ...', a cache list's children in []."""
    parts = [
        f"{e[0]} {e[1].rsplit('.', 1)[-1]} {list(e[2])}" if e and isinstance(e[0], str) else f"[{_describe(e)}]"
        for e in signature
    ]
    return ", ".join(parts) or "none"


class _SplitDataUnavailable(Exception):
    """The snapshots of a node whose edge an insert must split are not here."""


class _NodeChanged(Exception):
    """A node an insert read was changed by another process before its record was replaced."""


class Space:
    """One namespace of a store, bound to a model."""

    def __init__(
        self,
        index: Index,
        tiers: Tiers,
        settings: Settings,
        model: nn.Module,
        namespace: Namespace,
        cache_kwargs: dict,
        dtype: str,
    ):
        self.index, self.tiers, self.settings = index, tiers, settings
        self.model, self.namespace, self.dtype = model, namespace, dtype
        self.cache_kwargs = cache_kwargs
        self.last_hit: Hit | None = None  # the figures of the last counted fetch (no cache: see Hit.figures)
        self._inserting = threading.local()  # the phases of the insert under way on each thread
        self._touched: list[bytes] = []
        self._counts: Counter = Counter()
        self._flushed = time.monotonic()
        self._stats_lock = threading.Lock()
        self._stats_write = None  # the write of gathered counters under way on the stats thread
        self._signatures: list | None = None
        self.vocabulary = vocabulary_size(model)
        self.model_label = model_label(namespace.spec)  # what the store's metrics name its model
        self.restorer = Restorer(tiers, settings, model, self.rates)

    @classmethod
    def bind(
        cls,
        index: Index,
        tiers: Tiers,
        settings: Settings,
        model: nn.Module,
        model_id=None,
        salt=None,
        kv_bits=None,
        kv_group_size=64,
        max_kv_size=None,
    ) -> Space:
        """Register `model`'s namespace in `index` and bind the model to it."""
        kwargs = {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "max_kv_size": max_kv_size}
        template = C.make_prompt_cache(model, **kwargs)
        dtype = model_dtype(model)
        for name, value in (("model_id", model_id), ("salt", salt)):
            if value is not None and not isinstance(value, str):
                raise SettingsError(f"{name} must be a string or None, got {type(value).__name__}")
        spec = NamespaceSpec(
            model_id=model_id,
            weights_digest=None if model_id else weights_digest(model),
            layers=[layer_spec(c, dtype) for c in template],
            tenant=None if salt is None else index.tenant_digest(salt, settings.tenant_key()),
        )
        return cls(index, tiers, settings, model, index.register_namespace(spec), kwargs, dtype)

    def new_cache(self) -> list:
        """Empty per-layer caches of this namespace's layout."""
        return C.make_prompt_cache(self.model, **self.cache_kwargs)

    # --- fetch ------------------------------------------------------------------------

    def fetch(self, tokens, checkpoints: Sequence[int] = (), *, count: bool = True) -> Hit:
        """The longest stored, restorable prefix of `tokens` (always leaving one token).

        checkpoints: positions the caller knows later prompts will share (the end
            of a system prompt, of a message), asked for in `hit.checkpoints` when
            the model has window or recurrent layers, which restore only where
            their state was stored (attention layers restore anywhere). Such
            models are also asked for a checkpoint at every prefill step
            (`checkpoint_interval`, by default `prefill_step`), so a prompt that
            diverges anywhere restores at most one step before it.
        count: False for a fetch the store makes for itself (to extend what it
            holds): left out of hits, misses, metrics and `last_hit`; the access
            order of the nodes it reads is still kept.
        """
        start = time.perf_counter()
        toks = self._tokens(tokens)
        wanted = self._wanted(checkpoints, len(toks))
        cache = self.new_cache()
        if len(toks) < 2:
            hit = Hit(0, cache, self._grid(0, len(toks)), seconds=time.perf_counter() - start)
            return self._counted(hit, len(toks), [], misses=1) if count else hit
        match = self.index.lookup(self.namespace, toks[:-1])
        for key in match.corrupt:
            self.tiers.report("record", key, "the index record failed its checksum; treated as missing")
        path = list(match.path[: match.restorable_depth + 1])
        target = match.restorable
        restored = self.restorer.restore_hit(cache, path, target, toks) if path else None
        length, used, cold = (restored.length, restored.used, restored.cold) if restored else (0, 0, ())
        computed = restored.computed if restored else 0
        nbytes = sum(_nbytes(n) for n in path[:used])
        remote = self._fetch_remote(toks, length, [n for n in match.path if n.end <= match.matched])
        if remote is not None:
            (length, cache, nbytes, remote_tokens), used, cold, computed = remote, 0, (), 0  # replaces the local hit
        cold_tokens = sum(min(n.end, length) - n.start for n in cold if n.start < length)
        points = set(match.checkpoints + wanted) | set(self._grid(length, len(toks) - 1))
        if length < match.matched and self._restores_at_points:
            points.add(match.matched)  # a branch point this prompt can make restorable
        hit = Hit(
            length,
            cache,
            tuple(sorted(p for p in points if p > length)),
            used,
            len([n for n in cold if n.start < length]),
            cold_tokens,
            time.perf_counter() - start,
            remote_tokens=remote_tokens if remote is not None else 0,
            matched=match.matched,
            computed=computed,
            plan=restored.choice if restored and remote is None else None,
            nbytes=nbytes if length else 0,
        )
        if not count:
            self._account(path[:used])
            return hit
        if not length:
            return self._counted(hit, len(toks), [], misses=1)
        saved = self._saved_by_checkpoint(path[:used], length)
        return self._counted(hit, len(toks), path[:used], hits=1, tokens_served=length, **saved)

    def restorable_length(self, tokens) -> int:
        """How many leading tokens of `tokens` this namespace could restore (every
        layer), from the index alone: nothing is read, restored or counted."""
        toks = self._tokens(tokens)
        return self.index.lookup(self.namespace, toks).restorable if len(toks) else 0

    def _counted(self, hit: Hit, prompt_tokens: int, nodes, **counts) -> Hit:
        """`hit` as this namespace's last, counted in its stats and the store's metrics."""
        self._account(nodes, **counts)
        self.last_hit = hit.figures()
        self.tiers.meter.fetched(self.model_label, prompt_tokens, hit)
        return hit

    def _tokens(self, tokens):
        """Valid token ids below this model's vocabulary, or a typed error (before anything runs)."""
        return model_tokens(tokens, self.vocabulary)

    def _account(self, nodes, **counts) -> None:
        """Access order and hit counters are advisory: gathered, then written now
        and then on the stats thread, never on the request path: each write syncs
        the index to disk, and behind a spill's writeback that took 47-73 ms
        inside the first fetch after a round's spill (on an H200)."""
        with self._stats_lock:
            self._touched.extend(n.key for n in nodes)
            self._counts.update(counts)
            due = len(self._touched) >= 64 or time.monotonic() - self._flushed > 1.0
            if not due or (self._stats_write is not None and not self._stats_write.done()):
                return  # the write under way leaves these for the next
            gathered = self._take_stats()
            self._stats_write = _stats_pool().submit(self._write_stats, *gathered, background=True)

    def flush_stats(self) -> None:
        """Write what was gathered, now (after a write under way on the stats thread)."""
        with self._stats_lock:
            under_way, gathered = self._stats_write, self._take_stats()
        if under_way is not None:
            under_way.result()
        self._write_stats(*gathered)

    def _take_stats(self) -> tuple[list[bytes], Counter]:
        gathered = self._touched, self._counts
        self._touched, self._counts, self._flushed = [], Counter(), time.monotonic()
        return gathered

    def _write_stats(self, touched: list[bytes], counts: Counter, background: bool = False) -> None:
        try:
            if touched or counts:
                self.index.touch(touched)
                self.index.bump(self.namespace, **counts)
            save_rates(self.index, self.namespace)
        except PromptStoreError as e:
            if not background:
                raise
            log.warning("advisory counters not written: %s", e)

    def record_prefill(self, start: int, end: int, seconds: float) -> None:
        """The model prefilled positions [start, end) in `seconds`, timed with its
        work evaluated: a sample of the rate cold hits are planned by."""
        self.rates().prefilled(start, end, seconds)

    def rates(self) -> Rates:
        """What this namespace's prefills and cold reads have cost (plan.py)."""
        return rates_of(self.index, self.namespace)

    @property
    def _restores_at_points(self) -> bool:
        """Whether some layers restore only where their state or window was stored
        (range layers restore anywhere: they need no checkpoints)."""
        return bool(self.namespace.state_mask or self.namespace.window_mask)

    def _wanted(self, checkpoints: Sequence[int], n_tokens: int) -> tuple[int, ...]:
        positions = tuple(as_position(p, "checkpoint") for p in checkpoints)
        if any(p > n_tokens for p in positions):
            raise SnapshotRangeError(f"checkpoints {sorted(positions)} reach past the prompt's {n_tokens} tokens")
        if not self._restores_at_points:
            return ()
        return tuple(p for p in positions if 0 < p < n_tokens)

    @property
    def _step(self) -> int:
        return self.settings.checkpoint_interval or self.settings.prefill_step

    def _grid(self, start: int, end: int) -> tuple[int, ...]:
        """Checkpoints on the prefill grid in (start, end]: recurrent layers' state
        there costs a state each, window layers' positions nothing extra (they are
        ranges), and a node per step keeps every window position the prefill drops."""
        if not self._restores_at_points:
            return ()
        step = self._step
        return tuple(range((start // step + 1) * step, end + 1, step))

    def _saved_by_checkpoint(self, path: list[Node], length: int) -> dict:
        """Counters of a restore that ended at a grid checkpoint's state: the tokens
        restored past the deepest state that is not one."""
        state = self.namespace.state_mask
        if not state or length % self._step or path[-1].end != length:
            return {}
        before = [n.end for n in path[:-1] if n.present & state == state and n.end % self._step]
        return {"checkpoint_hits": 1, "checkpoint_tokens": length - max(before, default=0)}

    def _fetch_remote(self, toks: np.ndarray, length: int, path: list[Node]):
        """A longer prefix than `length` from the remote tier: (its length, a cache
        restored to it, the bytes fetched, the tokens of fetched nodes), also stored
        here (hot, and cold as the durability says); None if the server has none, is
        unreachable or answers something that fails its checks.

        path: this prompt's nodes in the trie, matched to their end; a remote node
        the same as one of them is read here, not fetched.
        """
        remote = self.tiers.remote
        if remote is None or len(toks) - 1 - length < MIN_REMOTE_GAIN:
            return None
        ns = self.namespace.key
        spans = {(n.start, n.end): n for n in path}

        def held(link):
            node = spans.get((link.start, link.end))
            return None if node is None else self.tiers.get(node)

        got = remote.fetch(ns, toks[:-1], length, lambda end: prefix_key(ns, toks[:end]), held)
        links, snaps, target = (got.links, got.snapshots, got.length) if got else ([], [], 0)
        while links:
            end = min(target, links[-1].end)
            chains = C.restore_chains(snaps, links[-1].end)
            if chains is not None and end > max(length, links[-1].start):
                cache = self.new_cache()
                if self.restorer.restored(cache, chains, end, None) and self._keep_remote(
                    toks[:end], cache, got, length
                ):
                    self.tiers.counts["remote_tokens"] += end
                    fetched = sum(
                        min(link.end, end) - link.start for link, f in zip(links, got.fetched) if f and link.start < end
                    )
                    return end, cache, got.nbytes, fetched
            links, snaps = links[:-1], snaps[:-1]
            target = links[-1].end if links else 0
        return None

    def _keep_remote(self, toks: np.ndarray, cache, got, length: int) -> bool:
        """Store a remote hit here, a node per link of the chain as its publisher cut
        it, each holding the snapshots fetched for it (a node the prompt ends inside
        is cut from `cache`); arrays that do not fit this model are a miss."""
        end = len(toks)
        try:
            self._check_cache(cache)
            self._check_arrays(cache)
            with self.tiers.from_remote():
                for link, snaps in zip(got.links, got.snapshots):
                    if link.end <= length or link.start >= end:
                        continue  # held here already, or past the hit
                    hi = min(link.end, end)
                    seconds = link.seconds * (hi - max(link.start, length)) / (link.end - link.start)
                    self._insert_node(toks[:hi], cache, seconds, end, snaps if hi == link.end else None)
        except CacheError as e:
            self.tiers.report("remote_layout", toks[:8].tobytes(), f"a remote hit does not fit this model: {e}")
            return False
        return True

    # --- insert -----------------------------------------------------------------------

    def insert(self, tokens, cache: Sequence[Any], prefill_seconds: float | None = None) -> int:
        """Store what `cache` (holding exactly `tokens`) adds; returns new tokens stored.
        Where its time went is then `last_insert_phases()` on the same thread."""
        self._inserting.phases = phases = {}
        try:
            toks = self._tokens(tokens)
            self._check_cache(cache)
            position = C.prompt_position(cache)
            if position != len(toks):
                raise CacheError(f"the cache holds {position} positions but {len(toks)} tokens were given")
            if position:
                self._check_arrays(cache)
            stored = 0
            for end, piece, seconds in self._pieces(toks, cache, prefill_seconds):
                stored += self._insert_node(toks[:end], cache, seconds, position, piece)
        finally:
            self._inserting.phases = None  # a failed insert leaves nothing collecting
        self._inserting.last = phases
        return stored

    def last_insert_phases(self) -> dict[str, float]:
        """Seconds the last insert that returned on this thread spent in each phase:
        `plan` (reading the trie), `snapshot` (copying the new span out of the cache,
        on the device), `index` (the index's commit, synced to disk), `hold` (into the
        hot tier, with evictions and the spill handed to the writer). Empty before one."""
        return dict(getattr(self._inserting, "last", None) or {})

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            phases = getattr(self._inserting, "phases", None)
            if phases is not None:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - started

    def _pieces(self, toks: np.ndarray, cache, prefill_seconds: float | None):
        """(end, its snapshots or None, prefill seconds) of each node to insert: one
        for the whole span unless it holds more than `node_bytes`, then a chain of
        nodes ending at multiples of a step (the last at the end of `toks`)."""
        with self._phase("plan"):
            start, end = self.index.plan_insert(self.namespace, toks).span
        whole = [(len(toks), None, prefill_seconds)]
        if end - start < 2:
            return whole
        snaps = self._snap_span(cache, start, end)
        nbytes = C.node_nbytes(snaps)
        if nbytes <= self.settings.node_bytes:
            return [(len(toks), snaps, prefill_seconds)]
        step = max(self.settings.prefill_step, int(self.settings.node_bytes * (end - start) / nbytes))
        cuts = [c for c in range((start // step + 1) * step, end, step) if c - start >= step // 4]
        pieces = C.cut_node(snaps, cuts)
        bounds = [start, *cuts, end]
        share = (
            (lambda lo, hi: None)
            if prefill_seconds is None
            else (lambda lo, hi: prefill_seconds * (hi - lo) / (end - start))
        )
        return [(hi, p, share(lo, hi)) for lo, hi, p in zip(bounds, bounds[1:], pieces)]

    def _insert_node(self, toks: np.ndarray, cache, prefill_seconds, position: int, new) -> int:
        """Insert one node ending at len(toks); `cache` is at `position` (>= it),
        `new` the snapshots of the span planned (made from `cache` when None or
        when the trie changed meanwhile)."""
        for attempt in range(6):
            with self._phase("plan"):
                plan = self.index.plan_insert(self.namespace, toks)
            try:
                # The last try splits a node whose data is nowhere rather than give up.
                return self._commit(plan, toks, cache, prefill_seconds, attempt == 5, position, new)
            except (StaleInsertError, _NodeChanged):
                continue
            except KeyCollisionError:
                return 0
            except _SplitDataUnavailable:
                # The edge to split belongs to a node another process has not
                # spilled yet; its file usually lands within moments.
                time.sleep(0.02 * 2**attempt)
        self.tiers.report("insert", toks[:8].tobytes(), "gave up: the node to split has no data here")
        return 0

    def _check_cache(self, cache) -> None:
        """A list of this namespace's cache kinds and layouts, or a typed error."""
        if not isinstance(cache, (list, tuple)) or not all(isinstance(c, C.SnapshotProtocol) for c in cache):
            raise UnsupportedCacheError(
                "insert takes the list of per-layer caches a model ran with "
                "(promptstore caches: see caches.make_prompt_cache / adopt_prompt_cache)"
            )
        dtype = self.dtype
        given = [layer_spec(c, dtype) for c in cache]
        if given != list(self.namespace.spec.layers):
            raise CacheShapeError(
                f"the cache's layout does not match namespace {self.namespace.hex[:12]}: "
                f"{len(given)} layers of {[g.kind for g in given][:4]}..."
            )

    def _check_arrays(self, cache) -> None:
        """Every layer's arrays have the dtype, batch size, head count and head dim
        this model gives them (another model with the same layer kinds, or a batch
        of 2, would otherwise be stored and later served to this one)."""
        expected = self.array_signatures()
        for i, (c, want) in enumerate(zip(cache, expected)):
            got = c.signature()
            if got != want:
                raise CacheShapeError(
                    f"layer {i}'s arrays are {_describe(got)}, but this namespace's model "
                    f"makes {_describe(want)} (name, dtype, shape without the token axis)"
                )

    def array_signatures(self) -> list:
        """Per-layer `signature()` of a cache this model fills: from a one-token
        forward, made once and never evaluated (only shapes are read)."""
        if self._signatures is None:
            cache = self.new_cache()
            self.model(mx.array([[0]]), cache=cache)
            self._signatures = [c.signature() for c in cache]
        return self._signatures

    def _heal(self, plan, cache, position: int) -> None:
        """Nodes on the path whose data is nowhere (a writer died before spilling
        them) are stored again from `cache`, which holds their tokens."""
        for node in plan.match.path:
            # Only nodes these tokens match to their end: a node the tokens
            # diverge inside holds another prompt's positions.
            if node.end > min(position, plan.match.matched) or self.tiers.has(node):
                continue
            snaps = self._snap_node(cache, node, position)
            record = self._record(snaps, None, node.end - node.start)
            if self.tiers.filing.refile(node.id, None, record):
                self._put(node.id, snaps, record.prefill_seconds)
                self.tiers.counts["healed"] += 1

    def _snap_node(self, cache, node: Node, position: int) -> list:
        snaps = self._snap_span(cache, node.start, position)
        if position == node.end:
            return snaps
        return C.split_node(snaps, node.end)[0]

    def _commit(self, plan, toks: np.ndarray, cache, prefill_seconds, lost_ok=False, position=None, new=None) -> int:
        position = len(toks) if position is None else position
        self._heal(plan, cache, position)
        start, end = plan.span
        split_records = None
        uppers = lowers = None
        if plan.split is not None:
            split_records, uppers, lowers = self._split(plan, cache, position, lost_ok)
            if split_records is None:
                raise _SplitDataUnavailable()
        if new is not None and _span(new) != (start, end):
            new = None  # planned for another span (the trie changed): made again below
        if new is None and end > start:
            new = self._snap_node(cache, NodeId(b"", self.namespace.key, start, end), position)
        fill = self._fill_checkpoint(plan, cache) if end == start and plan.split is None and end == position else None
        if new is None and plan.split is None and fill is None:
            return 0
        record = self._record(new, prefill_seconds, end - start) if new is not None else None
        with self._phase("index"):
            result = self.tiers.filing.commit_insert(plan, record, split_records)
        if len(toks) == position:
            self._count_checkpoint(position, new if new is not None else uppers if plan.split is not None else None)
        if plan.split is not None:
            self._place_split(plan, uppers, lowers)
        if new is not None:
            self._put(NodeId(result.key, self.namespace.key, start, end), new, record.prefill_seconds)
        if fill is not None:
            fill()
        return end - start  # the index counts tokens_stored itself

    def _count_checkpoint(self, position: int, snaps) -> None:
        """What checkpoints cost: recurrent states stored at grid positions."""
        if snaps is None or not self.namespace.state_mask or position % self._step:
            return
        nbytes = C.state_nbytes(snaps)
        if nbytes:
            self._account([], checkpoints=1, checkpoint_bytes=nbytes)

    def checkpoint_counters(self) -> dict[str, int]:
        """What checkpoints cost (states stored at grid positions, and those dropped
        again when they were spilled unused) and save (restores that ended at one,
        and the tokens they restored past the deepest state that is not one)."""
        self.flush_stats()
        counters = self.index.counters(self.namespace)
        return {k: v for k, v in counters.items() if k.startswith("checkpoint")}

    def _snap_span(self, cache, start: int, end: int) -> list[Snapshot]:
        with self._phase("snapshot"):
            snaps = C.snapshot_prompt_cache(cache, start)
            mx.eval([a for s in snaps for a in s.all_arrays()])
        return snaps

    def _record(self, snaps, prefill_seconds, n_tokens) -> NodeRecord:
        record = NodeRecord.blank(self.namespace, C.present_layers(snaps))
        layers = [
            ref.model_copy(update={"nbytes": s.nbytes if s is not None else 0}) for ref, s in zip(record.layers, snaps)
        ]
        seconds = prefill_seconds if prefill_seconds is not None else n_tokens * ESTIMATED_SECONDS_PER_TOKEN
        return record.model_copy(
            update={
                "layers": layers,
                "nbytes": C.node_nbytes(snaps),
                "prefill_seconds": seconds,
            }
        )

    def _split(self, plan, cache, position: int, lost_ok: bool = False):
        """Records and snapshots of the two halves of the node an insert cuts.

        lost_ok: when the node's data is nowhere (a writer died before spilling
        it), the upper half comes from `cache` (which holds its tokens) and the
        lower half holds nothing until a prompt through it stores it again.
        """
        node = self._node(plan.split.key)
        snaps = self.tiers.get(node) if node is not None else None
        if snaps is None and (node is None or not lost_ok):
            return None, None, None  # another process may still spill it: try again
        if snaps is None:
            snaps = [None] * self.namespace.n_layers
        uppers, lowers = C.split_node(snaps, plan.split.at)
        if position == plan.split.at:
            # The cache is at the split point: it has every layer's state there,
            # whole-state ones included (a caller following hit.checkpoints).
            uppers = self._snap_span(cache, node.start, position)
            self.tiers.keep_states(plan.split.upper_key)  # where prompts diverge
        elif not any(s is not None for s in snaps):
            uppers = self._snap_node(cache, NodeId(node.key, node.namespace, node.start, plan.split.at), position)
        else:
            uppers = C.richer_windows(uppers, cache, node.start, plan.split.at)
        frac = (plan.split.at - node.start) / (node.end - node.start)
        seconds = node.record.prefill_seconds
        upper_rec = self._record(uppers, seconds * frac, 0)
        lower_rec = self._record(lowers, seconds * (1 - frac), 0)
        return (upper_rec, lower_rec), uppers, lowers

    def _place_split(self, plan, uppers, lowers) -> None:
        self.tiers.forget(plan.split.key)
        split, ns = plan.split, self.namespace.key
        with self.tiers.local():  # new spans: published from here, even when a remote hit's insert split them
            self._put(NodeId(split.upper_key, ns, split.start, split.at), uppers, None)
            if any(s is not None for s in lowers):
                self._put(NodeId(split.key, ns, split.at, split.end), lowers, None)

    def _put(self, node_id: NodeId, snaps, seconds) -> None:
        """Hold snapshots for the node they were made for; if another process
        changed the node since, they are not its data."""
        node = self._node(node_id.key)
        if node is None or node.id != node_id:
            return
        with self._phase("hold"):
            self.tiers.put(node_id, snaps, node.record.prefill_seconds if seconds is None else seconds)

    def _fill_checkpoint(self, plan, cache):
        """All tokens are stored and end at a node: fill its missing whole-state layers."""
        node = plan.match.path[-1] if plan.match.path else None
        if node is None or node.end != len(plan.tokens):
            return None
        try:
            record = node.record
        except CorruptRecordError:
            return None
        missing = [i for i, ref in enumerate(record.layers) if not ref.present]
        if not missing:
            return None

        def fill():
            current = self.tiers.get(node)
            if current is None:
                return
            fresh = self._snap_span(cache, node.start, node.end)
            merged = [fresh[i] if i in missing else s for i, s in enumerate(current)]
            if any(s is None or not s.complete for s in merged):
                return
            new_record = self._record(merged, record.prefill_seconds, 0)
            if not self.tiers.filing.refile(node.id, record.file, new_record.model_copy(update={"file": None})):
                raise _NodeChanged()  # another process changed it: plan the insert again
            self.tiers.forget(node.key)
            self._put(node.id, merged, record.prefill_seconds)

        return fill

    def _node(self, key: bytes) -> Node | None:
        try:
            return self.index.get(key)
        except CorruptRecordError:
            return None
