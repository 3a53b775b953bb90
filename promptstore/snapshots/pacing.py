"""Spills that give way to requests.

A spill copies a node's arrays off the device (on CUDA, by the copy engine, in
16 MB chunks, twice: once for the checksums the header carries, once to write)
and writes them out; beside a batch that waits for its first tokens this slowed
the batch (on an H200, four 5k-token requests whose batch ran beside the spill
of 1.5 GB took 360-500 ms to their first tokens, against 290 in the rounds
without a spill). The writer thread installs a pace here; the chunk loops call
`wait()` between chunks, which holds the spill while its pace says requests are
waiting, for at most a bound per spill, so a spill is delayed, never starved.
Other threads (a `sync` durability write in the caller's thread) are never held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

POLL_S = 0.002  # how often a held spill looks again


class _Local(threading.local):
    pace: Pace | None = None


_local = _Local()


class Pace:
    """Hold a spill while `busy()` is true, for at most `at_most` seconds per
    spill (`begin()` starts a spill's allowance). `held` is the seconds held so far."""

    def __init__(self, busy: Callable[[], bool], at_most: float):
        self.busy, self.at_most = busy, at_most
        self.held = 0.0

    def begin(self) -> None:
        self.held = 0.0

    def wait(self) -> None:
        if self.held >= self.at_most or not self._busy():
            return
        started = time.monotonic()
        deadline = started + self.at_most - self.held
        while time.monotonic() < deadline and self._busy():
            time.sleep(POLL_S)
        self.held += time.monotonic() - started

    def _busy(self) -> bool:
        try:
            return bool(self.busy())
        except Exception:  # a pace that fails must not stop a spill
            return False


def install(pace: Pace | None) -> None:
    """The pace of spills on this thread (None: none)."""
    _local.pace = pace


def current() -> Pace | None:
    return _local.pace


def wait() -> None:
    """Between two chunks of a spill: hold while this thread's pace says so."""
    pace = _local.pace
    if pace is not None:
        pace.wait()
