"""The generation loop: mlx-lm's, on its own thread, with the store under it.

Tokenizing a request also tracks it and fetches its prefix from the store, then
waits for requests being checked to join it (Arrivals); a waiting request ends
a run of batch steps (ArrivalBudget); the store's waiting inserts run where the
loop would otherwise wait (InsertScheduler). A loop that fails is started again
(its requests in flight fail with it), and a close runs on the generation
thread, which owns the streams of every cache in flight.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import weakref
from queue import Empty as QueueEmpty
from queue import Queue
from typing import TYPE_CHECKING

from ..errors import GenerationFailed, PromptStoreError
from ..store.group import Group, GroupLost
from . import shutdown
from .arrivals import ArrivalBudget, Arrivals
from .cache import StoreCache, split_segments
from .checks import Rendered
from .metrics import HitFigures, MetricsAccess, ServeMetrics
from .mlx_lm_server import Response, ResponseGenerator
from .replies import ChatTurn
from .tenants import PUBLIC, KeyRing, TrackedPrompt
from .timeline import logged
from .vision import RenderedImages, has_images, render_images

if TYPE_CHECKING:
    from .provider import StoreModelProvider

log = logging.getLogger("promptstore.serve")

RESTARTS = 5  # the generation loop is started again after a failure, at most this many times
RESTART_WINDOW_S = 60.0  # within this long; one failure more and the server exits non-zero
RANK_METRICS_S = 5.0  # in a group, every rank's store figures reach rank 0's /metrics this often


class Replies(Queue):
    """A request's response queue: known to its generator until its last item
    (None) or an error is put (see StoreResponseGenerator._fail_replies). The
    generation thread's putting of the first token is marked in the request's
    timeline (`put`; its context and its prompt's progress, put before, are not tokens)."""

    def __init__(self, generator, timeline: dict | None = None):
        super().__init__()
        self._generator = weakref.ref(generator)
        self._timeline = timeline

    def put(self, item, block=True, timeout=None):
        timeline = self._timeline
        if timeline is not None and isinstance(item, Response):
            timeline.setdefault("put", time.perf_counter())
            self._timeline = None
        super().put(item, block, timeout)
        generator = self._generator()
        if generator is not None and (item is None or isinstance(item, BaseException)):
            with generator._replies_lock:
                generator._replies.discard(self)


class StoreResponseGenerator(ResponseGenerator):
    """mlx-lm's generation loop over a StoreCache (see the module's docstring)."""

    group: Group | None = None  # a rank of a distributed group: rank 0 decides, every rank does
    _gathered = 0.0  # in a group, when the ranks' store figures were last gathered (monotonic)

    def __init__(self, provider: StoreModelProvider, cache: StoreCache, keyring: KeyRing):
        # Set before super().__init__, which starts the generation thread.
        self.store_cache, self.inserts, self.keyring = cache, cache.inserts, keyring
        self.group = cache.store.group
        args = provider.cli_args
        self.arrivals = Arrivals(bound=args.arrival_wait)
        self.metrics = ServeMetrics(cache.store, provider.public_id, keyring, vision=provider.vision_counts)
        self.metrics_access = MetricsAccess(args.metrics, getattr(args, "metrics_key", None), keyring)
        self.metrics_access.warn()
        # Requests whose replies are still coming (their response queues): a
        # generation loop that fails fails them, and a closing waits for them.
        self._replies: weakref.WeakSet[Replies] = weakref.WeakSet()
        self._replies_lock = threading.Lock()
        self.restarts: list[float] = []  # when the generation loop was started again (monotonic)
        self.gave_up: str | None = None  # why generation stopped for good (the server then exits non-zero)
        self._closing: float | None = None  # when stop_and_join asked the generation thread to close
        self.closed_inserts: tuple[int, list[str]] | None = None  # (stored, not stored) at the close
        super().__init__(provider, cache)
        # Spills, and the pieces check, pause while a request waits for its first token.
        provider.busy = lambda: not self._quiet()
        if self.group is not None and self.group.rank != 0:
            # Its requests come from rank 0, whose HTTP threads mark their first
            # tokens: none are marked here, and spills would wait for ever.
            provider.busy = lambda: False
        cache.store.give_way(provider.busy)

    def step_budget(self, budget):
        return ArrivalBudget(budget, self.requests, before_step=self._before_step)

    @property
    def is_healthy(self) -> bool:
        return self.generation_available() and self.model_provider.ready

    # --- the generation thread's life --------------------------------------------------

    def generation_thread(self) -> None:
        """mlx_lm.server's generation loop, started again on this thread when it
        fails (its requests in flight fail with it, the others go on); after
        RESTARTS failures within RESTART_WINDOW_S it stops for good and the
        server exits non-zero, for a supervisor to start it afresh."""
        while True:
            try:
                self.run_loop()
                return
            except (Exception, GroupLost) as e:
                if not self.model_provider.ready and self._closing is None:
                    self._failed_at_load(e)
                    return
                log.exception("generation failed: %s", e)
                failed = self._fail_replies(e)
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
                # A rank of a group does not start its loop again alone: the others would
                # wait for it in a collective. The group stops (mlx.launch stops the others).
                if len(self.restarts) > RESTARTS or self._closing is not None or self.group is not None:
                    self.gave_up = f"{type(e).__name__}: {e}"
                    self.mark_failed()
                    if self._closing is None:
                        if self.group is not None:
                            log.error("generation failed on rank %d of a group: the group stops", self.group.rank)
                        else:
                            log.error(
                                "generation failed %d times in %.0f s: the server exits", RESTARTS + 1, RESTART_WINDOW_S
                            )
                        self.exit_for_supervisor()
                    return
                log.warning("generation started again (%d requests in flight failed with it)", failed)

    def _failed_at_load(self, error: Exception) -> None:
        """The model did not load, or the store refused it (a model id bound to other
        weights): the server exits non-zero at once. A loop started again would not
        load it again (mlx-lm keeps the key of a model it loaded) and would serve
        it with no store attached. A promptstore error is one line, as at start."""
        self.gave_up = f"{type(error).__name__}: {error}"
        self.mark_failed()
        if isinstance(error, PromptStoreError) and not self.cli_args.debug:
            print(f"promptstore serve: error: {error}", file=sys.stderr, flush=True)
        else:
            log.error("the model could not be served: %s", error, exc_info=error)
        self.exit_for_supervisor()

    def exit_for_supervisor(self) -> None:
        """Stop serving, as SIGTERM does: main() closes the store and exits non-zero."""
        if shutdown.installed is not None:
            shutdown.installed.stop_serving()
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def _fail_replies(self, error: Exception) -> int:
        """Fail every request whose reply is still coming: nothing more would come."""
        with self._replies_lock:
            waiting = list(self._replies)
            self._replies.clear()
        for replies in waiting:
            replies.put(GenerationFailed(f"generation failed while serving this request: {error}"))
        return len(waiting)

    # --- requests in --------------------------------------------------------------------

    def generate(self, request, generation_args, progress_callback=None):
        timeline = getattr(request, "timeline", {})
        timeline.setdefault("received", time.perf_counter())
        timeline["queued"] = time.perf_counter()
        self.arrivals.done(getattr(request, "arrival", None))
        ctx, responses = self._queue(request, generation_args, progress_callback, timeline)
        steps = getattr(self, "_steps", None)  # a group's ranks keep mlx-lm's budget: no steps are timed
        steps_between = steps.steps_between if isinstance(steps, ArrivalBudget) and not steps.distributed else None
        return ctx, logged(
            request, ctx, responses, timeline, self.store_cache.busy_between, self.metrics, steps_between
        )

    def _queue(self, request, generation_args, progress_callback, timeline: dict | None = None):
        """Queue the request, its response queue known to the generator until its
        last item (see _fail_replies); refused once generation stopped or closes."""
        if not self.generation_available() or self._closing is not None:
            raise (
                GenerationFailed("the server is shutting down", 503)
                if self._closing is not None
                else GenerationFailed("generation stopped", 503)
            )
        replies = Replies(self, timeline)
        with self._replies_lock:
            self._replies.add(replies)
        return self.submit(request, generation_args, progress_callback, replies)

    def in_flight(self) -> int:
        """Requests whose replies are still coming."""
        with self._replies_lock:
            return len(self._replies)

    # --- the close ------------------------------------------------------------------------

    def stop_and_join(self) -> None:
        """Close on the generation thread, which owns the streams of every cache
        in flight: the requests in flight finish (at most half the shutdown's
        time), then every insert still waiting runs there, then the loop stops."""
        if self._closing is None:
            self._closing = time.monotonic()
        self.store_cache.store.give_way(None)  # no request will be served: spills go at their pace
        warming = self.store_cache.store.warming
        if warming is not None:
            warming.stop(timeout=0)  # a model waiting for it (--warm-start-first) waits no more
        if self.group is not None and not self.join_for(self.cli_args.shutdown_timeout / 2):
            # In a collective with a rank that is gone (SIGKILL, a lost machine): it
            # never returns. The store is closed without it; its batch is lost.
            log.error("the generation thread waits for a rank that is gone: the store closes without it")
            self.closed_inserts = (0, self.inserts.waiting())
            return
        self.join()
        if self.closed_inserts is None:  # the loop had stopped already: nothing ran what waits
            self.closed_inserts = (0, self.inserts.waiting())

    def _close_here(self) -> bool:
        """On the generation thread, once closing: when no request is in flight
        (or the drain's time is up), run every waiting insert and stop the loop.
        Requests queued but not begun are refused (503)."""
        if self._closing is None or self.loop_stopped:
            return self.loop_stopped
        while True:
            try:
                replies, _, _ = self.requests.get_nowait()
            except QueueEmpty:
                break
            replies.put(GenerationFailed("the server is shutting down", 503))
        drain_s = self.cli_args.shutdown_timeout / 2
        draining = bool(self.in_flight()) and time.monotonic() - self._closing < drain_s
        if self.group is not None:
            draining = self.group.share(draining)  # rank 0 holds the replies in flight
        if draining:
            return False
        if self.in_flight():
            log.warning(
                "shutdown: %d requests still in flight after %.0f s are not finished", self.in_flight(), drain_s
            )
        log.info("shutdown: %d inserts waiting, stored on the generation thread", len(self.inserts.waiting()))
        self.closed_inserts = self.inserts.flush()
        self.stop_loop()
        return True

    # --- where the store's waiting inserts run ---------------------------------------------

    def _quiet(self) -> bool:
        """No request is being checked, queued, or waiting for its first token."""
        return not self.arrivals.pending and self._nothing_to_serve()

    def _nothing_to_serve(self) -> bool:
        """No request is queued or waiting for its first token."""
        return self.requests.empty() and not self.store_cache.awaiting_first_token()

    def _before_step(self) -> None:
        if self._close_here():
            return
        if self.store_cache.awaiting_first_token():
            return  # parts of prompts wait for the first tokens (a fetch runs them first)
        inserts = self.inserts
        inserts.run_deferred()
        if inserts.has_background and self._quiet() and not inserts.background_wait():
            # A finished request's, one a step, while the batch only decodes.
            inserts.run_background(1, until=self._request_waiting)

    def next_request(self, timeout=None):
        if self.group is not None:
            return self._next_in_group(timeout)
        if self._closing is not None:
            self._close_here()
            if timeout is not None:
                time.sleep(min(timeout, 0.01))  # requests in flight finish; new ones wait for the close
            return None
        inserts = self.inserts
        inserts.run_deferred()  # before the loop takes a request or waits for one
        if timeout is not None and inserts.has_background and self._idle() and not self._request_waiting():
            # Nothing in the batch and nothing to take: a finished request's insert,
            # then mlx-lm's loop comes back here (a request that came meanwhile goes
            # first); within its grace, the thread waits for a request until it ends.
            wait = inserts.background_wait()
            if wait:
                return self.take_request(min(timeout, wait))
            inserts.run_background(1, until=self._request_waiting)
            return None
        return self.take_request(timeout)

    def _next_in_group(self, timeout):
        """next_request on a rank of a group: every rank takes the same path (each
        choice a collective). A signal to any rank closes the whole group, rank 0
        (which holds the replies in flight) saying when; a finished request's
        insert runs as it is handed over (InsertSettings)."""
        due = time.monotonic() - self._gathered >= RANK_METRICS_S
        closing, gather = self.group.poll(self._closing is not None, due)
        if gather:  # every rank's store figures, for rank 0's /metrics
            self._gathered = time.monotonic()
            figures = self.group.gather(self.store_cache.store.metrics())
            if self.group.rank == 0:
                self.metrics.ranks(figures)
        if closing:
            if self._closing is None:
                self._closing = time.monotonic()
                log.info("another rank of the group stops: this one closes with it")
                if self.group.rank == 0 and shutdown.installed is not None:
                    shutdown.installed.stop_serving()  # the HTTP server stops too
            self._close_here()
            if timeout is not None:
                time.sleep(min(timeout, 0.01))
            return None
        self.inserts.run_deferred()
        return self.take_request(timeout)

    def _request_waiting(self) -> bool:
        """A request is queued for the generation thread, or, where a waiting insert
        runs in short chunks (CPU), one is being checked: the insert gives way to it."""
        return not self.requests.empty() or bool(self.inserts.settings.reply_chunk and self.arrivals.pending)

    def _idle(self) -> bool:
        """Nothing to take and no request waiting for its first token. With
        replies stored before a next turn's fetch, requests still being checked
        on HTTP threads do not count: the next turns of a burst need their
        conversations' replies stored, and the generation thread would only wait
        for the checks (about as long as a reply's insert)."""
        return self._nothing_to_serve() if self.inserts.settings.replies_before_fetch else self._quiet()

    # --- /health ------------------------------------------------------------------------

    def health(self) -> tuple[int, dict]:
        """/health's status and body: 503 "loading" until the model is loaded and
        warmed up, "unavailable" if generation stopped; then 200, "degraded" (with
        a `reason`) while the disk refuses the store's writes, "warming" while a
        warm start reads the store (requests are served meanwhile), else "ok". With
        --api-keys the warm start's and the disk's figures are left out: they count
        every tenant's data."""
        provider = self.model_provider
        body: dict = {"status": "ok", "model_loaded": provider.model is not None}
        now = time.monotonic()
        body["generation_restarts"] = len([t for t in self.restarts if now - t < RESTART_WINDOW_S])
        if self.group is not None:
            body["group"] = {"parallel": self.group.kind, "ranks": self.group.size}
        if self.gave_up is not None:
            return 503, body | {"status": "unavailable", "error": self.gave_up, "exiting": True}
        if not self.generation_available():
            return 503, body | {"status": "unavailable"}
        if self._closing is not None:
            return 503, body | {"status": "closing"}
        if not provider.ready:
            return 503, body | {"status": "loading"}
        warming = self.store_cache.store.warming
        if warming is not None:
            progress = warming.progress()
            keep = ("done",) if self.keyring.required else ("done", "nodes", "bytes", "planned_nodes", "planned_bytes")
            body["warm_start"] = {k: progress[k] for k in keep}
            if warming.running:
                body["status"] = "warming"
        disk = self.store_cache.store.disk()
        if disk.refusing:  # it still serves: what the disk refused waits in memory
            body["status"] = "degraded"
            body["reason"] = f"the disk refuses the store's writes ({disk.reason}) for {disk.refusing_seconds:.0f} s"
            if not self.keyring.required:  # figures of every tenant's data
                body["disk"] = {"unwritten_nodes": disk.unwritten_nodes, "unwritten_bytes": disk.unwritten_bytes}
        return 200, body

    # --- a request rendered, tracked and fetched ---------------------------------------------

    def tokenize(self, tokenizer, request, args):
        getattr(request, "timeline", {})["tokenize"] = time.perf_counter()
        self.check_stop_words(tokenizer, args.stop_words)  # a bad one fails this request alone
        rendered: Rendered | RenderedImages | None = getattr(request, "rendered", None)
        if isinstance(rendered, RenderedImages):
            return self._tokenize_images(request, rendered)
        if self.model_provider.vision is not None and has_images(getattr(request, "messages", None)):
            kwargs = self.template_kwargs(args.chat_template_kwargs)  # a request not checked first (a test's)
            images = render_images(self.model_provider.vision, tokenizer, request.messages, request.tools, kwargs)
            return self._tokenize_images(request, images)
        messages = getattr(request, "messages", None)
        if rendered is not None:
            prompt, segments, kinds, state, vision = rendered.unpack()
            messages = rendered.messages
        elif request.request_type == "text" and isinstance(request.prompt, list):
            prompt = [int(t) for t in request.prompt]
            segments, kinds, state, vision = [prompt], ["assistant"], "normal", None
        else:
            prompt, segments, kinds, state, vision = self.render(tokenizer, request, args)
        chat = None
        if request.request_type == "chat" and tokenizer.has_chat_template and vision is None:
            chat = ChatTurn(messages, request.tools, self.template_kwargs(args.chat_template_kwargs))
        ends = [sum(len(s) for s in segments[: i + 1]) for i in range(len(segments) - 1)]
        tenant = getattr(request, "tenant", PUBLIC)
        timeline = getattr(request, "timeline", {})
        timeline["fetch"] = time.perf_counter()
        retention = getattr(request, "retention", ())
        tracked, checkpoints = self.store_cache.begin(
            tenant, prompt, chat, ends, cacheable=vision is None, retention=retention
        )
        timeline["fetched"] = time.perf_counter()
        self.arrivals.gather()  # a burst's other requests, still being checked, prefill with this one
        timeline["gathered"] = time.perf_counter()
        self._note_hit(timeline)
        segments, kinds = split_segments(segments, kinds, checkpoints)
        return tracked, segments, kinds, state, vision

    def _tokenize_images(self, request, images: RenderedImages):
        """A chat with images for a vision-language model (serve/vision.py): fetched and
        tracked by its image keys, which mlx-lm's image path hands the cache back."""
        ids, state, vision, prompt = images.ids, images.state, images.vision(), images.prompt
        timeline = getattr(request, "timeline", {})
        timeline["fetch"] = time.perf_counter()
        tenant, retention = getattr(request, "tenant", PUBLIC), getattr(request, "retention", ())
        tracked, _ = self.store_cache.begin(tenant, vision.cache_key, None, [], retention=retention, vision=prompt)
        vision.cache_key = tracked  # what mlx-lm fetches and inserts by; the request is in flight while it lives
        tracked.request.timeline = timeline  # the store's prefill marks its phases (cache._prefilled)
        timeline["fetched"] = time.perf_counter()
        self._note_hit(timeline)
        hit = self.store_cache.last_hit
        timeline["restored_length"] = hit.length if hit is not None else 0  # the store prefills the rest
        shown = TrackedPrompt(ids)  # mlx-lm's GenerationContext holds the ids: they name the request too
        shown.request = tracked.request
        return shown, [ids], ["assistant"], state, vision

    def _note_hit(self, timeline: dict) -> None:
        hit = self.store_cache.last_hit
        timeline["restored"] = HitFigures.of(hit)  # for /metrics, when the request ends
        timeline["matched"] = hit.matched if hit is not None else 0  # held by the store (apis' usage)
        if hit is not None and hit.length:
            timeline["from_disk"] = hit.cold_tokens
            timeline["plan"] = hit.plan.mode if hit.plan is not None else "memory"

    def template_kwargs(self, overrides: dict | None) -> dict:
        """The chat template's arguments: the server's, updated by a request's."""
        kwargs = dict(self.cli_args.chat_template_args)
        kwargs.update(overrides or {})
        return kwargs
