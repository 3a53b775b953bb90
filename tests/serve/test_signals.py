"""How `promptstore serve` takes SIGTERM and SIGINT: a KeyboardInterrupt in the main
thread, except where one would leave a lock of logging's taken (then the signal comes
again a moment later); the end-to-end cases are in test_lifecycle.py."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import pytest

from promptstore.serve.shutdown import RESIGNAL_TIMES, Shutdown, _in_logging

NEVER = 1e9  # the shutdown's own deadline (os._exit) never comes in a test


def _frame_inside_logging() -> object:
    """A frame of code that logging's own code called (a handler's emit)."""
    frames = []

    class Capture(logging.Handler):
        def emit(self, record):
            frames.append(sys._getframe())

    logger, handler = logging.getLogger("promptstore-test-signals"), Capture()
    logger.addHandler(handler)
    try:
        logger.warning("a line")
    finally:
        logger.removeHandler(handler)
    return frames[0]


def test_a_signal_inside_logging_comes_again_and_then_stops_serving():
    got, again = [], threading.Event()

    def record(signum, frame):
        got.append(signum)
        again.set()

    previous = signal.signal(signal.SIGUSR1, record)
    try:
        shutdown = Shutdown(NEVER)
        inside = _frame_inside_logging()
        assert _in_logging(inside) and not _in_logging(sys._getframe())
        shutdown._on_signal(signal.SIGUSR1, inside)  # no KeyboardInterrupt there
        assert not shutdown.started
        deadline = time.monotonic() + 10
        while not again.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)  # the main thread runs Python handlers between its own steps
        assert got == [signal.SIGUSR1], "the signal was not delivered again"
        with pytest.raises(KeyboardInterrupt):
            shutdown._on_signal(signal.SIGUSR1, sys._getframe())  # elsewhere: stop serving
        assert shutdown.started
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_that_keeps_landing_inside_logging_stops_serving_there_in_the_end(monkeypatch):
    """A main thread kept inside logging (a write to a pipe nobody reads) still stops:
    after RESIGNAL_TIMES deliveries in a row the signal raises where it lands."""
    sent = []
    monkeypatch.setattr("promptstore.serve.shutdown.threading.Timer", _Recorder(sent))
    shutdown, inside = Shutdown(NEVER), _frame_inside_logging()
    for _ in range(RESIGNAL_TIMES):
        shutdown._on_signal(signal.SIGTERM, inside)
    assert len(sent) == RESIGNAL_TIMES and not shutdown.started
    with pytest.raises(KeyboardInterrupt):
        shutdown._on_signal(signal.SIGTERM, inside)
    assert shutdown.started


class _Recorder:
    """threading.Timer's place: records what would be sent again, sends nothing
    (the shutdown's own deadline timer is recorded too, never started)."""

    def __init__(self, sent: list):
        self.sent = sent

    def __call__(self, seconds, function, args=()):
        self.sent.append((seconds, function, args))
        return _Idle()


class _Idle:
    daemon = False

    def start(self) -> None:
        pass


def test_a_signal_while_the_store_opens_stops_serving_once_it_is_open():
    """signals_postponed(): the signal raises nothing inside the block (where the store is
    being opened and its warm start begins), then KeyboardInterrupt once the
    block is done, its result in hand; the shutdown's deadline started at the
    signal."""
    shutdown = Shutdown(NEVER)
    opened = None
    with pytest.raises(KeyboardInterrupt):
        with shutdown.signals_postponed():
            shutdown._on_signal(signal.SIGTERM, sys._getframe())  # nothing raised here
            assert shutdown.started
            opened = "store"
    assert opened == "store" and not shutdown.postponing
    with pytest.raises(KeyboardInterrupt):  # postponed no longer: the next one acts where it lands
        Shutdown(NEVER)._on_signal(signal.SIGTERM, sys._getframe())


def test_a_block_without_a_signal_or_with_its_own_error_is_left_as_it_is():
    shutdown = Shutdown(NEVER)
    with shutdown.signals_postponed():
        pass
    assert not shutdown.started
    with pytest.raises(ValueError):  # the open's own error goes first, signal or not
        with shutdown.signals_postponed():
            shutdown._on_signal(signal.SIGTERM, sys._getframe())
            raise ValueError("no store")
    assert not shutdown.postponing
