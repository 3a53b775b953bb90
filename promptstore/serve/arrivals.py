"""When requests reach the generation thread, and when they join a batch.

mlx_lm.server renders and tokenizes a request on its generation thread, so
requests that arrive together are all in its queue by the time it has
tokenized the first, and they prefill as one batch. promptstore serve renders
and checks prompts on the HTTP threads, before a request is queued (a bad
prompt is refused and nothing waits for it); so the first of a burst reaches
the queue alone. `Arrivals` lets the generation thread, as it takes a request,
wait briefly for the requests being checked at that moment, so a burst still
prefills together; `ArrivalBudget` lets a request that arrives while a batch
runs join it after one step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager

import mlx.core as mx

GATHER_S = 0.25  # the longest the generation thread waits for requests being checked
STALE_S = 2.0  # a check older than this is not waited for (its request may never be queued)


class Arrivals:
    """Requests admitted on HTTP threads and not yet queued for the generation thread.

    An HTTP thread holds `checking()` while it renders and checks a prompt and
    calls `done(token)` as it hands the request on, or once it knows it never
    will (a check that fails releases its token itself). `gather()`, on the
    generation thread, waits until every request being checked when it was
    called is queued or failed, at most `bound` seconds; requests that arrive
    meanwhile are not waited for.
    """

    def __init__(self, bound: float = GATHER_S, stale: float = STALE_S):
        self.bound, self.stale = bound, stale
        self._changed = threading.Condition()
        self._pending: dict[int, float] = {}  # token -> when its check began (monotonic)
        self._next = 0
        self.gathering = 0  # threads inside gather() now

    @contextmanager
    def checking(self):
        """Around an admission on an HTTP thread; yields the token to queue."""
        with self._changed:
            token, self._next = self._next, self._next + 1
            self._pending[token] = time.monotonic()
        try:
            yield token
        except BaseException:
            self.done(token)  # refused: nothing will be queued
            raise

    def done(self, token: int | None) -> None:
        """The request of `token` is being put on the generation thread's queue,
        or never will be (idempotent)."""
        if token is None:
            return
        with self._changed:
            if self._pending.pop(token, None) is not None:
                self._changed.notify_all()

    @property
    def pending(self) -> int:
        """Requests being checked now (a check older than `stale` is not counted)."""
        now = time.monotonic()
        with self._changed:
            return sum(1 for since in self._pending.values() if now - since <= self.stale)

    def gather(self) -> float:
        """Wait for the requests being checked now to be queued; returns the seconds waited."""
        started = time.monotonic()
        deadline = started + self.bound
        with self._changed:
            for token in [t for t, since in self._pending.items() if started - since > self.stale]:
                del self._pending[token]  # its handler never queued it (an error between admission and queue)
            waiting = set(self._pending)
            self.gathering += 1
            try:
                while waiting.intersection(self._pending):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
            finally:
                self.gathering -= 1
        return time.monotonic() - started


class ArrivalBudget:
    """mlx_lm.server's time budget for a run of batch steps (0.5 s, during which
    no new request joins the batch), ended early once a request is waiting, so a
    request that arrives while a batch runs joins it after one step, not after
    the budget. At least one step runs each time, so a waiting request that
    cannot join (the batch drains first) never stops the batch's progress.
    `before_step` runs before each step (the store's deferred inserts).
    Each step's start and end are kept (`steps_between`: a request's timeline
    says how much of its wait for a first token was mlx-lm's batch steps).
    Distributed runs keep mlx-lm's budget: every rank must take the same steps."""

    def __init__(self, budget, requests, before_step=None):
        self.budget, self.requests, self.before_step = budget, requests, before_step
        self.distributed = mx.distributed.init().size() > 1
        self.steps = 0
        self._done: deque[tuple[float, float]] = deque(maxlen=4096)  # steps (start, end), perf_counter
        self._began: float | None = None  # the step under way

    def __iter__(self):
        if self.distributed:
            return iter(self.budget)
        iter(self.budget)  # starts mlx-lm's clock
        self.steps = 0
        self._began = None  # a step mlx-lm's loop left by `break` (it produced nothing) is not kept
        return self

    def __next__(self):
        if self._began is not None:  # the step before has ended: its tokens are out
            self._done.append((self._began, time.perf_counter()))
            self._began = None
        if self.steps > 0 and not self.requests.empty():
            raise StopIteration
        if self.before_step is not None:
            self.before_step()  # the previous step's tokens are out by now
        self.steps += 1
        item = next(self.budget)
        self._began = time.perf_counter()
        return item

    def steps_between(self, start: float, end: float) -> tuple[int, float]:
        """The batch steps begun between two instants, and the seconds of batch
        steps between them (any thread may ask)."""
        done = list(self._done)
        begun = sum(1 for a, _ in done if start <= a < end)
        return begun, sum(max(0.0, min(b, end) - max(a, start)) for a, b in done)
