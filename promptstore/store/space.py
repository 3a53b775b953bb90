"""A namespace bound to a model, the store's front door: fetch the longest stored
prefix, insert what is new.

fetch asks the index for the longest match, its Restorer (restore.py) for the
cache, the remote tier for more, and names the checkpoints a prefill should
take; insert hands the cache to its Inserter (insert.py). Hit and miss counters
are advisory: gathered here and written on a stats thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.nn as nn
import numpy as np

from .. import caches as C
from ..caches.base import as_position
from ..errors import (
    CorruptRecordError,
    IndexDiskError,
    ModelIdentityError,
    PromptStoreError,
    SettingsError,
    SnapshotRangeError,
)
from ..index import Index, Namespace, NamespaceSpec, Node, prefix_key
from ..snapshots.pool import ProcessPool
from .group import Group
from .hit import Hit
from .insert import Inserter
from .metrics import model_label
from .model import layer_spec, model_dtype, weights_digest, weights_fingerprint
from .plan import Rates, rates_of, save_rates
from .restore import Restorer
from .retention import marks
from .tokens import model_tokens, vocabulary_size

log = logging.getLogger("promptstore.store")
_stats_pool = ProcessPool(1, "promptstore-stats")  # advisory counters, written off the request path

if TYPE_CHECKING:
    from ..config import Settings
    from .tiers import Tiers

# The index note a namespace bound with a model_id keeps its model's weights_fingerprint under.
WEIGHTS_NOTE = "weights-fingerprint"

# A remote lookup costs round trips: not worth them for fewer new tokens than this.
MIN_REMOTE_GAIN = 16


def _check_weights(model_id: str, recorded: bytes | None, weights: bytes, spans_weights: bool) -> None:
    """Refuse `weights` for a namespace that recorded others under `model_id`. A
    record of another fingerprint version says nothing of these weights: not refused."""
    if recorded is None or recorded == weights or spans_weights or _version(recorded) != _version(weights):
        return
    raise ModelIdentityError(
        f"model_id {model_id!r} was bound to other weights in this store (fingerprint {recorded.decode()}, "
        f"this model's {weights.decode()}): its cache would be restored into a different model. Give this "
        "model another model_id, or pass spans_weights=True if the id is meant to span versions of the weights",
        model_id=model_id,
    )


def _version(fingerprint: bytes) -> bytes:
    return fingerprint.split(b":", 1)[0]


def _nbytes(node: Node) -> int:
    try:
        return node.record.nbytes
    except CorruptRecordError:
        return 0


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
        group: Group | None = None,
    ):
        self.index, self.tiers, self.settings = index, tiers, settings
        self.group = group  # a rank of a distributed group: fetches are agreed (group.py)
        self.model, self.namespace, self.dtype = model, namespace, dtype
        self.cache_kwargs = cache_kwargs
        self.last_hit: Hit | None = None  # the figures of the last counted fetch (no cache: see Hit.figures)
        self._touched: list[bytes] = []
        self._counts: Counter = Counter()
        self._flushed = time.monotonic()
        self._stats_lock = threading.Lock()
        self._stats_write = None  # the write of gathered counters under way on the stats thread
        self.vocabulary = vocabulary_size(model)
        self.image_keys = bool(getattr(model, "image_keys", False))  # a vision model's: promptstore.vision
        self.model_label = model_label(namespace.spec)  # what the store's metrics name its model
        if self.image_keys and settings.cold_plan in ("auto", "overlap"):  # the store cannot run image keys
            settings = settings.model_copy(update={"cold_plan": "load"})
        self.restorer = Restorer(tiers, settings, model, self.rates)
        self.inserter = Inserter(
            index, tiers, settings, namespace, model, dtype, self.new_cache, self._account, self._step
        )

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
        *,
        spans_weights: bool = False,
        fingerprint: str | None = None,
        group: Group | None = None,
    ) -> Space:
        """Register `model`'s namespace in `index` and bind the model to it.

        With a model_id, the namespace keeps the weights_fingerprint of the model
        bound to it (the first bind's, or the last spans_weights bind's); a model of
        another fingerprint is refused (ModelIdentityError, nothing written) unless
        spans_weights. fingerprint: the model's, when the caller has it already.
        group: this process's rank of a distributed group; the namespace names its shard.
        """
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
            shard=None if group is None else group.shard(model),
        )
        if not model_id:  # the full digest is the namespace's identity: other weights, another namespace
            return cls(index, tiers, settings, model, index.register_namespace(spec), kwargs, dtype, group)
        weights = (fingerprint or weights_fingerprint(model)).encode()
        namespace = Namespace.of(spec)
        recorded = index.note(namespace, WEIGHTS_NOTE)
        _check_weights(model_id, recorded, weights, spans_weights)  # before anything is written
        namespace = index.register_namespace(spec)
        if recorded is None:
            # One transaction: of two processes binding other weights at once, the later is refused.
            _check_weights(model_id, index.first_note(namespace, WEIGHTS_NOTE, weights), weights, spans_weights)
        elif recorded != weights:
            # spans_weights, or a fingerprint of another version: the namespace's next
            # entries come from these weights, so a later bind is checked against them.
            if _version(recorded) == _version(weights):
                log.warning(
                    "model_id %r: bound to other weights than before (spans_weights): "
                    "what the earlier weights stored is restored into these",
                    model_id,
                )
            index.set_note(namespace, WEIGHTS_NOTE, weights)
        return cls(index, tiers, settings, model, namespace, kwargs, dtype, group)

    def new_cache(self) -> list:
        """Empty per-layer caches of this namespace's layout."""
        return C.make_prompt_cache(self.model, **self.cache_kwargs)

    # --- fetch ------------------------------------------------------------------------

    def fetch(self, tokens, checkpoints: Sequence[int] = (), *, count: bool = True) -> Hit:
        """The longest stored, restorable prefix of `tokens` (always leaving one token);
        in a store of a distributed group, the longest every rank restores (group.py).

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
        if self.group is None:
            return self._fetch(tokens, checkpoints, count=count)
        toks = self._tokens(tokens)  # bad tokens and checkpoints raise on every rank alike, before any collective
        self._wanted(checkpoints, len(toks))
        hit, again = self.group.agreed(
            lambda limit: self._fetch(toks, checkpoints, count=False, limit=limit),
            lambda: Hit(0, self.new_cache(), ()),
        )
        if again:
            self.tiers.count("group_restored_again", again)
        if not count:
            return hit
        if not hit.length:
            return self._counted(hit, len(toks), [], misses=1)
        return self._counted(hit, len(toks), [], hits=1, tokens_served=hit.length)

    def _fetch(self, tokens, checkpoints: Sequence[int] = (), *, count: bool = True, limit: int | None = None) -> Hit:
        """fetch on this process's store alone; limit: restore at most that many tokens."""
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
        target = match.restorable if limit is None else min(match.restorable, limit)
        restored = self.restorer.restore_hit(cache, path, target, toks) if path else None
        length, used, cold = (restored.length, restored.used, restored.cold) if restored else (0, 0, ())
        computed = restored.computed if restored else 0
        nbytes = sum(_nbytes(n) for n in path[:used])
        remote = None
        if limit is None:  # a limited fetch restores what this store has, to the limit
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
        self.tiers.served(path[:used] if length else ())
        if not count:
            self._account(path[:used])
            return hit
        if not length:
            return self._counted(hit, len(toks), [], misses=1)
        saved = self._saved_by_checkpoint(path[:used], length)
        return self._counted(hit, len(toks), path[:used], hits=1, tokens_served=length, **saved)

    def restorable_length(self, tokens) -> int:
        """How many leading tokens of `tokens` this namespace could restore (every
        layer), from the index alone: nothing is read, restored or counted. In a
        group's store, the fewest any rank could (a collective, as fetch is)."""
        toks = self._tokens(tokens)
        length = self.index.lookup(self.namespace, toks).restorable if len(toks) else 0
        return length if self.group is None else self.group.span(length)[0]

    def _counted(self, hit: Hit, prompt_tokens: int, nodes, **counts) -> Hit:
        """`hit` as this namespace's last, counted in its stats and the store's metrics."""
        self._account(nodes, **counts)
        self.last_hit = hit.figures()
        self.tiers.fetched(self.model_label, prompt_tokens, hit)
        return hit

    def _tokens(self, tokens):
        """Valid token ids below this model's vocabulary, or a typed error (before anything runs)."""
        return model_tokens(tokens, self.vocabulary, self.image_keys)

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
            counts["disk_read_bytes"] += self.tiers.take_read_back(self.namespace.key)
            if touched or +counts:
                self.index.touch(touched)
                self.index.bump(self.namespace, **counts)
            save_rates(self.index, self.namespace)
        except IndexDiskError as e:  # a full disk: said once by the disk's health, not per write
            log.debug("advisory counters not written: %s", e)
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
        if len(toks) - 1 - length < MIN_REMOTE_GAIN:
            return None
        ns = self.namespace.key
        spans = {(n.start, n.end): n for n in path}

        def held(link):
            node = spans.get((link.start, link.end))
            return None if node is None else self.tiers.get(node)

        got = self.tiers.remote.fetch(ns, toks[:-1], length, lambda end: prefix_key(ns, toks[:end]), held)
        links, snaps, target = (got.links, got.snapshots, got.length) if got else ([], [], 0)
        while links:
            end = min(target, links[-1].end)
            chains = C.restore_chains(snaps, links[-1].end)
            if chains is not None and end > max(length, links[-1].start):
                cache = self.new_cache()
                if self.restorer.restored(cache, chains, end, None) and self.inserter.keep_remote(
                    toks[:end], cache, got, length
                ):
                    self.tiers.count("remote_tokens", end)
                    fetched = sum(
                        min(link.end, end) - link.start for link, f in zip(links, got.fetched) if f and link.start < end
                    )
                    return end, cache, got.nbytes, fetched
            links, snaps = links[:-1], snaps[:-1]
            target = links[-1].end if links else 0
        return None

    # --- insert -----------------------------------------------------------------------

    def insert(
        self, tokens, cache: Sequence[Any], prefill_seconds: float | None = None, *, retention=None, turn: bool = False
    ) -> int:
        """Store what `cache` (holding exactly `tokens`) adds; returns new tokens stored.
        Where its time went is then `last_insert_phases()` on the same thread.

        retention: how long to keep the prefix ("5m", "1h", "24h", "in_memory",
        or a Retention; None: by the budgets alone), for the nodes on the path to
        the end of `tokens`; or (end, class) pairs, each for the prefix up to its
        end (docs/serve.md, Retention).
        turn: the tokens are a conversation's turn a client may come back to (a
        chat prompt or reply): the `admit` durability writes what the insert
        stores once it leaves memory (evicted, or at close), reused or not."""
        return self.inserter.insert(self._tokens(tokens), cache, prefill_seconds, retention, turn)

    def retain(self, tokens, retention) -> int:
        """Keep the stored nodes on the path of `tokens` as `retention` asks (as in
        insert); returns how many nodes that is (a prefix not stored: none)."""
        toks = self._tokens(tokens)
        return self.inserter.retain(toks, marks(retention, len(toks)))

    def last_insert_phases(self) -> dict[str, float]:
        """Seconds the last insert that returned on this thread spent in each phase
        (see Inserter.last_insert_phases). Empty before one."""
        return self.inserter.last_insert_phases()

    def array_signatures(self) -> list:
        """Per-layer `signature()` of a cache this model fills (see Inserter.array_signatures)."""
        return self.inserter.array_signatures()

    def checkpoint_counters(self) -> dict[str, int]:
        """What checkpoints cost (states stored at grid positions, and those dropped
        again when they were spilled unused) and save (restores that ended at one,
        and the tokens they restored past the deepest state that is not one)."""
        self.flush_stats()
        counters = self.index.counters(self.namespace)
        return {k: v for k, v in counters.items() if k.startswith("checkpoint")}
