"""Background spills give way to requests: a spill pauses between chunks while
the store's `give_way` predicate is true, for at most its bound per spill, and
goes on once it is false; a `sync` write (the caller's own thread) never pauses."""

import threading
import time

import pytest

from promptstore import PromptStore
from promptstore.snapshots import pacing

from ..conftest import _model, forward, fresh_cache, prompt_tokens


def _files(store) -> int:
    return sum(1 for _ in store.tiers.cold.iter_files())


def _insert(space, model, seed: int) -> None:
    tokens = prompt_tokens(40, seed=seed)
    cache = fresh_cache(model)
    forward(model, cache, tokens)
    space.insert(tokens, cache)


@pytest.mark.timeout(120)
def test_a_spill_waits_while_busy_and_goes_on_once_not(tmp_path):
    model = _model("llama")
    busy = threading.Event()
    busy.set()
    with PromptStore.open(tmp_path / "store", durability="write_through") as store:
        store.give_way(busy.is_set, at_most=60)
        space = store.bind(model, model_id="tiny-llama")
        _insert(space, model, seed=1)
        time.sleep(0.5)
        assert _files(store) == 0  # held between its chunks
        busy.clear()
        store.flush()
        assert _files(store) == 1


@pytest.mark.timeout(120)
def test_a_spill_is_held_at_most_its_bound_and_never_in_a_sync_write(tmp_path):
    model = _model("llama")
    with PromptStore.open(tmp_path / "store", durability="write_through") as store:
        store.give_way(lambda: True, at_most=0.2)  # always busy: each spill waits its bound, then goes
        space = store.bind(model, model_id="tiny-llama")
        started = time.monotonic()
        _insert(space, model, seed=2)
        store.flush()
        assert _files(store) == 1 and time.monotonic() - started < 30
    with PromptStore.open(tmp_path / "sync", durability="sync") as store:
        store.give_way(lambda: True, at_most=60)
        space = store.bind(model, model_id="tiny-llama")
        started = time.monotonic()
        _insert(space, model, seed=3)  # written on this thread: no pace here (held, it would take 60 s)
        assert _files(store) == 1 and time.monotonic() - started < 30 and pacing.current() is None


def test_a_pace_that_fails_does_not_hold_a_spill():
    def broken() -> bool:
        raise RuntimeError("no")

    pace = pacing.Pace(broken, at_most=60)
    started = time.monotonic()
    pace.wait()
    assert time.monotonic() - started < 1 and pace.held < 1
