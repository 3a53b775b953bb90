"""Arrivals: the generation thread, taking a request, waits (bounded) for the
requests being checked beside it. ArrivalBudget: a run of batch steps ends once
a request waits, after at least one step."""

import threading
import time
from queue import Queue

import pytest
from mlx_lm.server import TimeBudget

from promptstore.serve.arrivals import ArrivalBudget, Arrivals
from promptstore.serve.insert_scheduler import InsertSettings


def test_with_nothing_being_checked_gather_returns_at_once():
    arrivals = Arrivals(bound=60)
    arrivals.gather()  # would hang the test for a minute if it waited
    with arrivals.checking() as token:
        pass
    arrivals.done(token)
    arrivals.gather()
    assert arrivals.pending == 0


def test_gather_waits_for_the_requests_being_checked_until_each_is_queued():
    arrivals = Arrivals(bound=60)
    order, release = [], [threading.Event(), threading.Event()]

    def http_thread(k):
        with arrivals.checking() as token:
            release[k].wait(timeout=30)  # checking until the test lets it go
        order.append(f"queued {k}")
        arrivals.done(token)

    def generation_thread():
        arrivals.gather()
        order.append("gathered")

    threads = [threading.Thread(target=http_thread, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while arrivals.pending < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    gatherer = threading.Thread(target=generation_thread)
    gatherer.start()
    time.sleep(0.05)  # the gatherer is waiting by now (were it not, the order below would still hold)
    for k in (0, 1):
        release[k].set()
        threads[k].join(timeout=10)
    gatherer.join(timeout=10)
    assert order == ["queued 0", "queued 1", "gathered"]


def test_a_check_that_fails_releases_its_request_and_a_request_never_queued_bounds_the_wait():
    arrivals = Arrivals(bound=0.05, stale=60)
    with pytest.raises(ValueError), arrivals.checking():
        raise ValueError("a bad prompt")
    assert arrivals.pending == 0
    with arrivals.checking():
        pass  # admitted, then its handler failed before queueing it
    waiting = threading.Thread(target=arrivals.gather)
    waiting.start()
    waiting.join(timeout=30)
    assert not waiting.is_alive()  # it gave up at its bound, though the request never came
    assert arrivals.pending == 1
    arrivals.stale = 0.0
    arrivals.gather()  # forgotten once stale
    assert arrivals.pending == 0


def test_pending_counts_the_checks_under_way_but_not_a_stale_one():
    arrivals = Arrivals(bound=0.1, stale=0.05)
    assert arrivals.pending == 0
    with arrivals.checking() as token:
        assert arrivals.pending == 1
        time.sleep(0.1)  # its handler never queued it: counted no more
        assert arrivals.pending == 0
        arrivals.done(token)


def test_requests_arriving_while_gather_waits_are_not_waited_for():
    arrivals = Arrivals(bound=60)
    returned = threading.Event()
    with arrivals.checking() as first:
        gatherer = threading.Thread(target=lambda: (arrivals.gather(), returned.set()))
        gatherer.start()
        deadline = time.monotonic() + 30
        while arrivals.gathering == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert arrivals.gathering == 1  # waiting for the first
        with arrivals.checking():  # a request checked after the wait began, never queued
            arrivals.done(first)
            assert returned.wait(timeout=30)  # the wait ended with the first: the later one does not hold it
            assert arrivals.pending == 1
    gatherer.join(timeout=10)


def steps(budget, limit=1000, on_step=None) -> int:
    n = 0
    for _ in budget:
        n += 1
        if on_step is not None:
            on_step(n)
        if n >= limit:
            break
    return n


def test_with_no_request_waiting_the_steps_run_until_mlx_lms_budget_ends():
    budget = ArrivalBudget(TimeBudget(budget=0.05), Queue())
    t0 = time.monotonic()
    n = steps(budget, limit=10**9, on_step=lambda _: time.sleep(0.001))
    assert n > 1
    assert time.monotonic() - t0 >= 0.05


def test_a_waiting_request_ends_the_run_after_the_step_under_way():
    requests = Queue()
    budget = ArrivalBudget(TimeBudget(budget=3600), requests)
    assert steps(budget, on_step=lambda n: requests.put("r") if n == 3 else None) == 3


def test_a_request_already_waiting_still_lets_one_step_run_each_time():
    requests = Queue()
    requests.put("cannot join the batch")
    budget = ArrivalBudget(TimeBudget(budget=3600), requests)
    assert [steps(budget) for _ in range(3)] == [1, 1, 1]  # the batch progresses while it drains


def test_each_steps_start_and_end_are_kept_for_the_timelines():
    requests = Queue()
    budget = ArrivalBudget(TimeBudget(budget=3600), requests)
    t0 = time.perf_counter()
    n = steps(budget, on_step=lambda n: (time.sleep(0.01), requests.put("r") if n == 3 else None))
    t1 = time.perf_counter()
    begun, seconds = budget.steps_between(t0, t1)
    assert n == 3 and begun == 3  # the third ended as the run did (a request waited)
    assert 0.03 <= seconds <= t1 - t0
    assert budget.steps_between(t1, t1 + 60) == (0, 0.0)


def test_the_generator_wraps_the_budget_mlx_lm_sets():
    from promptstore.serve.loop import StoreResponseGenerator

    gen = StoreResponseGenerator.__new__(StoreResponseGenerator)
    gen.requests = Queue()
    gen._time_budget = TimeBudget()
    assert isinstance(gen._time_budget, ArrivalBudget)
    assert gen._time_budget.requests is gen.requests


@pytest.mark.parametrize("wait", ["-1", "nan", "11"])
def test_serve_refuses_an_arrival_wait_outside_0_to_10_seconds(capsys, wait):
    from promptstore.serve import server

    with pytest.raises(SystemExit) as exit_:
        server.main(["--model", "m", "--arrival-wait", wait])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"promptstore serve: error: --arrival-wait {float(wait)}: give 0 to 10 seconds"
    )


class WaitingInserts:
    """The generation thread's view of the store's cache and its insert scheduler:
    finished requests' inserts waiting."""

    def __init__(self, n: int, replies_before_fetch: bool = True, reply_chunk: int | None = None):
        self.waiting = n
        self.settings = InsertSettings(replies_before_fetch=replies_before_fetch, reply_chunk=reply_chunk)

    @property
    def has_background(self) -> bool:
        return self.waiting > 0

    def background_wait(self) -> float:
        return 0.0

    def run_deferred(self) -> None:
        pass

    def run_background(self, n=None, until=None) -> None:
        self.waiting -= 1 if n == 1 else self.waiting

    def awaiting_first_token(self) -> bool:
        return False


@pytest.mark.parametrize("replies_first,chunk", [(True, None), (False, None), (True, 16)])
def test_while_requests_are_checked_the_idle_generation_thread_stores_waiting_replies(replies_first, chunk):
    """With nothing queued, a waiting insert runs (one per call) while a burst's
    requests are still being checked when their next turns store their replies
    first anyway (a GPU's reply is one forward); otherwise, and where inserts run
    in short chunks (CPU: the request being checked may be a new conversation's,
    which must not wait behind another's reply), the thread waits for the check."""
    from promptstore.serve.loop import StoreResponseGenerator

    gen = StoreResponseGenerator.__new__(StoreResponseGenerator)
    gen.requests, gen.arrivals, gen._is_distributed, gen._closing = Queue(), Arrivals(bound=0.05), False, None
    gen.store_cache = gen.inserts = WaitingInserts(2, replies_first, chunk)
    overlaps = replies_first and chunk is None
    with gen.arrivals.checking() as token:  # a request being checked, not yet queued
        assert gen._next_request(timeout=0.01) is None
        assert gen.store_cache.waiting == (1 if overlaps else 2)
    gen.arrivals.done(token)  # as its handler does when it queues it
    gen.requests.put("a queued request")
    assert gen._next_request(timeout=0.01) == "a queued request"  # a queued request goes first
    assert gen.store_cache.waiting == (1 if overlaps else 2)
    assert gen._next_request(timeout=0.01) is None  # nothing queued or checked: a waiting insert runs
    assert gen.store_cache.waiting == (0 if overlaps else 1)


class GracedInserts(WaitingInserts):
    """A finished request's insert within its grace (InsertSettings.reply_grace)."""

    def __init__(self, n: int, grace: float):
        super().__init__(n, replies_before_fetch=True, reply_chunk=8)
        self.ready_at = time.monotonic() + grace

    def background_wait(self) -> float:
        return max(0.0, self.ready_at - time.monotonic())


def test_a_finished_requests_insert_waits_its_grace_and_a_request_sent_meanwhile_goes_first():
    """Neither an idle generation thread nor a batch step begins a finished
    request's insert within its grace: a request sent as the reply ended is
    taken at once; the idle thread waits on the queue until the grace ends."""
    from promptstore.serve.loop import StoreResponseGenerator

    gen = StoreResponseGenerator.__new__(StoreResponseGenerator)
    gen.requests, gen.arrivals, gen._is_distributed, gen._closing = Queue(), Arrivals(bound=0.05), False, None
    gen._stop = False
    gen.store_cache = gen.inserts = GracedInserts(1, grace=0.3)
    gen._before_step()  # a step while the batch only decodes
    assert gen.store_cache.waiting == 1
    threading.Timer(0.05, gen.requests.put, args=["a request sent as the reply ended"]).start()
    assert gen._next_request(timeout=1.0) == "a request sent as the reply ended"
    assert gen.store_cache.waiting == 1  # not begun in front of it
    assert gen._next_request(timeout=1.0) is None  # waits out the grace, on the queue
    assert gen.store_cache.waiting == 1 and gen.store_cache.background_wait() < 0.05
    time.sleep(gen.store_cache.background_wait())
    assert gen._next_request(timeout=1.0) is None
    assert gen.store_cache.waiting == 0  # the grace over, it ran
