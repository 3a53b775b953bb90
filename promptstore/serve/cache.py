"""The prompt cache mlx_lm.server's generation thread calls (LRUPromptCache's
methods) over a PromptStore: a namespace per model key and tenant, checkpoints
at prompt segment ends, and after a chat reply the conversation as rendered."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from .. import caches as C
from ..errors import PromptStoreError
from ..generation import prefill, prefill_together
from ..store import Hit, PromptStore, Space
from ..store.space import weights_digest
from .replies import ChatTurn, common_prefix, rendered_turn
from .tenants import PUBLIC, InFlight, InFlightRequest, Tenant, TrackedPrompt

log = logging.getLogger("promptstore.serve")

REPLY_BATCH_BYTES = 4 << 30  # the caches of the replies prefilled as one batch, at most
PADDING = 1.25  # a batch of replies computes at most this many times their tokens


def _own_copy(prompt_cache: list) -> None:
    """Start computing a cache mlx-lm extracted from its batch (a lazy slice of
    the batch's arrays): once computed it holds its own copy, and the batch's
    arrays, which the next steps replace, are no longer kept alive by it."""
    try:
        arrays = [a for _, a in tree_flatten([c.state for c in prompt_cache]) if isinstance(a, mx.array)]
        mx.async_eval(arrays)
    except Exception as e:  # a cache kind without arrays to compute: nothing to start
        log.debug("extracted cache not computed ahead: %s", e)


def _reply_batches(prefills: list, limit: int, padding: float = PADDING) -> list[list]:
    """Replies to prefill as batches: longest first, each batch holding at most
    `limit` bytes of caches (one reply alone may hold more) and padded by at most
    `padding` times its tokens (a batch runs every reply to the longest's length)."""
    batches: list[list] = []
    size = 0
    for p in sorted(prefills, key=lambda p: p.new, reverse=True):
        batch = batches[-1] if batches else None
        n = p.item.nbytes()
        if (
            batch
            and size + n <= limit
            and batch[0].new * (len(batch) + 1) <= padding * (sum(q.new for q in batch) + p.new)
        ):
            batch.append(p)
            size += n
        else:
            batches.append([p])
            size = n
    return batches


def _goes_on_with(prompt: list[int], earlier: list[int]) -> bool:
    """Whether `earlier` is a prefix of `prompt`. Its last token is compared first:
    a fetch asks this of every waiting reply (up to the batch's size), and the
    slice and compare of ~5k tokens each took ~0.2 ms for 32 of them."""
    n = len(earlier)
    return 0 < n <= len(prompt) and prompt[n - 1] == earlier[-1] and prompt[:n] == earlier


class ModelPair(nn.Module):
    """A model and its draft as one model: mlx_lm.server appends the draft's
    caches to the model's, so a namespace covers both layouts."""

    def __init__(self, model: nn.Module, draft: nn.Module):
        super().__init__()
        self.model, self.draft = model, draft
        self.split = len(mlx_cache.make_prompt_cache(model))

    @property
    def layers(self) -> list:
        return [*self.model.layers, *self.draft.layers]

    def make_cache(self) -> list:
        return mlx_cache.make_prompt_cache(self.model) + mlx_cache.make_prompt_cache(self.draft)

    def __call__(self, inputs, cache):
        self.draft(inputs, cache=cache[self.split :])
        return self.model(inputs, cache=cache[: self.split])


def split_segments(segments: list[list[int]], kinds: list[str], points) -> tuple[list, list]:
    """Cut prompt segments at absolute positions `points`: mlx_lm.server inserts
    the cache at the end of every segment but the last."""
    cuts = sorted(set(points))
    out, out_kinds, start = [], [], 0
    for segment, kind in zip(segments, kinds):
        end, lo = start + len(segment), start
        for p in cuts:
            if lo < p < end:
                out.append(segment[lo - start : p - start])
                out_kinds.append(kind)
                lo = p
        out.append(segment[lo - start :])
        out_kinds.append(kind)
        start = end
    return out, out_kinds


@dataclass
class _Insert:
    """An insert mlx-lm handed over, settled on the generation thread when it
    was: the namespace, the tokens and the cache holding them, their owners."""

    space: Space
    tenant: Tenant
    reply_of: InFlightRequest | None  # the chat request whose reply the tokens end with
    tokens: list[int]
    held: int  # the positions the cache holds (the last reply token may not have been run)
    cache: list
    cache_type: str
    owners: frozenset
    asked: list[int]  # the shortest owner's prompt: a finished request's, which its next turn goes on with

    def nbytes(self) -> int:
        return sum(int(getattr(c, "nbytes", 0)) for c in self.cache)


@dataclass
class _ReplyPrefill:
    """A reply rendered as the next turn sends it, to prefill from `position`."""

    item: _Insert
    rendered: list[int]
    cache: list
    position: int
    phases: dict

    @property
    def new(self) -> int:
        return len(self.rendered) - self.position


@dataclass
class _Pending:
    """The fetch `_tokenize` made, for the fetch_nearest_cache call that follows it."""

    request: InFlightRequest
    hit: Hit | None


class StoreCache:
    """LRUPromptCache's interface over a PromptStore (called on the generation thread)."""

    def __init__(
        self,
        store: PromptStore,
        *,
        model_id=None,
        kv_bits=None,
        kv_group_size=64,
        reply_tokens="rendered",
        tenants: tuple[Tenant, ...] = (PUBLIC,),
    ):
        self.store = store
        self.tenants = tenants
        self.model_id = model_id
        self.kv_variants = (None, kv_bits) if kv_bits else (None,)
        self.kv_group_size = kv_group_size
        self.reply_tokens = reply_tokens
        self.inflight = InFlight()
        self.counts: Counter = Counter()
        self.model = self.tokenizer = self.model_key = None
        self.identity: str | None = None
        self.prefill_step = 2048
        self._spaces: dict[tuple, Space] = {}
        self._pending: _Pending | None = None
        self.last_hit: Hit | None = None  # the figures of the last begin()'s hit, for its request's log line
        self._busy: deque[tuple[float, float]] = deque(maxlen=1024)  # store calls on the generation thread
        # Finished requests' inserts, done when no request waits for its first
        # token (run_background); at most this many wait, each holding its
        # cache (the server sets it to its batch's size, --decode-concurrency).
        self.background = True
        self.background_limit = 32
        # Whether a request runs the waiting insert of its own conversation's last
        # reply before its fetch. mlx-lm pads a batch's prompts to the longest, so a
        # next turn that prefills its previous reply makes every prompt of its batch
        # that long: on CPU that multiplies the batch's prefill (a round of six
        # chats on 2 cores: 550 ms to the first tokens against 165); on an H200 a
        # batch of four ~5k-token chats padded from ~19 to ~69 new tokens took
        # 60-100 ms longer, a reply's insert alone 21-74 ms, median 38 (docs/serve.md).
        self.replies_before_fetch = True
        # Replies stored before a fetch are prefilled as one batch (several
        # conversations' next turns come together), holding at most this many
        # bytes of their caches at once (the batch copies them).
        self.batch_replies = True
        self.reply_batch_bytes = REPLY_BATCH_BYTES
        self._background: deque[_Insert] = deque()
        self._deferred: deque[_Insert] = deque()  # parts of prompts handed over by mlx-lm, not yet stored

    @contextmanager
    def _timed(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self._busy.append((started, time.perf_counter()))

    def busy_between(self, start: float, end: float) -> float:
        """Seconds the generation thread spent in store calls between two instants."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in list(self._busy))

    # --- binding ------------------------------------------------------------------

    def attach(self, model, tokenizer, draft, model_key, prefill_step: int) -> None:
        """Bind to the loaded model (on the generation thread, once it is loaded)."""
        self.model = ModelPair(model, draft) if draft is not None else model
        self.tokenizer, self.model_key, self.prefill_step = tokenizer, model_key, prefill_step
        _, adapter, draft_path = model_key
        if self.model_id:
            extras = [f"adapter={adapter}" if adapter else "", f"draft={draft_path}" if draft_path else ""]
            self.identity = "|".join([self.model_id, *filter(None, extras)])
        else:
            started = time.perf_counter()
            self.identity = "weights-xxh3:" + weights_digest(self.model)  # adapters and draft included
            log.info("model identity: a digest of its weights (%.1f s)", time.perf_counter() - started)
        self._spaces.clear()
        warming = self.store.warming
        if warming is not None and warming.running:
            # Bound now (a digest of a salt takes a moment), so that the warm start
            # reads this model's namespaces only, for every tenant this server knows.
            warming.restrict(space.namespace.key for tenant in self.tenants for space in self.spaces(tenant))

    def spaces(self, tenant: Tenant) -> list[Space]:
        """The namespaces of this model for `tenant`: plain, then quantized with --kv-bits."""
        out = []
        for bits in self.kv_variants:
            key = (tenant.salt, bits)
            if key not in self._spaces:
                self._spaces[key] = self.store.bind(
                    self.model, model_id=self.identity, salt=tenant.salt, kv_bits=bits, kv_group_size=self.kv_group_size
                )
            out.append(self._spaces[key])
        return out

    # --- fetch --------------------------------------------------------------------

    def begin(self, tenant: Tenant, prompt: list[int], chat: ChatTurn | None, boundaries, cacheable=True, *, coming=()):
        """A request was tokenized: track it and fetch its longest stored prefix.

        coming: (tenant, prompt) of the requests queued behind this one, whose
        conversations' waiting replies are stored with its own.
        Returns the prompt to hand mlx_lm.server (its lifetime is the request's)
        and the positions where the store asks for checkpoints.
        """
        self.run_deferred()  # the fetch finds every part of a prompt handed over before it
        if self.replies_before_fetch and self._background:
            self._run_replies_of([(tenant, list(prompt)), *coming])  # and its conversation's last reply
        request = InFlightRequest(tenant, list(prompt), chat)
        tracked: TrackedPrompt = self.inflight.track(request)
        hit = None
        if cacheable and self.model is not None:
            with self._timed():
                hit = self._fetch(tenant, request.prompt, boundaries)
        self._pending = _Pending(request, hit)
        self.last_hit = hit.figures() if hit is not None else None
        return tracked, (hit.checkpoints if hit is not None else ())

    def _fetch(self, tenant: Tenant, tokens: list[int], boundaries) -> Hit | None:
        best = None
        try:
            for space in self.spaces(tenant):
                hit = space.fetch(tokens, checkpoints=[p for p in boundaries if 0 < p < len(tokens)])
                if best is None or hit.length > best.length:
                    best = hit
        except PromptStoreError as e:
            log.warning("fetch of %d tokens missed: %s", len(tokens), e)
        return best

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        """(per-layer caches at the hit, tokens after it), or (None, tokens).

        model: mlx_lm.server's model key (model path, adapter, draft model).
        """
        pending, self._pending = self._pending, None
        if pending is None or model != self.model_key or pending.request.prompt != list(tokens):
            return None, tokens  # not the request just tokenized (an image prompt's key): a miss
        hit = pending.hit
        if hit is None or hit.length == 0:
            return None, tokens
        self.counts["restored_tokens"] += hit.length
        return hit.cache, tokens[hit.length :]

    # --- insert -------------------------------------------------------------------

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list, *, cache_type: str = "assistant"):
        """Store what `prompt_cache` (holding `tokens`, or all but the last) adds.

        Who owns the tokens is settled now; the store's work (an index commit
        synced to disk among it) is done later, never inside a request's time to
        its first token. A part of a prompt (mlx-lm stores it at a segment's
        end, before it hands out the prompt's first token) waits for
        `run_deferred`, which the generation thread calls before a batch step
        once no request waits for its first token, before it waits for a
        request, and before any fetch (so a fetch finds every earlier part of a
        prompt); at most one part of each request waits. A finished request's
        insert (its reply, rendered as the next turn will send it, which costs
        a prefill) waits for `run_background`: when the generation thread has
        no request to take, or no request in its batch still waits for its
        first token. The next turn of that conversation, when it comes first,
        runs it before its fetch (`replies_before_fetch`), together with those
        of the requests queued behind it (one batched prefill); without that,
        it prefills the reply in its own batch and stores it with its prompt,
        and the insert then finds it stored and costs a lookup.

        A failed insert is logged and skipped: it must never stop the generation
        thread, and the store leaves itself as it was.
        """
        try:
            with self._timed():
                item = self._prepare_insert(model, [int(t) for t in tokens], prompt_cache, cache_type)
        except Exception:
            log.exception("insert of %d tokens (%s) not stored", len(tokens), cache_type)
            return
        if item is None:
            return
        if any(len(item.tokens) <= len(o.prompt) for o in item.owners):  # within a prompt
            if any(item.owners & waiting.owners for waiting in self._deferred):
                self.run_deferred()  # at most one part of each request's prompt waits
            _own_copy(prompt_cache)  # so that what waits holds its request's arrays, not the batch's
            self._deferred.append(item)
        elif not self.background:
            self._run(item)
        else:
            if len(self._background) >= self.background_limit:
                self._background.popleft()  # the oldest reply: its next turn re-prefills it, if it comes
                self.counts["reply_inserts_dropped"] += 1
                log.debug("a finished request's insert dropped: %d wait already", self.background_limit)
            self._background.append(item)

    def run_deferred(self) -> None:
        """Do the inserts handed over since the last call, in order (generation thread)."""
        while self._deferred:
            self._run(self._deferred.popleft())

    @property
    def has_background(self) -> bool:
        return bool(self._background)

    def awaiting_first_token(self) -> bool:
        """Whether a request in flight has not had its first token handed out."""
        return self.inflight.awaiting_first_token()

    def run_background(self, n: int | None = None) -> None:
        """Do up to `n` (all when None) of the finished requests' inserts, oldest
        first (generation thread), after the parts of prompts handed over before them."""
        self.run_deferred()
        while self._background and (n is None or n > 0):
            self._run(self._background.popleft())
            n = None if n is None else n - 1

    def _run_replies_of(self, prompts: list[tuple[Tenant, list[int]]]) -> None:
        """Run the waiting inserts of the conversations these prompts go on with
        (their finished request's prompt, of the same tenant, is a prefix of one),
        oldest first; replies to prefill, in batches."""
        own = [
            item
            for item in self._background
            if any(tenant == item.tenant and _goes_on_with(prompt, item.asked) for tenant, prompt in prompts)
        ]
        for item in own:
            self._background.remove(item)
        if len(own) == 1 or not self.batch_replies:
            for item in own:
                self._run(item)
            return
        prefills = []
        for item in own:
            started = time.perf_counter()
            try:
                with self._timed():
                    if item.reply_of is None or self.reply_tokens != "rendered":
                        self._insert(item)
                        continue
                    prefill_, stored, phases = self._render_reply(item)
                    if prefill_ is None:
                        self._logged(item.held, stored, phases, started)
                    elif prefill_.new == 0:
                        self._finish_reply(prefill_, 0.0, started)
                    else:
                        prefills.append(prefill_)
            except Exception:
                log.exception("insert of %d tokens (%s) not stored", len(item.tokens), item.cache_type)
        for group in _reply_batches(prefills, self.reply_batch_bytes):
            self._prefill_replies(group)

    def _prefill_replies(self, group: list[_ReplyPrefill]) -> None:
        """Prefill the replies of `group` as one batch and store each; one by one
        where the batch cannot be made (a cache kind mlx-lm does not batch)."""
        started = time.perf_counter()
        caches = None
        if len(group) > 1 and not isinstance(self.model, ModelPair):
            try:
                with self._timed():
                    caches = prefill_together(
                        self.model,
                        [p.cache for p in group],
                        [p.rendered[p.position :] for p in group],
                        self.prefill_step,
                    )
            except Exception as e:
                log.debug("replies not prefilled together (%s): one by one", e)
        seconds = time.perf_counter() - started
        total = sum(p.new for p in group)
        for i, p in enumerate(group):
            try:
                with self._timed():
                    if caches is not None:
                        p.cache, p.phases["batch"] = caches[i], len(group)
                        self.counts["reply_prefills_batched"] += 1
                        self._finish_reply(p, seconds * p.new / total, started)
                    else:
                        self._prefill_reply(p)
            except Exception:
                log.exception("insert of %d tokens (%s) not stored", len(p.item.tokens), p.item.cache_type)
        if caches is not None:
            log.debug("%d replies prefilled together: %d tokens in %.1f ms", len(group), total, seconds * 1e3)

    def _run(self, item: _Insert) -> None:
        try:
            with self._timed():
                self._insert(item)
        except Exception:
            log.exception("insert of %d tokens (%s) not stored", len(item.tokens), item.cache_type)

    def _prepare_insert(self, model_key, tokens: list[int], prompt_cache, cache_type: str) -> _Insert | None:
        """The insert of `tokens` (None if nothing is to be stored)."""
        if model_key != self.model_key or not tokens or min(tokens) < 0:
            return None  # another model, or an image prompt's key (negative placeholder ids)
        owners = self.inflight.owners(tokens)
        tenants = {o.tenant for o in owners}
        if len(tenants) != 1:
            # Requests of two tenants agree with these tokens (or none does): storing
            # them in either namespace could hand one tenant's state to the other.
            self.counts["inserts_skipped_ambiguous" if owners else "inserts_skipped_unowned"] += 1
            log.debug("insert of %d tokens skipped: %d tenants in flight share them", len(tokens), len(tenants))
            return None
        tenant = tenants.pop()
        cache = C.adopt_prompt_cache(prompt_cache)
        held = self._held(cache, len(tokens))
        if not held:
            return None
        reply_of = next((o for o in owners if o.chat is not None and len(tokens) > len(o.prompt)), None)
        asked = min((o.prompt for o in owners), key=len)
        space = self._space_for(tenant, cache)
        return _Insert(space, tenant, reply_of, tokens, held, cache, cache_type, frozenset(owners), list(asked))

    def _insert(self, item: _Insert) -> None:
        started = time.perf_counter()
        if item.reply_of is None or self.reply_tokens != "rendered":
            stored = item.space.insert(item.tokens[: item.held], item.cache)
            self._logged(item.held, stored, {}, started, item.space)
            return
        prefill_, stored, phases = self._render_reply(item)
        if prefill_ is None:
            self._logged(item.held, stored, phases, started)
        else:
            self._prefill_reply(prefill_, started)

    def _logged(self, held: int, stored: int, phases: dict, started: float, space: Space | None = None) -> None:
        if space is not None:
            phases.update(space.last_insert_phases())  # the store's part, phase by phase
        phases["total"] = time.perf_counter() - started
        log.info(
            "insert: %d tokens, %d new; %s",
            held,
            stored,
            " ".join(f"{k}_ms={v * 1e3:.1f}" if k != "batch" else f"{k}={v}" for k, v in phases.items()),
        )

    def _held(self, cache: list, n_tokens: int) -> int:
        """Positions the cache holds (never more than the tokens named), 0 if unusable."""
        if isinstance(self.model, ModelPair):
            main, draft = cache[: self.model.split], cache[self.model.split :]
            pm, pd = C.prompt_position(main), C.prompt_position(draft)
            if pm != pd and not C.restore_prompt_cache(main if pm > pd else draft, None, min(pm, pd)):
                return 0  # the two models' caches cannot be brought to one position
        if all(layer["kind"] == "arrays" for layer in C.prompt_layout(cache)):
            held = C.prompt_position(cache, n_tokens)  # recurrent layers alone do not know their position
        else:
            held = C.prompt_position(cache)
        return held if held <= n_tokens else 0

    def _space_for(self, tenant: Tenant, cache: list) -> Space:
        spaces = self.spaces(tenant)
        quantized = any(layer["kind"] == "quantized" for layer in C.prompt_layout(cache))
        return spaces[-1] if quantized else spaces[0]

    def _render_reply(self, item: _Insert) -> tuple[_ReplyPrefill | None, int, dict]:
        """The conversation as the next turn renders it, and what of it to prefill
        (only what differs from what the cache holds); what needs no prefill is
        stored now. Returns (the prefill, or None; tokens stored; seconds per phase).

        item.tokens: prompt and reply as mlx-lm names them; the cache holds the
        first `held` (the last reply token may not have been run through the model).
        """
        space, request = item.space, item.reply_of
        t0 = time.perf_counter()
        try:
            rendered = rendered_turn(self.tokenizer, request.chat, item.tokens[len(request.prompt) :], request.prompt)
        except Exception as e:  # a template that cannot render its own reply: keep the tokens
            log.debug("reply not rendered (%s): storing the generated tokens", e)
            rendered = []
        tokens = item.tokens[: item.held]
        common = common_prefix(tokens, rendered)
        t1 = time.perf_counter()
        if len(rendered) >= 2 and space.restorable_length(rendered) == len(rendered):
            # Stored meanwhile (the next turn's prompt holds it): nothing to prefill.
            self.counts["reply_inserts_already_stored"] += 1
            return None, 0, {"render": t1 - t0, "lookup": time.perf_counter() - t1}
        if len(rendered) < 2 or common == len(rendered) == len(tokens):
            stored = space.insert(tokens, item.cache)
            return None, stored, {"render": t1 - t0, "store": time.perf_counter() - t1, **space.last_insert_phases()}
        cache, position = item.cache, min(common, len(tokens))
        if position < len(tokens) and not C.restore_prompt_cache(cache, None, position):
            # Window or recurrent layers cannot rewind: restart from the store (the
            # store's own fetch, not a request's hit).
            hit = space.fetch(rendered, count=False)
            cache, position = hit.cache, hit.length
        return _ReplyPrefill(item, rendered, cache, position, {"render": t1 - t0}), 0, {}

    def _prefill_reply(self, p: _ReplyPrefill, started: float | None = None) -> None:
        """Prefill one reply on its own, then store it."""
        t = time.perf_counter()
        prefill(self.model, p.cache, p.rendered, p.position, len(p.rendered), self.prefill_step)
        self._finish_reply(p, time.perf_counter() - t, t if started is None else started)

    def _finish_reply(self, p: _ReplyPrefill, prefill_seconds: float, started: float) -> None:
        """Store a prefilled reply; `prefill_seconds`: its prefill's share of the time."""
        space = p.item.space
        t = time.perf_counter()
        stored = space.insert(p.rendered, p.cache, prefill_seconds=prefill_seconds)
        self.counts["reply_tokens_prefilled"] += p.new
        p.phases.update(prefill=prefill_seconds, store=time.perf_counter() - t)
        self._logged(p.item.held, stored, p.phases, started, space)

    # --- what mlx_lm.server reads ---------------------------------------------------

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """The store keeps its own budgets (hot_bytes, disk_bytes): nothing to trim here."""

    def __len__(self) -> int:
        return len(self.store.tiers.hot)

    @property
    def nbytes(self) -> int:
        return self.store.tiers.hot.nbytes

    def stats_by_type(self) -> dict:
        return {"hot (promptstore nodes)": {"n_sequences": len(self), "n_bytes": self.nbytes}}
