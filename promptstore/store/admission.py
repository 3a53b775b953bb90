"""Admission: which nodes the cold tier takes under the `admit` durability, and when.

A node goes to disk once it is reused (a fetch restored through it, or two
prompts share it), once its conversation is idle, when memory evicts it and it
is worth keeping, and at close whatever a client can come back to: every chat
turn (the server marks them) and every conversation. A one-off prompt nobody
came back to (a /v1/completions prompt) never does, unless memory evicts it and
it costs `admit_prefill_seconds` or more to compute again. `admit` is the one decision; a client's retention class (when the tiers
know one) overrides it first. A byte budget per hour makes the store write
less, the least valuable first, and never makes a request wait.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from ..config import Settings

log = logging.getLogger("promptstore.store")

# What asks for a decision: the tiers' periodic look (off the generation thread),
# memory evicting the node, or the store closing.
Event = Literal["tick", "evicted", "shutdown"]
HOUR = 3600.0


class RetentionClass(Protocol):
    """What admission reads of a client's retention class (store/retention.py, when present)."""

    never_write: bool  # the client asked that this state never reach disk
    keep_until: float | None  # on the tiers' clock: keep (write) it until then


@dataclass(frozen=True)
class Facts:
    """What the decision weighs of one node held in memory and not yet on disk.

    reused: a fetch restored through it, or a split made it the shared prefix of two prompts.
    conversation: it goes on from a node that was reused and that nothing else went on from
        (a conversation's next turn), or from another conversation node.
    idle_for: seconds since a prompt last went through or ended at it.
    turn: a chat turn stored it (a prompt or reply of the chat APIs): a client
        may come back to it, so a close writes it even before anyone has.
    """

    nbytes: int
    prefill_seconds: float
    reused: bool
    conversation: bool
    idle_for: float
    retention: RetentionClass | None = None
    turn: bool = False


def admit(event: Event, facts: Facts, now: float, settings: Settings) -> bool:
    """Whether a node is worth writing to disk at `event` (the whole policy)."""
    retention = facts.retention
    if retention is not None:  # the hook: a client's retention class decides first
        if getattr(retention, "never_write", False):
            return False
        keep_until = getattr(retention, "keep_until", None)
        if keep_until is not None and keep_until > now:
            return True
    if facts.reused:
        return True
    if event == "tick":  # steady state: a first turn waits until someone comes back to it
        return facts.conversation and facts.idle_for >= settings.admit_idle_seconds
    # Leaving memory (evicted, or the process stopping): whatever a client can come
    # back to. One write per stop of what memory holds is cheap; losing a chat's
    # first turn at every restart is not. A prompt of /v1/completions nobody came
    # back to is a one-off (a client that wants it kept asks for a retention class);
    # memory evicting it writes it if it costs enough to compute again.
    if facts.conversation or facts.turn:
        return True
    return event == "evicted" and facts.prefill_seconds >= settings.admit_prefill_seconds


class WriteBudget:
    """Bytes written over the last hour against `per_hour` (None: no budget)."""

    def __init__(self, per_hour: int | None):
        self.per_hour = per_hour
        self._spent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def take(self, nbytes: int, now: float) -> bool:
        """Spend `nbytes` if they fit what is left of the hour; False (nothing spent) if not."""
        if self.per_hour is None:
            return True
        with self._lock:
            while self._spent and self._spent[0][0] <= now - HOUR:
                self._spent.popleft()
            if sum(n for _, n in self._spent) + nbytes > self.per_hour:
                return False
            self._spent.append((now, nbytes))
            return True


class Admission:
    """What the tiers remember of nodes for the decision, and the budget."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.budget = WriteBudget(settings.disk_write_budget)
        self.reused: set[bytes] = set()
        self.conversation: set[bytes] = set()
        self.turns: set[bytes] = set()  # nodes a chat turn stored
        self.active: dict[bytes, float] = {}  # key -> when a prompt last went through or ended at it
        self.lock = threading.Lock()

    def placed(
        self, key: bytes, parent: bytes | None, only_child: Callable[[], bool], now: float, turn: bool = False
    ) -> None:
        """A node was stored, going on from `parent`: a conversation node when the
        parent is one, or when the parent was reused and this is its only child;
        `turn`: a chat turn stored it."""
        with self.lock:
            self.active[key] = now
            if turn:
                self.turns.add(key)
            if parent is None:
                return
            if parent in self.conversation or (parent in self.reused and only_child()):
                self.conversation.add(key)

    def used(self, keys: Iterable[bytes], now: float) -> None:
        """A prompt went through these nodes (a hit), or two prompts share them (a split)."""
        with self.lock:
            for key in keys:
                self.reused.add(key)
                self.active[key] = now

    def facts(self, key: bytes, nbytes: int, prefill_seconds: float, now: float, retention) -> Facts:
        with self.lock:
            return Facts(
                nbytes,
                prefill_seconds,
                key in self.reused,
                key in self.conversation,
                now - self.active.get(key, now),
                retention,
                key in self.turns,
            )

    def forget(self, keep: Callable[[bytes], bool]) -> None:
        """Drop what is remembered of nodes no longer held (`keep(key)` False)."""
        with self.lock:
            for key in [k for k in self.active if not keep(k)]:
                del self.active[key]
            self.reused = {k for k in self.reused if keep(k)}
            self.conversation = {k for k in self.conversation if keep(k)}
            self.turns = {k for k in self.turns if keep(k)}


class Ticker:
    """A thread calling `tick` every `period` seconds, or sooner when woken."""

    def __init__(self, tick: Callable[[], None], period: float):
        self.tick, self.period = tick, period
        self._wake, self._stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="promptstore-admit", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.period)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:  # a bug must not end the thread: the next tick tries again
                log.exception("admission tick failed")
