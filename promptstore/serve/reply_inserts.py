"""Storing finished chat replies as the next turn renders them.

The client sends a reply back as text, and the chat template renders it with
its own end-of-turn marker, so what the next turn sends may differ from what
the cache holds. A reply whose tokens round-trip (the rendering goes on from
everything the cache holds) is stored as the cache holds it, with no forward:
the next turn prefills only the template's end-of-turn tokens, in its own
batch. A reply that re-tokenizes otherwise is prefilled from where the two
differ; the replies waiting are prefilled together, in one batched forward
per chunk (mlx-lm's batch caches: `merge`, right padding, `extract`), so
storing the replies of a round costs about one forward however many users
there are, not one each (issue 62: ~300 ms for 8 replies on an H200, one
after another).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from .. import caches as C
from ..generation import prefill
from ..store import Space
from .pieces import PieceTokenizer
from .replies import common_prefix, rendered_turn
from .tenants import InFlightRequest

log = logging.getLogger("promptstore.serve")


@dataclass
class ReplyJob:
    """A finished chat request's insert: its prompt and reply as mlx-lm names
    them (`named`), the cache holding the first `usable` of them, and how long
    its owners asked to keep them (`kept`, as `Space.insert` takes marks)."""

    space: Space
    request: InFlightRequest
    named: list[int]
    usable: int
    cache: list | None
    kept: tuple = ()
    phases: dict = field(default_factory=dict)  # seconds per phase, for its insert line
    stored: int = 0  # tokens the store took new


@dataclass
class _Prefill:
    """A reply that needs a forward: `rendered[position:]` onto `cache`."""

    job: ReplyJob
    rendered: list[int]
    cache: list
    position: int

    @property
    def tail(self) -> list[int]:
        return self.rendered[self.position :]


def kept_marks(kept: tuple, n_tokens: int) -> tuple:
    """`kept` as an insert of `n_tokens` takes it (a whole-request mark: all of them)."""
    return tuple((n_tokens if end is None else end, r) for end, r in kept)


def _even_tails(prefills: list[_Prefill]) -> int:
    """Start every reply's prefill as far back as the longest one's tail, where
    its cache can rewind there (plain KV layers): a batch of equal tails needs no
    right padding, and so no roll of the whole cache back into place after it
    (`finalize`; on CPU 120-190 ms for 8 replies on 3k-token caches). The tokens
    run again are ones the cache held: what they compute is the same. A cache
    that cannot rewind keeps its tail (the batch is padded then). Returns how
    many replies were rewound."""
    width, rewound = max(len(p.tail) for p in prefills), 0
    for p in prefills:
        start = len(p.rendered) - width
        if 0 <= start < p.position and C.restore_prompt_cache(p.cache, None, start):
            p.position, rewound = start, rewound + 1
    return rewound


def batchable(cache: list) -> bool:
    """Whether mlx-lm can batch these layers with others (a quantized KV cannot)."""
    return all(callable(getattr(type(c), "merge", None)) for c in cache)


class ReplyStorer:
    """Runs reply jobs for a StoreCache: `run(jobs)` plans each, prefills those
    that need it (together when more than one can be batched), and stores them.

    counts: where it counts replies and forwards."""

    def __init__(self, owner, counts: Counter):
        self._owner = owner  # the StoreCache: its model, tokenizer, pieces and prefill step, once attached
        self._counts = counts
        self.even_tails = True  # rewind to even tails where caches can (off: padded, as a benchmark compares)

    def run(self, jobs: list[ReplyJob], chunk: int | None) -> Iterator[None]:
        """Store every job; yields every `chunk` tokens of the prefill (None: all
        at once), where a request may go first."""
        started = time.perf_counter()
        prefills = []
        for job in jobs:
            try:
                planned = self._plan(job)
            except Exception:
                log.exception("insert of %d tokens (reply) not stored", job.usable)
                continue
            if planned is not None:
                prefills.append(planned)
        if not prefills:
            return
        model = self._owner.model
        batch = None
        if len(prefills) > 1 and all(batchable(p.cache) for p in prefills):
            if self.even_tails:
                self._counts["reply_tails_rewound"] += _even_tails(prefills)
            batch = self._merged(prefills)
        if batch is not None:
            forwards, spent = yield from self._together(model, batch, prefills, chunk)
        else:
            forwards, spent = 0, 0.0
            for p in prefills:
                n, seconds = yield from self._alone(model, p, chunk)
                forwards, spent = forwards + n, spent + seconds
        tokens = sum(len(p.tail) for p in prefills)
        self._counts["reply_forwards"] += forwards
        self._counts["reply_tokens_prefilled"] += tokens
        self._counts["reply_inserts_prefilled"] += len(prefills)
        log.info("reply forwards: n=%d replies=%d tokens=%d ms=%.1f", forwards, len(prefills), tokens, spent * 1e3)
        for p in prefills:
            share = spent * len(p.tail) / max(1, tokens)  # the forward's time, by each reply's tokens
            self._store(p, share)
        log.debug("%d replies stored in %.1f ms", len(jobs), (time.perf_counter() - started) * 1e3)

    # --- the plan: what each reply needs -----------------------------------------------

    def _plan(self, job: ReplyJob) -> _Prefill | None:
        """Render the reply; store it now when no forward is needed (None), else
        say what to prefill. The job's cache is given up to the plan."""
        t0 = time.perf_counter()
        owner, request = self._owner, job.request
        try:
            tokenizer = owner.tokenizer
            if owner.pieces is not None:
                tokenizer = PieceTokenizer(tokenizer, owner.pieces, request.tenant.salt)
            rendered = rendered_turn(tokenizer, request.chat, job.named[len(request.prompt) :], request.prompt)
        except Exception as e:  # a template that cannot render its own reply: keep the tokens
            log.debug("reply not rendered (%s): storing the generated tokens", e)
            rendered = []
        space, cache, job.cache = job.space, job.cache, None
        tokens = job.named[: job.usable]
        common = common_prefix(tokens, rendered)
        t1 = time.perf_counter()
        job.phases["render"] = t1 - t0
        if len(rendered) >= 2 and space.restorable_length(rendered) == len(rendered):
            # Stored meanwhile (the next turn's prompt holds it): nothing to prefill.
            self._counts["reply_inserts_already_stored"] += 1
            space.retain(rendered, kept_marks(job.kept, len(rendered)))
            job.phases["lookup"] = time.perf_counter() - t1
            self._said(job, len(rendered))
            return None
        if len(rendered) < 2 or common == len(tokens):
            # Everything the cache holds is where the next turn goes (the reply
            # round-trips; the template's end-of-turn tokens follow it): stored
            # as held, with no forward. The next turn prefills the rest.
            job.stored = space.insert(tokens, cache, retention=kept_marks(job.kept, len(tokens)), turn=True)
            job.phases["store"] = time.perf_counter() - t1
            self._counts["reply_inserts_no_forward"] += 1
            log.info("reply stored without a forward: tokens=%d", len(tokens))
            self._said(job, len(tokens))
            return None
        position = common
        if not C.restore_prompt_cache(cache, None, position):
            # Window or recurrent layers cannot rewind: restart from the store (the
            # store's own fetch, not a request's hit).
            hit = space.fetch(rendered, count=False)
            cache, position = hit.cache, hit.length
        job.phases["lookup"] = time.perf_counter() - t1
        return _Prefill(job, rendered, cache, position)

    # --- the forwards ------------------------------------------------------------------

    def _alone(self, model, p: _Prefill, chunk: int | None) -> Iterator[None]:
        """One reply's prefill, in chunks; returns the forwards it ran and their
        seconds (not the time it gave way)."""
        step, forwards, spent = chunk or len(p.rendered), 0, 0.0
        steps = self._owner.prefill_step
        for lo in range(p.position, len(p.rendered), step):
            hi, t = min(lo + step, len(p.rendered)), time.perf_counter()
            prefill(model, p.cache, p.rendered, lo, hi, steps)
            forwards, spent = forwards + -(-(hi - lo) // steps), spent + time.perf_counter() - t
            if hi < len(p.rendered):
                yield  # a request that came meanwhile may go first (run_background's `until`)
        return forwards, spent

    @staticmethod
    def _merged(prefills: list[_Prefill]) -> list | None:
        """The replies' caches as one batch, layer by layer (left padded to the
        longest); None where mlx-lm cannot merge them (each then runs alone)."""
        try:
            batch = [prefills[0].cache[i].merge([p.cache[i] for p in prefills]) for i in range(len(prefills[0].cache))]
        except Exception as e:  # a cache kind or layout mlx-lm's batch does not take
            log.debug("replies not batched (%s): one at a time", e)
            return None
        for p in prefills:
            p.cache = None  # the batch holds the reply's state now (its own arrays may go)
        return batch

    def _together(self, model, batch: list, prefills: list[_Prefill], chunk: int | None) -> Iterator[None]:
        """Every reply's prefill in one batch (`batch`, their merged caches): the
        tails right padded to the longest and run in chunks, then each reply's
        cache taken back out. Returns the forwards it ran and their seconds (not
        the time it gave way)."""
        n, t = len(prefills), time.perf_counter()
        tails = [p.tail for p in prefills]
        lengths = [len(t) for t in tails]
        width = max(lengths)
        padding = [width - k for k in lengths]
        if max(padding) > 0:
            for c in batch:
                c.prepare(lengths=lengths, right_padding=padding)
        inputs = mx.array([t + [0] * (width - len(t)) for t in tails])
        step = min(chunk or width, self._owner.prefill_step)
        forwards, spent = 0, 0.0
        for lo in range(0, width, step):
            model(inputs[:, lo : lo + step], cache=batch)
            mx.eval([c.state for c in batch])
            forwards += 1
            if lo + step < width:
                spent += time.perf_counter() - t
                yield
                t = time.perf_counter()
        if max(padding) > 0:
            for c in batch:
                c.finalize()
        for i, p in enumerate(prefills):
            p.cache = C.adopt_prompt_cache([c.extract(i) for c in batch], len(p.rendered))
        mx.eval([c.state for p in prefills for c in p.cache])
        self._counts["reply_batches"] += 1
        self._counts["reply_batched"] += n
        return forwards, spent + time.perf_counter() - t

    # --- the store ---------------------------------------------------------------------

    def _store(self, p: _Prefill, seconds: float) -> None:
        job, t = p.job, time.perf_counter()
        try:
            job.stored = job.space.insert(
                p.rendered, p.cache, prefill_seconds=seconds, retention=kept_marks(job.kept, len(p.rendered)), turn=True
            )
        except Exception:
            log.exception("insert of %d tokens (reply) not stored", len(p.rendered))
            return
        finally:
            p.cache = None
        job.phases |= {"prefill": seconds, "store": time.perf_counter() - t}
        self._said(job, len(p.rendered))

    def _said(self, job: ReplyJob, n_tokens: int) -> None:
        job.phases.update(job.space.last_insert_phases())
        job.phases["total"] = sum(v for k, v in job.phases.items() if k in ("render", "lookup", "prefill", "store"))
        log.info(
            "insert: %d tokens, %d new; %s",
            n_tokens,
            job.stored,
            " ".join(f"{k}_ms={v * 1e3:.1f}" for k, v in job.phases.items()),
        )
