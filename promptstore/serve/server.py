"""`promptstore serve`: mlx_lm.server, run as it is, with subclasses adding API
keys and tenants, the one served model (never a download), prompt and request
shape checks in the HTTP thread, a log line per request, /metrics and /health's
states, and a clean close of the store on SIGTERM."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty as QueueEmpty
from queue import Queue
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm import server as mlx_server
from prometheus_client import CONTENT_TYPE_LATEST

from ..console import model_dir
from ..errors import GenerationFailed, PromptStoreError, ServeRequestError
from ..store import CUDA, PromptStore
from ..store.retention import CLASSES
from . import apis
from .apis.exchange import failure
from .arrivals import ArrivalBudget, Arrivals
from .cache import StoreCache, split_segments
from .connections import HeadDeadline, capped_server
from .door import drain, read_body
from .heap import keep_heap
from .metrics import HitFigures, MetricsAccess, ServeMetrics, load_metrics_key
from .options import build_parser, store_settings
from .pieces import Pieces, PieceTokenizer
from .replies import ChatTurn
from .schemas import ChatCompletionBody, CompletionBody, checked
from .startup import listening_socket, refuse_a_group
from .tenants import PUBLIC, KeyRing, Tenant, load_api_keys
from .warm_prompts import load_warm_prompts, warm
from .warmup import read_libraries, runtime_libraries, warm_up

log = logging.getLogger("promptstore.serve")

WARM_UP_BATCH = 4  # on an H100, warming a batch of 4 left a later batch of 1 fast too (warmup.py)


@dataclass
class StoreRequest(mlx_server.CompletionRequest):
    """mlx-lm's request, plus the tenant it came from, its timeline (perf_counter
    instants by name, written by the HTTP and generation threads) and what it
    asked the store to keep."""

    tenant: Tenant = PUBLIC
    timeline: dict = field(default_factory=dict)
    rendered: Rendered | None = None
    arrival: int | None = None  # its token in Arrivals until it is queued
    # How long to keep what it stores: (end, class) per marked prefix, (None, class)
    # for all of it (store/retention.py); and the client's prompt_cache_key.
    retention: tuple = ()
    cache_key: str | None = None


@dataclass
class Rendered:
    """A prompt as the HTTP thread rendered and tokenized it when checking it
    (mlx_lm.server's _tokenize result), so the generation thread need not again."""

    prompt: list[int]
    segments: list[list[int]]
    kinds: list[str]
    state: str
    messages: list | None  # the messages as rendered (content parts flattened)

    def unpack(self) -> tuple:
        """Fresh lists: mlx_lm.server trims the segments it is given."""
        return list(self.prompt), [list(s) for s in self.segments], list(self.kinds), self.state, None


class StoreModelProvider(mlx_server.ModelProvider):
    """Serves the configured model only: any other name is refused, never loaded."""

    def __init__(self, cli_args, cache: StoreCache):
        super().__init__(cli_args)
        self.cache = cache
        path = Path(cli_args.model)
        resolved = str(path.resolve()) if path.exists() else cli_args.model
        self.public_id = cli_args.model_id or resolved
        self.names = {"default_model", cli_args.model, resolved, self.public_id}
        self.max_positions: int | None = None
        self.vocab_size: int | None = None
        self.ready = False  # the model loaded, attached and warmed up
        self.busy: Callable[[], bool] = lambda: False  # a request waits for its first token (the generator's)

    def served(self, model: str | None, adapter: str | None, draft: str | None) -> bool:
        return (
            model in self.names
            and adapter in (None, self.cli_args.adapter_path)
            and draft in (None, "default_model", self.cli_args.draft_model)
        )

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if not self.served(model_path, adapter_path, draft_model_path):
            raise ServeRequestError(f"model {model_path!r} is not served here", status=404)
        return super().load("default_model", None, "default_model")

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        first = self.cli_args.warm_start_first
        warming = self.cache.store.warming
        if (CUDA if first is None else first) and warming is not None:
            # Measured on an H100 (a probe of the store's warm start and mlx-lm's
            # batches, one process each way): a warm start still reading while
            # the model's weights were made left later batches over its caches
            # at 1.1-2.3 s to the first token; finished first, 0.20-0.22 s, as
            # without a warm start. Why is not known; until it is, the model
            # waits (on a CPU or Apple silicon nothing like it was seen).
            started = time.perf_counter()
            warming.wait()
            log.info("warm start finished before the model loads (waited %.1f s)", time.perf_counter() - started)
        super()._load(model_path, adapter_path, draft_model_path)
        args = getattr(self.model, "args", None)
        self.max_positions = getattr(args, "max_position_embeddings", None)
        vocab = [len(self.tokenizer._tokenizer), getattr(args, "vocab_size", None)]
        self.vocab_size = min(v for v in vocab if v)
        # A chat's unchanged messages are not tokenized again; the first texts are
        # checked on a thread of their own, which waits while a request is busy.
        self.pieces = Pieces(self.tokenizer, busy=lambda: self.busy())
        self.cache.attach(self.model, self.tokenizer, self.draft_model, self.model_key, self.cli_args.prefill_step_size)
        self.cache.pieces = self.pieces
        kept = keep_heap(self.cli_args.heap_reserve)  # before the warm-up, whose arrays it then holds
        if kept is not None:
            log.info("heap: %d MiB kept for the model's arrays, touched in %.2f s", kept[0] >> 20, kept[1])
        if self.cli_args.kernel_warm_up and self.draft_model is None:
            self._warm_up()
        prompts = getattr(self.cli_args, "warm_prompt_list", None)
        if prompts:
            log.info("%s", warm(self.cache, prompts, self.cli_args.chat_template_args))
        libraries = runtime_libraries() if self.cli_args.read_gpu_libraries else []
        if libraries:
            files, nbytes, seconds = read_libraries(libraries)
            log.info("GPU runtime libraries: %d files, %.2f GB read in %.2f s", files, nbytes / 1e9, seconds)
        self.ready = True

    def piecewise(self, tokenizer, tenant: Tenant):
        """`tokenizer`, rendering chats through the pieces kept for `tenant` (serve/pieces.py)."""
        pieces = getattr(self, "pieces", None)
        if pieces is None or pieces.tokenizer is not tokenizer:
            return tokenizer
        return PieceTokenizer(tokenizer, pieces, tenant.salt)

    def _warm_up(self) -> None:
        """Run a small batch as a restarted server's first round runs (on the
        generation thread, where this is called), so that round does not build
        the kernels; a model the batch path cannot run is served without it."""
        batch = min(WARM_UP_BATCH, self.cli_args.decode_concurrency, self.cli_args.prompt_concurrency)
        try:
            seconds = warm_up(
                self.model,
                self.vocab_size,
                batch,
                prefill_batch_size=self.cli_args.prompt_concurrency,
                prefill_step_size=self.cli_args.prefill_step_size,
            )
        except Exception as e:  # a warm-up is never a reason not to serve
            log.warning("kernel warm-up skipped: %s", e)
            return
        log.info("kernel warm-up: a batch of %d in %.2f s", batch, seconds)


RESTARTS = 5  # the generation loop is started again after a failure, at most this many times
RESTART_WINDOW_S = 60.0  # within this long; one failure more and the server exits non-zero


class Replies(Queue):
    """A request's response queue: known to its generator until its last item
    (None) or an error is put (see StoreResponseGenerator._fail_replies)."""

    def __init__(self, generator):
        super().__init__()
        self._generator = weakref.ref(generator)

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        generator = self._generator()
        if generator is not None and (item is None or isinstance(item, BaseException)):
            with generator._replies_lock:
                generator._replies.discard(self)


class StoreResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's generation loop; tokenizing also tracks the request, fetches, and
    waits for requests being checked to join it (Arrivals); a waiting request
    interrupts a run of batch steps (ArrivalBudget)."""

    def __init__(self, provider: StoreModelProvider, cache: StoreCache, keyring: KeyRing):
        # Set before super().__init__, which starts the generation thread.
        self.store_cache, self.keyring = cache, keyring
        # Distributed ranks must make the same calls: finished requests' inserts run at once there.
        cache.background = mx.distributed.init().size() == 1
        args = provider.cli_args
        # Each waiting insert holds its finished request's cache: no more than the batch held.
        cache.background_limit = max(1, args.decode_concurrency)
        cache.replies_before_fetch = args.reply_before_fetch
        cache.spans_weights = args.model_id_spans_weights
        # On CPU a reply's prefill gives way to a request that came, every 8 tokens;
        # on a GPU one forward of the whole reply costs about what one of 8 tokens does.
        cache.reply_chunk = REPLY_CHUNK_CPU if mx.default_device() == mx.cpu else None
        # There, a finished request's insert waits a moment: a request sent as a
        # reply ends finds the thread free (on a GPU not measured with it: none).
        cache.reply_grace = REPLY_GRACE_CPU_S if cache.reply_chunk else 0.0
        self.arrivals = Arrivals(bound=args.arrival_wait)
        self.metrics = ServeMetrics(cache.store, provider.public_id, keyring)
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
        cache.store.give_way(provider.busy)

    @property
    def _time_budget(self):
        return self._arrival_budget

    @_time_budget.setter
    def _time_budget(self, budget) -> None:
        # mlx-lm's __init__ sets its TimeBudget (after the request queue, before
        # the generation thread starts): wrap it.
        self._arrival_budget = ArrivalBudget(budget, self.requests, before_step=self._before_step)

    @property
    def is_healthy(self) -> bool:
        return self.generation_available() and self.model_provider.ready

    # --- the generation thread's life --------------------------------------------------

    def _run_generate(self) -> None:
        """mlx_lm.server's generation loop, started again on this thread when it
        fails (its requests in flight fail with it, the others go on); after
        RESTARTS failures within RESTART_WINDOW_S it stops for good and the
        server exits non-zero, for a supervisor to start it afresh."""
        while True:
            try:
                self._generate()
                return
            except Exception as e:
                if not self.model_provider.ready and self._closing is None:
                    self._failed_at_load(e)
                    return
                log.exception("generation failed: %s", e)
                failed = self._fail_replies(e)
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(self.restarts) > RESTARTS or self._closing is not None:
                    self.gave_up = f"{type(e).__name__}: {e}"
                    self._generation_failed = True
                    if self._closing is None:
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
        self._generation_failed = True
        if isinstance(error, PromptStoreError) and not self.cli_args.debug:
            print(f"promptstore serve: error: {error}", file=sys.stderr, flush=True)
        else:
            log.error("the model could not be served: %s", error, exc_info=error)
        self.exit_for_supervisor()

    def exit_for_supervisor(self) -> None:
        """Stop serving, as SIGTERM does: main() closes the store and exits non-zero."""
        os.kill(os.getpid(), signal.SIGTERM)

    def _fail_replies(self, error: Exception) -> int:
        """Fail every request whose reply is still coming: nothing more would come."""
        with self._replies_lock:
            waiting = list(self._replies)
            self._replies.clear()
        for replies in waiting:
            replies.put(GenerationFailed(f"generation failed while serving this request: {error}"))
        return len(waiting)

    def generate(self, request, generation_args, progress_callback=None):
        timeline = getattr(request, "timeline", {})
        timeline.setdefault("received", time.perf_counter())
        timeline["queued"] = time.perf_counter()
        self.arrivals.done(getattr(request, "arrival", None))
        ctx, responses = self._queue(request, generation_args, progress_callback)
        return ctx, self._logged(request, ctx, responses, timeline)

    def _queue(self, request, generation_args, progress_callback):
        """mlx_lm.server's generate(), with the request's response queue known
        to the generator until its last item (see _fail_replies)."""
        if not self.generation_available() or self._closing is not None:
            raise (
                GenerationFailed("the server is shutting down", 503)
                if self._closing is not None
                else GenerationFailed("generation stopped", 503)
            )
        replies = Replies(self)
        with self._replies_lock:
            self._replies.add(replies)
        self.requests.put((replies, request, generation_args))

        def _inner():
            while True:
                response = self._await_response(replies)
                if response is None:
                    break
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, tuple):
                    if progress_callback is not None:
                        progress_callback(*response)
                    continue
                yield response

        ctx = self._await_response(replies)
        if isinstance(ctx, Exception):
            raise ctx
        return ctx, _inner()

    def _await_response(self, replies):
        while True:
            try:
                return replies.get(timeout=1.0)
            except QueueEmpty:
                if not self.generation_available():
                    raise GenerationFailed("generation stopped", 503) from None

    def in_flight(self) -> int:
        """Requests whose replies are still coming."""
        with self._replies_lock:
            return len(self._replies)

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
        self._generation_thread.join()
        if self.closed_inserts is None:  # the loop had stopped already: nothing ran what waits
            self.closed_inserts = (0, self.store_cache.waiting())

    def _close_here(self) -> bool:
        """On the generation thread, once closing: when no request is in flight
        (or the drain's time is up), run every waiting insert and stop the loop.
        Requests queued but not begun are refused (503)."""
        if self._closing is None or self._stop:
            return self._stop
        while True:
            try:
                replies, _, _ = self.requests.get_nowait()
            except QueueEmpty:
                break
            replies.put(GenerationFailed("the server is shutting down", 503))
        drain_s = self.cli_args.shutdown_timeout / 2
        if self.in_flight() and time.monotonic() - self._closing < drain_s:
            return False
        if self.in_flight():
            log.warning(
                "shutdown: %d requests still in flight after %.0f s are not finished", self.in_flight(), drain_s
            )
        log.info("shutdown: %d inserts waiting, stored on the generation thread", len(self.store_cache.waiting()))
        self.closed_inserts = self.store_cache.flush()
        self._stop = True
        return True

    def _quiet(self) -> bool:
        """No request is being checked, queued, or waiting for its first token."""
        return not self.arrivals.pending and self._nothing_to_serve()

    def _nothing_to_serve(self) -> bool:
        """No request is queued or waiting for its first token."""
        return self.requests.empty() and not self.store_cache.awaiting_first_token()

    def _before_step(self) -> None:
        if self._close_here():
            return
        cache = self.store_cache
        if cache.awaiting_first_token():
            return  # parts of prompts wait for the first tokens (a fetch runs them first)
        cache.run_deferred()
        if cache.has_background and self._quiet() and not cache.background_wait():
            # A finished request's, one a step, while the batch only decodes.
            cache.run_background(1, until=self._request_waiting)

    def _next_request(self, timeout=None):
        if self._closing is not None:
            self._close_here()
            if timeout is not None:
                time.sleep(min(timeout, 0.01))  # requests in flight finish; new ones wait for the close
            return None
        cache = self.store_cache
        cache.run_deferred()  # before the loop takes a request or waits for one
        if timeout is not None and cache.has_background and self._idle() and not self._request_waiting():
            # Nothing in the batch and nothing to take: a finished request's insert,
            # then mlx-lm's loop comes back here (a request that came meanwhile goes
            # first); within its grace, the thread waits for a request until it ends.
            wait = cache.background_wait()
            if wait:
                return super()._next_request(min(timeout, wait))
            cache.run_background(1, until=self._request_waiting)
            return None
        return super()._next_request(timeout)

    def _request_waiting(self) -> bool:
        """A request is queued for the generation thread, or, where a waiting insert
        runs in short chunks (CPU), one is being checked: the insert gives way to it."""
        return not self.requests.empty() or bool(self.store_cache.reply_chunk and self.arrivals.pending)

    def _idle(self) -> bool:
        """Nothing to take and no request waiting for its first token. With
        replies stored before a next turn's fetch, requests still being checked
        on HTTP threads do not count: the next turns of a burst need their
        conversations' replies stored, and the generation thread would only wait
        for the checks (about as long as a reply's insert)."""
        return self._nothing_to_serve() if self.store_cache.replies_before_fetch else self._quiet()

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

    @property
    def max_prompt_tokens(self) -> int | None:
        given = self.cli_args.max_prompt_tokens
        return given if given is not None else self.model_provider.max_positions

    def _tokenize(self, tokenizer, request, args):
        getattr(request, "timeline", {})["tokenize"] = time.perf_counter()
        # mlx_lm.server makes the stop-sequence matcher after this, outside the
        # try that fails a request alone: a bad one fails here, inside it.
        self._make_state_machine(self.model_provider.model_key, tokenizer, args.stop_words)
        rendered: Rendered | None = getattr(request, "rendered", None)
        messages = getattr(request, "messages", None)
        if rendered is not None:
            prompt, segments, kinds, state, vision = rendered.unpack()
            messages = rendered.messages
        elif request.request_type == "text" and isinstance(request.prompt, list):
            prompt = [int(t) for t in request.prompt]
            segments, kinds, state, vision = [prompt], ["assistant"], "normal", None
        else:
            prompt, segments, kinds, state, vision = super()._tokenize(tokenizer, request, args)
        chat = None
        if request.request_type == "chat" and tokenizer.has_chat_template and vision is None:
            chat = ChatTurn(messages, request.tools, self._template_kwargs(args.chat_template_kwargs))
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
        hit = self.store_cache.last_hit
        timeline["restored"] = HitFigures.of(hit)  # for /metrics, when the request ends
        timeline["matched"] = hit.matched if hit is not None else 0  # held by the store (apis' usage)
        if hit is not None and hit.length:
            timeline["from_disk"] = hit.cold_tokens
            timeline["plan"] = hit.plan.mode if hit.plan is not None else "memory"
        segments, kinds = split_segments(segments, kinds, checkpoints)
        return tracked, segments, kinds, state, vision

    def _template_kwargs(self, overrides: dict | None) -> dict:
        kwargs = dict(self.cli_args.chat_template_args)
        kwargs.update(overrides or {})
        return kwargs

    # --- the HTTP thread ------------------------------------------------------------

    def check_prompt(self, request, chat_template_kwargs, tenant: Tenant = PUBLIC) -> Rendered | None:
        """Render and tokenize the prompt, or ServeRequestError (before anything is
        queued). Returns the result for the generation thread to use as it is
        (None for a prompt with images, which mlx_lm.server renders itself)."""
        tokenizer = self.model_provider.tokenizer
        if tokenizer is None:
            raise ServeRequestError("the model is still loading; retry shortly", status=503)
        tokenizer = self.model_provider.piecewise(tokenizer, tenant)
        self._check_length(tokenizer, request)
        if request.request_type == "text":
            prompt = self._text_tokens(tokenizer, request.prompt)
            rendered = Rendered(prompt, [prompt], ["assistant"], "normal", None)
        else:
            probe = mlx_server.CompletionRequest(
                "chat", "", copy.deepcopy(request.messages), request.tools, request.role_mapping
            )
            args = SimpleNamespace(chat_template_kwargs=chat_template_kwargs)
            try:
                prompt, segments, kinds, state, vision = mlx_server.ResponseGenerator._tokenize(
                    self, tokenizer, probe, args
                )
            except Exception as e:
                raise ServeRequestError(f"the messages cannot be rendered: {e}") from None
            prompt = [int(t) for t in prompt]
            rendered = None if vision is not None else Rendered(prompt, segments, kinds, state, probe.messages)
        limit = self.max_prompt_tokens
        if not prompt:
            raise ServeRequestError("the prompt is empty")
        if limit is not None and len(prompt) > limit:
            raise ServeRequestError(
                f"the prompt has {len(prompt)} tokens; this server takes at most {limit} (--max-prompt-tokens)"
            )
        return rendered

    def _check_length(self, tokenizer, request) -> None:
        """Refuse a prompt whose text alone holds more tokens than the server takes,
        counting piece by piece and stopping past the limit, before the whole of it
        is rendered and tokenized (a 10 MB prompt took 15-24 s to tokenize)."""
        limit = self.max_prompt_tokens
        if limit is None:
            return
        texts = [request.prompt] if request.request_type == "text" else list(_message_texts(request.messages))
        texts = [t for t in texts if isinstance(t, str)]
        if sum(len(t) for t in texts) <= limit * 2:
            return  # fewer characters than twice the limit: counted whole, below, at little cost
        counted = at_least_tokens(tokenizer, texts, limit)
        if counted > limit:
            raise ServeRequestError(
                f"the prompt has more than {limit} tokens; this server takes at most {limit} (--max-prompt-tokens)",
                param="prompt" if request.request_type == "text" else "messages",
            )

    def _text_tokens(self, tokenizer, prompt) -> list[int]:
        if isinstance(prompt, str):
            return [int(t) for t in tokenizer.encode(prompt)]
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ServeRequestError("prompt must be a string or a list of token ids (one prompt per request)")
        vocab = self.model_provider.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ServeRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return list(prompt)

    def _logged(self, request, ctx, responses, timeline):
        produced = 0
        try:
            for response in responses:
                if "first" not in timeline:
                    timeline["first"] = time.perf_counter()
                    first_token_out(ctx)
                produced += 1
                yield response
        finally:
            first_token_out(ctx)  # or none will come
            timeline["done"] = time.perf_counter()
            prompt, restored = len(ctx.prompt), max(ctx.prompt_cache_count, 0)
            phases = request_phases(timeline, self.store_cache.busy_between)
            tenant = getattr(request, "tenant", PUBLIC)
            first = phases["ttft_ms"] / 1e3 if "ttft_ms" in phases else None
            self.metrics.served(tenant, prompt, restored, timeline.get("restored"), first, produced)
            self.metrics.asked(getattr(request, "retention", ()), getattr(request, "cache_key", None))
            ttft = f"{phases['ttft_ms']:.1f} ms" if "ttft_ms" in phases else "none"
            source = f" ({timeline['from_disk']} from disk, {timeline['plan']})" if "plan" in timeline else ""
            log.info(
                "request (%s): prompt %d tokens, restored %d%s, prefilled %d, TTFT %s, %d tokens generated; %s",
                tenant.label,
                prompt,
                restored,
                source,
                prompt - restored,
                ttft,
                produced,
                " ".join(f"{k}={v:.1f}" for k, v in phases.items() if k != "ttft_ms"),
            )


PIECE_CHARS = 1 << 14  # text is counted in pieces of about this many characters, cut at whitespace


def _message_texts(messages):
    """The text of every message's content (strings and text parts)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (part.get("text") for part in content if isinstance(part, dict))


def at_least_tokens(tokenizer, texts: list[str], bound: int) -> int:
    """A lower bound on the tokens of `texts`, counted in pieces cut where a word
    begins, one token taken off each cut (a token may straddle it); it stops once
    past `bound`."""
    counted = 0
    for text in texts:
        start = 0
        while start < len(text) and counted <= bound:
            end = start + PIECE_CHARS
            if end < len(text):
                space = text.rfind(" ", start + PIECE_CHARS // 2, end)
                end = space if space > start else end
            counted += max(0, len(tokenizer.encode(text[start:end], add_special_tokens=False)) - 1)
            start = end
    return counted


def first_token_out(ctx) -> None:
    """Mark the request whose GenerationContext this is as past its first token
    (the store's background work waits for no request past it)."""
    request = getattr(getattr(ctx, "prompt", None), "request", None)
    if request is not None:
        request.first_out = True


def request_phases(timeline: dict, busy_between) -> dict[str, float]:
    """A request's timeline as milliseconds per phase (those it reached): checking
    the prompt (HTTP thread), waiting for the generation thread, rendering and
    tokenizing, the store's fetch, waiting for requests being checked beside
    it (Arrivals), then prefill and the first token; `store_ms`
    is the generation thread's time in store calls (fetches, inserts) between
    arrival and the first token, this request's own fetch included."""
    marks = ["received", "checked", "queued", "tokenize", "fetch", "fetched", "gathered", "first"]
    names = ["check_ms", "handoff_ms", "queue_ms", "template_ms", "fetch_ms", "gather_ms", "prefill_first_ms"]
    out = {}
    for (a, b), name in zip(zip(marks, marks[1:]), names):
        if a in timeline and b in timeline:
            out[name] = (timeline[b] - timeline[a]) * 1e3
    if "first" in timeline and "received" in timeline:
        out["ttft_ms"] = (timeline["first"] - timeline["received"]) * 1e3
        out["store_ms"] = busy_between(timeline["received"], timeline["first"]) * 1e3
    return out


COMPLETIONS = {
    "/v1/chat/completions": ChatCompletionBody,
    "/chat/completions": ChatCompletionBody,
    "/v1/completions": CompletionBody,
}
MAX_TOKENS_UNKNOWN_CONTEXT = 1 << 20  # the most max_tokens may ask of a model that states no context
REPLY_CHUNK_CPU = 8  # tokens of a reply's prefill between the points where it gives way to a request
REPLY_GRACE_CPU_S = 0.03  # on CPU, a finished request's insert begins no sooner than this after it ended


class _Answered(BaseException):
    """The handler has answered (an error, in the API's shape): unwinds through
    mlx_lm.server's `except Exception`, which would answer 404."""


class _Answering:
    """The response generator as one chat or text completion's handler sees it:
    a request that cannot be generated is answered in the API's shape."""

    def __init__(self, generator: StoreResponseGenerator, handler: StoreHandler):
        self._generator, self._handler = generator, handler

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate(self, *args, **kwargs):
        try:
            return self._generator.generate(*args, **kwargs)
        except ServeRequestError as e:
            self._handler._error(e.status, str(e), e.param)
        except Exception as e:
            self._handler._error(*failure(e))
        raise _Answered


class StoreHandler(HeadDeadline, mlx_server.APIHandler):
    """mlx-lm's handler with API keys, the served model only, and every request
    checked at the door (door.py, schemas.py); the Messages and Responses APIs
    (apis/) beside its chat and text completions. Its headers come within
    --header-timeout (connections.py)."""

    tenant: Tenant = PUBLIC
    api: apis.Exchange | None = None  # the Messages or Responses API serving this request
    capped: str | None = None  # how max_tokens was capped, said in a header of the reply
    headers_sent = False
    retention: str | None = None  # the class the request asked for all it stores (prompt_cache_retention)
    cache_key: str | None = None  # its prompt_cache_key

    def do_POST(self):
        """Every POST gets an answer: a fault of the server's is a 500 in the API's
        shape (or, once a reply began, the end of the connection), never a
        connection closed with nothing said."""
        try:
            self._post()
        except OSError as e:
            log.debug("client went away: %s", e)
        except Exception as e:
            log.exception("request failed: %s", e)
            if not self.headers_sent:
                self._error(500, f"the request failed: {e}")
            self.close_connection = True

    def _post(self) -> None:
        self.capped, self.headers_sent, self.unread = None, False, 0  # this request's, not an earlier one's
        self.retention = self.cache_key = None
        route = self.path.split("?")[0].rstrip("/")
        self.api = apis.route(self)
        if self.api is None and route not in COMPLETIONS:
            self._discard_body()
            self._error(404, f"no such endpoint: POST {route}")
            return
        tenant = self._authorize()
        if tenant is None:
            return
        self.tenant = tenant
        try:
            body = read_body(self, self.response_generator.cli_args.max_body_bytes)
        except ServeRequestError as e:
            self._error(e.status, str(e), e.param)
            drain(self)
            return
        if self.api is not None:
            self.api.serve(body)
        else:
            self.complete(route, body)

    def do_GET(self):
        if self.path.split("?")[0] == "/metrics":
            self.handle_metrics()
            return
        if self.path.startswith("/v1/") and self._authorize() is None:
            return
        super().do_GET()

    def handle_metrics(self) -> None:
        """Prometheus's text format, for whoever MetricsAccess lets read it."""
        generator = self.response_generator
        refusal = generator.metrics_access.refusal(self.headers.get("Authorization"))
        if refusal is not None:
            self._error(*refusal)
            return
        body = generator.metrics.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def handle_health_check(self) -> None:
        status, body = self.response_generator.health()
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()

    def _authorize(self) -> Tenant | None:
        key = self.headers.get("x-api-key")  # the Messages API's header
        authorization = self.headers.get("Authorization") or (f"Bearer {key}" if key else None)
        tenant = self.response_generator.keyring.tenant(authorization)
        if tenant is None:
            self._discard_body()
            self._error(401, "missing or unknown API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        return tenant

    def _discard_body(self, limit: int = 1 << 20) -> None:
        # Read what the client sent so closing the socket does not reset it
        # before the client reads the answer.
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return
        if 0 < n <= limit:
            self.rfile.read(n)
        elif n > limit:
            self.unread = n
            drain(self)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        """An error in the shape of the API this request is for (OpenAI's for
        chat and text completions)."""
        if self.api is not None:
            self.api.error(status, message, param)  # in that API's shape
            return
        kind = "server_error" if status >= 500 else "invalid_request_error"
        code = {401: "invalid_api_key", 404: "model_not_found" if param == "model" else "not_found"}.get(status)
        data = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _set_completion_headers(self, status_code: int = 200):
        super()._set_completion_headers(status_code)
        self._say_capped(status_code)

    def _set_stream_headers(self, status_code: int = 200):
        super()._set_stream_headers(status_code)
        self._say_capped(status_code)

    def _say_capped(self, status_code: int) -> None:
        if self.capped is not None and status_code == 200:
            self.send_header("X-Max-Tokens-Capped", self.capped)

    def end_headers(self):
        super().end_headers()
        self.headers_sent = True

    # --- chat and text completions ---------------------------------------------------

    def complete(self, route: str, body: dict) -> None:
        """A chat or text completion: the body checked against its schema, taken as
        mlx_lm.server's handler takes it, and served by mlx_lm.server's handler."""
        chat = COMPLETIONS[route] is ChatCompletionBody
        try:
            self._take(checked(COMPLETIONS[route], body), body)
            request = self.handle_chat_completions() if chat else self.handle_text_completions()
        except ServeRequestError as e:
            self._error(e.status, str(e), e.param)
            return
        except Exception as e:  # mlx_lm.server's own reading (an image it cannot fetch, say)
            self._error(400, f"the request cannot be read: {e}")
            return
        self.handle_completion(request, self.stop_words)

    def _take(self, body, raw: dict) -> None:
        """The checked body as mlx_lm.server's do_POST sets it on its handler (the
        server's defaults for what the client left out), then what only the server
        can check: the served model, its adapter and draft model, token ids."""
        args = self.response_generator.cli_args
        given = lambda value, default: default if value is None else value  # noqa: E731
        self.body = raw
        self.stream = body.stream
        self.stream_options = body.stream_options.model_dump() if body.stream_options is not None else None
        self.requested_model = body.model
        self.requested_draft_model = body.draft_model or "default_model"
        self.num_draft_tokens = given(body.num_draft_tokens, args.num_draft_tokens)
        self.adapter = body.adapters
        completion = getattr(body, "max_completion_tokens", None)  # chat's newer name, which wins
        self.max_tokens = self.check_max_tokens(
            given(completion, given(body.max_tokens, args.max_tokens)),
            "max_completion_tokens" if completion is not None else "max_tokens",
        )
        self.temperature = given(body.temperature, args.temp)
        self.top_p, self.top_k, self.min_p = (
            given(body.top_p, args.top_p),
            given(body.top_k, args.top_k),
            given(body.min_p, args.min_p),
        )
        self.repetition_penalty = given(body.repetition_penalty, 0.0)
        self.repetition_context_size = given(body.repetition_context_size, 20)
        self.presence_penalty = given(body.presence_penalty, 0.0)
        self.presence_context_size = given(body.presence_context_size, 20)
        self.frequency_penalty = given(body.frequency_penalty, 0.0)
        self.frequency_context_size = given(body.frequency_context_size, 20)
        self.xtc_probability, self.xtc_threshold = given(body.xtc_probability, 0.0), given(body.xtc_threshold, 0.1)
        self.logit_bias = self._token_bias(body.logit_bias)
        logprobs = body.logprobs
        self.logprobs = bool(logprobs)
        top = 0 if isinstance(logprobs, bool) else logprobs  # a completion's logprobs: how many top tokens
        self.top_logprobs = given(body.top_logprobs, top or -1)
        self.seed = body.seed
        self.chat_template_kwargs = getattr(body, "chat_template_kwargs", None)
        self.stop_words = body.stop or []
        self.retention = getattr(body, "prompt_cache_retention", None)
        self.cache_key = getattr(body, "prompt_cache_key", None)
        self.check_served()

    def check_served(self) -> None:
        """The model, adapter and draft model asked for are the ones served."""
        provider = self.response_generator.model_provider
        args = provider.cli_args
        if self.adapter is not None and self.adapter != args.adapter_path:
            served = f"serves adapter {args.adapter_path!r} only" if args.adapter_path else "serves no adapters"
            raise ServeRequestError(f"adapters {self.adapter!r} cannot be used: this server {served}", param="adapters")
        if self.requested_draft_model not in ("default_model", args.draft_model):
            served = (
                f"drafts with {args.draft_model!r} only" if args.draft_model else "was started without a draft model"
            )
            raise ServeRequestError(
                f"draft_model {self.requested_draft_model!r} cannot be used: this server {served}", param="draft_model"
            )
        if self.requested_model not in provider.names:
            message = f"model {self.requested_model!r} not served: this server serves {provider.public_id!r}"
            raise ServeRequestError(message, status=404, param="model")

    def _token_bias(self, bias: dict | None) -> dict | None:
        if bias is None:
            return None
        vocab = self.response_generator.model_provider.vocab_size
        out = {int(k): float(v) for k, v in bias.items()}
        outside = [k for k in out if vocab is not None and not 0 <= k < vocab]
        if outside:
            raise ServeRequestError(
                f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {vocab})", param="logit_bias"
            )
        return out

    def check_max_tokens(self, value: int, name: str) -> int:
        """`value` (max_tokens or the API's name for it), refused when more than
        the model's context (or --max-tokens-limit) could ever hold."""
        provider = self.response_generator.model_provider
        context = provider.max_positions
        ceiling = context or MAX_TOKENS_UNKNOWN_CONTEXT
        if value > ceiling:
            what = "the model's context" if context else "what this server generates for one request"
            raise ServeRequestError(f"{name} must be at most {ceiling} ({what}), got {value}", param=name)
        limit = self.response_generator.cli_args.max_tokens_limit
        if limit is not None and value > limit:
            self.capped = f"{value} -> {limit} (--max-tokens-limit)"
            return limit
        return value

    def fit(self, request: StoreRequest, max_tokens: int, name: str) -> int:
        """max_tokens capped to what the model's context holds after the prompt;
        the reply says so in a header (X-Max-Tokens-Capped)."""
        context = self.response_generator.model_provider.max_positions
        if context is None or request.rendered is None:
            return max_tokens
        room = context - len(request.rendered.prompt)
        if room < 1:
            raise ServeRequestError(
                f"the prompt has {len(request.rendered.prompt)} tokens: it fills the model's context ({context})",
                param="messages" if request.request_type == "chat" else "prompt",
            )
        if max_tokens > room:
            self.capped = f"{max_tokens} -> {room} (the model's context of {context} less the prompt)"
            log.info("%s %d capped to %d: the model's context is %d tokens", name, max_tokens, room, context)
            return room
        return max_tokens

    def handle_models_request(self):
        provider = self.response_generator.model_provider
        wanted = "/".join(self.path.split("/")[3:]) or None
        models = [{"id": provider.public_id, "object": "model", "created": self.created}]
        body = {"object": "list", "data": [m for m in models if wanted in (None, m["id"])]}
        self._set_completion_headers(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()

    def handle_completion(self, request, stop_words):
        """mlx_lm.server's, with the request admitted first, and every failure
        answered in the API's shape (before the reply began: a 500 or 503;
        while it streams: an error event)."""
        generator = self.response_generator
        try:
            request = self.admit(request)
            self.max_tokens = self.fit(request, self.max_tokens, "max_tokens")
        except ServeRequestError as e:
            self._error(e.status, str(e), e.param)
            return
        self.response_generator = _Answering(generator, self)
        try:
            super().handle_completion(request, stop_words)
        except _Answered:
            pass
        except OSError as e:
            log.debug("client went away: %s", e)
        except Exception as e:
            log.warning("reply ended by an error: %s", e)
            self._failed(*failure(e))
        finally:
            self.response_generator = generator
            generator.arrivals.done(request.arrival)  # queued by generate, or never will be

    def _failed(self, status: int, message: str) -> None:
        """A reply that failed after it began: an error event in a stream, else
        the error in place of the reply whose headers were never sent."""
        try:
            if self.headers_sent:
                if self.stream:
                    error = {"message": message, "type": "server_error", "param": None, "code": None}
                    self.wfile.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
                    self.wfile.flush()
                self.close_connection = True
                return
            self._headers_buffer = []  # the 200's status line, never sent
            self._error(status, message)
        except OSError:
            pass  # the client went away

    def admit(self, request) -> StoreRequest:
        """The request as the generation thread takes it (for the served model, its
        prompt rendered and checked, its tenant), or ServeRequestError before
        anything is queued. The Messages and Responses APIs admit theirs here too."""
        received = time.perf_counter()
        with self.response_generator.arrivals.checking() as arrival:
            rendered = self.response_generator.check_prompt(request, self.chat_template_kwargs, self.tenant)
        timeline = {"received": received, "checked": time.perf_counter()}
        extra = {"tenant": self.tenant, "timeline": timeline, "rendered": rendered, "arrival": arrival}
        kept = ((None, CLASSES[self.retention]),) if self.retention else ()
        return StoreRequest(**vars(request), **extra, retention=kept, cache_key=self.cache_key)


def run(args, cache: StoreCache, keyring: KeyRing) -> StoreResponseGenerator:
    """Start the generation thread and serve HTTP until interrupted (mlx_lm.server.run's job)."""
    provider = StoreModelProvider(args, cache)
    generator = StoreResponseGenerator(provider, cache, keyring)
    try:
        if mx.distributed.init().rank() == 0:
            listener = getattr(args, "listener", None) or listening_socket(args.host, args.port)  # main() binds it
            server = capped_server(listener, args.max_connections, args.header_timeout)
            mlx_server._run_http_server(
                args.host, args.port, generator, server_class=server, handler_class=StoreHandler
            )
        else:
            generator.join()
    except KeyboardInterrupt:
        pass
    finally:
        generator.stop_and_join()
    return generator


RESIGNAL_SECONDS = 0.01  # a signal that lands inside logging is delivered again this much later,
RESIGNAL_TIMES = 100  # at most this many times in a row (a write to a full pipe can hold logging for ever)


class _Shutdown:
    """SIGTERM and SIGINT stop serving (as Ctrl-C does in mlx_lm.server); a
    second signal, or `timeout` seconds without finishing, exits at once.

    The signal raises KeyboardInterrupt in the main thread wherever it is, except
    inside logging: there it could leave a handler's lock held (logging takes it
    before the `try` that gives it back, and a thread blocked waiting for it runs
    the handler as soon as it has it), and the next line another thread logs
    would wait forever (the warm start's last one did, with the store's close
    waiting for it). Such a signal is delivered again RESIGNAL_SECONDS later, at
    most RESIGNAL_TIMES times in a row; then it stops serving wherever it lands.

    While the store opens (`held()`), a signal is acted on once it is open: the
    open starts the warm start's thread, and a KeyboardInterrupt between that and
    the store being in the caller's hands left nothing to close it (the process
    ended with the warm start cut off and the store never closed)."""

    def __init__(self, timeout: float):
        self.timeout, self.started, self.deferred = timeout, False, 0
        self.holding = self.pending = False

    @contextlib.contextmanager
    def held(self):
        """A signal while the block runs stops serving when the block ends (its
        deadline starts at once); an exception of the block's own goes first."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            raise KeyboardInterrupt

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        if self.started:
            log.warning("second signal: exiting without closing the store")
            os._exit(1)
        if self.holding:
            self.pending = True
            self.begin()
            return
        if _in_logging(frame) and self.deferred < RESIGNAL_TIMES:
            self.deferred += 1
            again = threading.Timer(RESIGNAL_SECONDS, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        self.begin()
        raise KeyboardInterrupt

    def begin(self) -> None:
        if not self.started:
            self.started = True
            timer = threading.Timer(self.timeout, self._expired)
            timer.daemon = True
            timer.start()

    def _expired(self) -> None:
        log.error("shutdown took over %.0f s: exiting without closing the store", self.timeout)
        os._exit(1)


def _in_logging(frame) -> bool:
    """Whether the code `frame` runs (or any code calling it) is the logging module's."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "logging":
            return True
        frame = frame.f_back
    return False


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model is required: promptstore serve serves one local model")
    if not 0 <= args.arrival_wait <= 10:
        parser.error(f"--arrival-wait {args.arrival_wait}: give 0 to 10 seconds")
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s - %(levelname)s - %(message)s"
    )
    attention_kernels(args.cudnn_attention)
    # Installed first: a signal while the store opens (and starts its warm start) closes it.
    shutdown = _Shutdown(args.shutdown_timeout)
    shutdown.install()
    store = generator = None
    try:
        try:
            args.model = str(model_dir(args.model))  # a local directory: nothing is ever downloaded
            keyring = KeyRing(load_api_keys(args.api_keys) if args.api_keys else None)
            args.metrics_key = load_metrics_key(args.metrics_key_file, keyring) if args.metrics_key_file else None
            args.warm_prompt_list = load_warm_prompts(args.warm_prompts) if args.warm_prompts else None
            refuse_a_group()
            # Bound before the store opens and the model loads: a port in use ends the start at once.
            args.listener = listening_socket(args.host, args.port)
            with shutdown.held():  # a signal meanwhile comes once `store` can be closed
                store = PromptStore.open(args.store, **store_settings(args))
        except PromptStoreError as e:
            if args.debug:
                raise
            print(f"promptstore serve: error: {e}", file=sys.stderr)
            return 2
        mlx_server.maybe_set_recommended_wired_limit()
        cache = StoreCache(
            store,
            model_id=args.model_id,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            reply_tokens=args.reply_tokens,
            tenants=keyring.tenants(),
        )
        log.info("store %s (durability %s)", store.path, store.settings.durability)
        generator = run(args, cache, keyring)
    except KeyboardInterrupt:
        pass
    finally:
        if store is not None:
            shutdown.begin()
            store.close()
            log.info("%s", closing_line(generator, store))
    _exit_now(1 if generator is not None and generator.gave_up else 0)


def closing_line(generator: StoreResponseGenerator | None, store: PromptStore) -> str:
    """What the close kept: the inserts that waited at the signal (stored on the
    generation thread, or not, and which), what the disk refused; "everything is
    on disk" only when nothing was lost."""
    stored, lost = (generator.closed_inserts if generator is not None else None) or (0, [])
    said = []
    if stored or lost:
        said.append(
            f"{stored} waiting inserts stored" + (f", {len(lost)} not stored: {', '.join(lost)}" if lost else "")
        )
    nodes, nbytes = store.unwritten
    if nodes:
        said.append(f"{nodes} nodes ({nbytes / 1e6:.1f} MB) not written: the disk refused them, they are lost")
    declined, declined_bytes = store.declined
    if not lost and not nodes:
        said.append("everything is on disk" if not declined else "everything admitted is on disk")
    if declined:
        said.append(f"{declined} nodes ({declined_bytes / 1e6:.1f} MB) of one-off prompts not written (admit)")
    return "store closed: " + "; ".join(said)


CUDNN_SDPA = "MLX_CUDA_USE_CUDNN_SDPA"


def attention_kernels(cudnn: bool | None, environ=os.environ) -> None:
    """Choose MLX's attention kernels on CUDA before any runs (MLX reads the
    variable at its first attention). cuDNN's are built per shape: a graph for
    every new key length, 0.04-1.3 s on an H100, paid inside the request that
    meets it; MLX's own need no building. None: MLX's own unless the operator
    set the variable."""
    if cudnn is None:
        if not CUDA or CUDNN_SDPA in environ:
            return
        cudnn = False
    environ[CUDNN_SDPA] = "1" if cudnn else "0"
    if CUDA:
        log.info(
            "attention: %s", "cuDNN's kernels" if cudnn else "MLX's own kernels (--cudnn-attention to use cuDNN's)"
        )


def _exit_now(code: int) -> None:
    """Exit without finalizing the interpreter. MLX keeps a compile cache per
    thread whose destructor calls into Python: the generation thread, joined
    but still tearing down, aborts the process if the interpreter finalizes
    meanwhile. Everything is closed by now."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
