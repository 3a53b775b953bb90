"""ArrivalBudget: a run of batch steps ends once a request waits, after at least one step."""

import time
from queue import Queue

from mlx_lm.server import TimeBudget

from promptstore.serve.server import ArrivalBudget


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


def test_the_generator_wraps_the_budget_mlx_lm_sets():
    from promptstore.serve.server import StoreResponseGenerator

    gen = StoreResponseGenerator.__new__(StoreResponseGenerator)
    gen.requests = Queue()
    gen._time_budget = TimeBudget()
    assert isinstance(gen._time_budget, ArrivalBudget)
    assert gen._time_budget.requests is gen.requests
