"""The prompt cache mlx_lm.server's generation thread calls (LRUPromptCache's
methods) over a PromptStore: a namespace per model key and tenant, checkpoints
at prompt segment ends, and after a chat reply the conversation as rendered;
each insert kept as long as the requests that own its tokens asked, and run
when its InsertScheduler says (serve/insert_scheduler.py)."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from .. import caches as C
from ..errors import CacheError, ModelIdentityError, PromptStoreError
from ..store import Hit, PromptStore, Space
from ..store.model import weights_digest, weights_fingerprint
from .insert_scheduler import InsertScheduler, InsertSettings, WaitingInsert
from .pieces import Pieces
from .replies import ChatTurn
from .reply_inserts import ReplyJob, ReplyStorer, kept_marks
from .tenants import PUBLIC, InFlight, InFlightRequest, Tenant, TrackedPrompt

log = logging.getLogger("promptstore.serve")


def _own_copy(prompt_cache: list) -> None:
    """Start computing a cache mlx-lm extracted from its batch (a lazy slice of
    the batch's arrays): once computed it holds its own copy, and the batch's
    arrays, which the next steps replace, are no longer kept alive by it."""
    try:
        arrays = [a for _, a in tree_flatten([c.state for c in prompt_cache]) if isinstance(a, mx.array)]
        mx.async_eval(arrays)
    except Exception as e:  # a cache kind without arrays to compute: nothing to start
        log.debug("extracted cache not computed ahead: %s", e)


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


def _kept(owners) -> tuple:
    """How long the owners of an insert's tokens asked to keep them: their marks,
    a whole-request one (end None) reaching only as far as that request's own
    tokens do (past a longer owner's prompt, the tokens are that owner's)."""
    longest = max((len(o.prompt) for o in owners), default=0)
    out = []
    for owner in owners:
        whole = None if len(owner.prompt) == longest else len(owner.prompt)
        out.extend((whole if end is None else end, r) for end, r in owner.retention)
    return tuple(out)


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
        spans_weights: bool = False,
        inserts: InsertSettings | None = None,
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
        self.pieces: Pieces | None = None  # the server's kept pieces of rendered chats (serve/pieces.py)
        self.identity: str | None = None
        self.fingerprint: str | None = None  # the model's weights_fingerprint, with a model_id
        self.spans_weights = spans_weights  # the model_id spans versions of the weights (store.bind)
        self.prefill_step = 2048
        self._spaces: dict[tuple, Space] = {}
        self._pending: _Pending | None = None
        self.last_hit: Hit | None = None  # the figures of the last begin()'s hit, for its request's log line
        self._busy: deque[tuple[float, float]] = deque(maxlen=1024)  # store calls on the generation thread
        # When the inserts mlx-lm hands over run (the defaults: InsertSettings's).
        self.inserts = InsertScheduler(inserts or InsertSettings(), self.counts, self._timed, self._run_replies)
        self.replies = ReplyStorer(self, self.counts)  # a chat reply's insert (serve/reply_inserts.py)

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
        started = time.perf_counter()
        if self.model_id:
            extras = [f"adapter={adapter}" if adapter else "", f"draft={draft_path}" if draft_path else ""]
            self.identity = "|".join([self.model_id, *filter(None, extras)])
            # What each namespace of the id checks its weights against (store.bind), once for them all.
            self.fingerprint = weights_fingerprint(self.model)
            log.info("model identity: --model-id, weights fingerprint in %.2f s", time.perf_counter() - started)
        else:
            self.identity = "weights-xxh3:" + weights_digest(self.model)  # adapters and draft included
            log.info("model identity: a digest of its weights (%.1f s)", time.perf_counter() - started)
        self._spaces.clear()
        # Every tenant's namespaces bound now (a digest of a salt takes a moment): a
        # model id bound to other weights is refused at start, not at a tenant's
        # first request, and the warm start reads this model's namespaces only.
        try:
            bound = [space.namespace.key for tenant in self.tenants for space in self.spaces(tenant)]
        except ModelIdentityError:
            raise ModelIdentityError(
                f"--model-id {self.model_id!r} was bound to other weights in this store: its cache would be "
                "restored into a different model. Start this model with another --model-id, or with "
                "--model-id-spans-weights if the id is meant to span versions of the weights",
                model_id=self.model_id,
            ) from None
        warming = self.store.warming
        if warming is not None and warming.running:
            warming.restrict(bound)

    def restorable_length(self, tenant: Tenant, tokens) -> int:
        """How many leading `tokens` the index says `tenant`'s plain namespace of this model
        could restore: a lookup, nothing read, from any thread (each index call is its own
        transaction). 0 where that namespace is not bound yet or refuses the tokens."""
        space = self._spaces.get((tenant.salt, self.kv_variants[0])) if self.kv_variants else None
        if space is None:
            return 0
        try:
            return space.restorable_length([int(t) for t in tokens])
        except PromptStoreError:
            return 0

    def spaces(self, tenant: Tenant) -> list[Space]:
        """The namespaces of this model for `tenant`: plain, then quantized with --kv-bits."""
        out = []
        for bits in self.kv_variants:
            key = (tenant.salt, bits)
            if key not in self._spaces:
                self._spaces[key] = self.store.bind(
                    self.model,
                    model_id=self.identity,
                    salt=tenant.salt,
                    spans_weights=self.spans_weights,
                    fingerprint=self.fingerprint,
                    kv_bits=bits,
                    kv_group_size=self.kv_group_size,
                )
            out.append(self._spaces[key])
        return out

    # --- fetch --------------------------------------------------------------------

    def begin(
        self,
        tenant: Tenant,
        prompt: list[int],
        chat: ChatTurn | None,
        boundaries,
        cacheable=True,
        retention=(),
        vision=None,
    ):
        """A request was tokenized: track it and fetch its longest stored prefix.

        Returns the prompt to hand mlx_lm.server (its lifetime is the request's)
        and the positions where the store asks for checkpoints. retention: how
        long to keep what it stores, (end, class) per prefix, (None, class) for
        all of it (StoreRequest.retention). vision: the VisionPrompt of a prompt
        with images (`prompt` its keys), whose hit never ends inside an image
        (mlx-lm's image path embeds whole images past it).
        """
        prompt = list(prompt)
        self.inserts.run_deferred()  # the fetch finds every part of a prompt handed over before it
        if self.inserts.settings.replies_before_fetch and self.inserts.has_background:
            self.inserts.run_replies_of(prompt)  # and its own conversation's last reply
        request = InFlightRequest(tenant, prompt, chat, retention=tuple(retention), vision=vision)
        tracked: TrackedPrompt = self.inflight.track(request)
        hit = None
        if cacheable and self.model is not None:
            with self._timed():
                hit = self._fetch(tenant, request.prompt, boundaries)
                inside = (
                    next((s for s in vision.spans if s.start < hit.length < s.end), None) if vision and hit else None
                )
                if inside is not None:  # restore to the image's start instead
                    hit = self._fetch(tenant, request.prompt[: inside.start + 1], boundaries)
        self._pending = _Pending(request, hit)
        self.last_hit = hit.figures() if hit is not None else None
        return tracked, (hit.checkpoints if hit is not None else ())

    def _fetch(self, tenant: Tenant, tokens: list[int], boundaries) -> Hit | None:
        """The longest hit of `tokens` among this model's namespaces, restoring in
        one: with --kv-bits the index says first which namespace holds more (a
        lookup, nothing read), and only that one restores, unless its hit falls
        short of what the other's index promised (a file gone bad, say)."""
        spaces = self.spaces(tenant)
        points = [p for p in boundaries if 0 < p < len(tokens)]
        promised = [len(tokens)] * len(spaces)  # no word from the index (a remote tier may hold more): all fetch
        if len(spaces) > 1 and not self.store.has_remote:
            promised = [space.restorable_length(tokens[:-1]) for space in spaces]
        best = None
        try:
            for space, length in sorted(zip(spaces, promised), key=lambda pair: -pair[1]):  # ties: plain first
                if best is None or length > best.length:
                    hit = space.fetch(tokens, checkpoints=points)
                    best = hit if best is None or hit.length > best.length else best
        except PromptStoreError as e:
            log.warning("fetch of %d tokens missed: %s", len(tokens), e)
        return best

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        """(per-layer caches at the hit, tokens after it), or (None, tokens).

        model: mlx_lm.server's model key (model path, adapter, draft model).
        """
        pending, self._pending = self._pending, None
        if pending is None or model != self.model_key or pending.request.prompt != list(tokens):
            return None, tokens  # not the request just tokenized: a miss
        hit = pending.hit
        if pending.request.vision is not None:
            return self._prefilled(pending, tokens)
        if hit is None or hit.length == 0:
            return None, tokens
        self.counts["restored_tokens"] += hit.length
        return hit.cache, tokens[hit.length :]

    def _prefilled(self, pending: _Pending, tokens: list[int]):
        """A prompt with images: its caches bound to its positions and prefilled to its
        last token, storing the hit's checkpoints and the prompt as it goes
        (mlx-lm's image path stores nothing before its reply: serve/vision.py)."""
        hit = pending.hit
        restored = hit.length if hit is not None else 0
        cache = hit.cache if restored else C.make_prompt_cache(self.model)
        self.model.bind(cache, pending.request.vision)
        self.counts["restored_tokens"] += restored
        points = hit.checkpoints if hit is not None else ()
        marks = pending.request.timeline if pending.request.timeline is not None else {}
        marks["prefill"] = time.perf_counter()
        done = self.model.prefill(
            pending.request.vision,
            cache,
            restored,
            points,
            self.prefill_step,
            lambda at: self._store_part(tokens, cache, at, marks),
            marks,
        )
        marks["prefilled"] = time.perf_counter()
        return cache, tokens[done:]

    def _store_part(self, tokens: list[int], cache: list, at: int, marks: dict) -> None:
        """Store `tokens[:at]` from `cache`, which is at `at` and goes on prefilling
        (the insert waits, with caches of its own); a failure is logged and skipped.
        marks["copies"]: the seconds spent copying caches so far."""
        started = time.perf_counter()
        try:
            held = C.make_prompt_cache(self.model)
            if not C.restore_prompt_cache(held, C.snapshot_prompt_cache(cache), at):
                raise CacheError(f"the prompt's caches could not be copied at {at}")
        except PromptStoreError as e:
            log.warning("part of an image prompt (%d tokens) not stored: %s", at, e)
            return
        finally:
            marks["copies"] = marks.get("copies", 0.0) + time.perf_counter() - started
        self.insert_cache(self.model_key, tokens[:at], held)

    # --- insert -------------------------------------------------------------------

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list, *, cache_type: str = "assistant"):
        """Store what `prompt_cache` (holding `tokens`, or all but the last) adds.

        Who owns the tokens is settled now; the store's work is done when the
        InsertScheduler runs it (serve/insert_scheduler.py): a part of a prompt
        once the request's first tokens are out, a finished request's insert once
        nothing waits to be served. Without `replies_before_fetch`, a next turn
        that comes first prefills the reply in its own batch and stores it with
        its prompt, and the insert then finds it stored and costs a lookup.

        A failed insert is logged and skipped: it must never stop the generation
        thread, and the store leaves itself as it was.
        """
        tokens = [int(t) for t in tokens]
        try:
            with self._timed():
                work, within_prompt, owners, ranged, reply = self._prepare_insert(model, tokens, prompt_cache)
        except Exception:
            log.exception("insert of %d tokens (%s) not stored", len(tokens), cache_type)
            return
        if work is None:
            return
        if within_prompt:
            _own_copy(prompt_cache)  # so that what waits holds its request's arrays, not the batch's
            self.inserts.add_part(
                WaitingInsert(work, len(tokens), cache_type, owners, [], tokens=tokens, ranged=ranged)
            )
        else:
            asked = tokens[: min(len(o.prompt) for o in owners)]  # the finished request's prompt
            self.inserts.add_finished(WaitingInsert(work, len(tokens), cache_type, owners, asked, reply=reply))

    def awaiting_first_token(self) -> bool:
        """Whether a request in flight has not had its first token handed out."""
        return self.inflight.awaiting_first_token()

    def _prepare_insert(self, model_key, tokens: list[int], prompt_cache):
        """The insert of `tokens` (None if nothing is to be stored), whether the
        tokens lie within an owner's prompt, the requests that own them, whether
        every cache restores any prefix of what it holds (role "range"), and a
        chat reply's job (stored as the next turn renders it), else None."""
        nothing = None, False, frozenset(), False, None
        if model_key != self.model_key or not tokens or min(tokens) < 0:
            return nothing  # another model, or mlx-lm's own image key (negative placeholder ids)
        owners = self.inflight.owners(tokens)
        tenants = {o.tenant for o in owners}
        if len(tenants) != 1:
            # Requests of two tenants agree with these tokens (or none does): storing
            # them in either namespace could hand one tenant's state to the other.
            self.counts["inserts_skipped_ambiguous" if owners else "inserts_skipped_unowned"] += 1
            log.debug("insert of %d tokens skipped: %d tenants in flight share them", len(tokens), len(tenants))
            return nothing
        tenant = tenants.pop()
        cache = C.adopt_prompt_cache(prompt_cache)
        usable = self._usable_length(cache, len(tokens))
        if not usable:
            return nothing
        reply_of = next((o for o in owners if o.chat is not None and len(tokens) > len(o.prompt)), None)
        space = self._space_for(tenant, cache)
        within_prompt = any(len(tokens) <= len(o.prompt) for o in owners)
        kept = _kept(owners)
        turn = any(o.chat is not None or o.vision is not None for o in owners)  # a chat's: a client comes back
        ranged = all(getattr(c, "role", None) == "range" for c in cache)
        if reply_of is not None and self.reply_tokens == "rendered":
            job = ReplyJob(space, reply_of, tokens, usable, cache, kept)
            return lambda: self._run_replies([job]), within_prompt, frozenset(owners), ranged, job
        work = lambda: self._insert(space, tokens, usable, cache, kept, turn)  # noqa: E731
        return work, within_prompt, frozenset(owners), ranged, None

    def _run_replies(self, jobs: list[ReplyJob]) -> Iterator[None]:
        """Store chat replies as their next turns render them, prefilled together (serve/reply_inserts.py)."""
        return self.replies.run(jobs, self.inserts.settings.reply_chunk)

    def _insert(self, space: Space, tokens: list[int], usable: int, cache, kept=(), turn=False) -> Iterator[None]:
        """The insert's steps (one). kept: how long the owners asked to keep the tokens
        (_kept); turn: a chat request owns them (Space.insert)."""
        started = time.perf_counter()
        yield from ()  # no point where it gives way: one store call
        stored, phases = space.insert(tokens[:usable], cache, retention=kept_marks(kept, usable), turn=turn), {}
        phases.update(space.last_insert_phases())  # the store's part, phase by phase
        phases["total"] = time.perf_counter() - started
        log.info(
            "insert: %d tokens, %d new; %s",
            usable,
            stored,
            " ".join(f"{k}_ms={v * 1e3:.1f}" for k, v in phases.items()),
        )

    def _usable_length(self, cache: list, n_tokens: int) -> int:
        """Positions the cache holds (never more than the tokens named), 0 if unusable."""
        if isinstance(self.model, ModelPair):
            main, draft = cache[: self.model.split], cache[self.model.split :]
            pm, pd = C.prompt_position(main), C.prompt_position(draft)
            if pm != pd and not C.restore_prompt_cache(main if pm > pd else draft, None, min(pm, pd)):
                return 0  # the two models' caches cannot be brought to one position
        if all(layer["kind"] == "arrays" for layer in C.prompt_layout(cache)):
            usable = C.prompt_position(cache, n_tokens)  # recurrent layers alone do not know their position
        else:
            usable = C.prompt_position(cache)
        return usable if usable <= n_tokens else 0

    def _space_for(self, tenant: Tenant, cache: list) -> Space:
        spaces = self.spaces(tenant)
        quantized = any(layer["kind"] == "quantized" for layer in C.prompt_layout(cache))
        return spaces[-1] if quantized else spaces[0]

    # --- what mlx_lm.server reads ---------------------------------------------------

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """The store keeps its own budgets (hot_bytes, disk_bytes): nothing to trim here."""

    def __len__(self) -> int:
        return self.store.in_memory()[0]

    @property
    def nbytes(self) -> int:
        return self.store.in_memory()[1]

    def stats_by_type(self) -> dict:
        return {"hot (promptstore nodes)": {"n_sequences": len(self), "n_bytes": self.nbytes}}
