"""Durability: when a node held in memory goes to disk, one strategy per setting.

Each strategy answers the tiers' questions with a verdict (where a new node
goes; whether a node leaving memory, or due, is written; whether the write
budget lets it) and keeps what it needs to decide: `admit` remembers what was
reused, conversations, chat turns, idle times and the bytes it wrote this
hour. None calls back into the tiers, which carry the verdicts out.

    write_back     hold; write what memory evicts, and everything at close
    write_through  queue every node for the writer at once
    sync           write every node before the insert returns
    admit          hold; write what is reused or idle, evicted and worth keeping,
                   every chat turn and conversation at close (admission.py)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ..config import Settings
from .admission import Admission, Event, admit

# Where a node the tiers place goes: written before the insert returns, queued
# for the background writer, or held in memory until a verdict says otherwise.
Placement = Literal["now", "queue", "hold"]


@dataclass(frozen=True)
class Candidate:
    """A node held in memory and not on disk yet, as a verdict weighs it.

    retention: the class a client asked for (retention.py), when one applies.
    """

    key: bytes
    nbytes: int
    prefill_seconds: float
    retention: object | None = None


class WriteBack:
    """Hold every node; write what memory evicts, and everything at close. With a
    remote tier a node is written at once, to be published from its file."""

    name = "write_back"
    declines = False  # whether some nodes are never written (the metrics count admissions)
    tick_seconds: float | None = None  # the period of `due`, when it has one

    def placed(self, key: bytes, parent: bytes | None, only_child, now: float, turn: bool, publish: bool) -> Placement:
        """A node was stored (`parent`: the node it goes on from; `only_child()`:
        whether nothing else goes on from it; `turn`: a chat turn stored it;
        `publish`: a remote tier publishes it once it is on disk)."""
        return "queue" if publish else "hold"

    def used(self, keys: Iterable[bytes], now: float) -> None:
        """A prompt restored through these nodes, or two prompts share them."""

    def writes(self, event: Event, candidate: Candidate, now: float) -> bool:
        """Whether a node is written when it leaves memory (`evicted`), at close
        (`shutdown`), or is due now (`tick`)."""
        return event != "tick"

    def due(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        """Of the nodes held only in memory, those to write now (most valuable first
        as given), without waiting for eviction or close."""
        return [c for c in candidates if self.writes("tick", c, now)]

    def within_budget(self, nbytes: int, now: float) -> bool:
        """Spend `nbytes` of the write budget; False (nothing spent) when over it."""
        return True

    def forget(self, keep: Callable[[bytes], bool]) -> None:
        """Drop what is remembered of nodes no longer held (`keep(key)` False)."""


class WriteThrough(WriteBack):
    """Queue every node for the writer as it is stored."""

    name = "write_through"

    def placed(self, key, parent, only_child, now, turn, publish) -> Placement:
        return "queue"


class Sync(WriteBack):
    """Write every node before the insert that stores it returns."""

    name = "sync"

    def placed(self, key, parent, only_child, now, turn, publish) -> Placement:
        return "now"


class Admit(WriteBack):
    """Write what is worth reading back (admission.py's `admit`), within a write
    budget per hour; what it declines is never written."""

    name = "admit"
    declines = True

    def __init__(self, settings: Settings):
        self.settings = settings
        self.admission = Admission(settings)
        self.tick_seconds = min(1.0, settings.admit_idle_seconds / 4)

    def placed(self, key, parent, only_child, now, turn, publish) -> Placement:
        self.admission.placed(key, parent, only_child, now, turn)
        return "hold"

    def used(self, keys, now) -> None:
        self.admission.used(keys, now)

    def writes(self, event, candidate, now) -> bool:
        facts = self.admission.facts(
            candidate.key, candidate.nbytes, candidate.prefill_seconds, now, candidate.retention
        )
        return admit(event, facts, now, self.settings)

    def within_budget(self, nbytes, now) -> bool:
        return self.admission.budget.take(nbytes, now)

    def forget(self, keep) -> None:
        self.admission.forget(keep)


STRATEGIES = {s.name: s for s in (WriteBack, WriteThrough, Sync, Admit)}


def durability(settings: Settings) -> WriteBack:
    """The strategy of `settings.durability`."""
    strategy = STRATEGIES[settings.durability]
    return strategy(settings) if strategy is Admit else strategy()
