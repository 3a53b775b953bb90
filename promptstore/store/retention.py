"""Retention: how long a client asked the store to keep a prefix.

A class names the wish the APIs spell ("5m", "1h" for Anthropic's
cache_control.ttl; "in_memory", "24h" for OpenAI's prompt_cache_retention). A
node retained with one is kept until its `keep_until` while the budgets allow
(eviction takes what nobody asked to keep first); after that it competes like
any other. `in_memory` is never written to disk. When requests share a node,
the class kept longer wins.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from ..errors import SettingsError


@dataclass(frozen=True)
class Retention:
    """A retention class, or (with keep_until) one applied to a node.

    name: the API's word for it ("none", "5m", "1h", "24h", "in_memory").
    keep_seconds: how long after the request the prefix is kept.
    never_write: held in memory only, never written to disk.
    keep_until: clock time until which the node is kept; None for a class not
        applied yet, or for an in_memory node whose time has passed (still never
        written).
    """

    name: str
    keep_seconds: float
    never_write: bool = False
    keep_until: float | None = None

    def applied(self, now: float) -> Retention:
        """This class as applied by a request at clock time `now`."""
        return replace(self, keep_until=now + self.keep_seconds)

    def kept(self, now: float) -> bool:
        """Whether it still asks to keep its node at clock time `now`."""
        return self.keep_until is not None and self.keep_until > now

    def outlasts(self, other: Retention) -> bool:
        """Whether this applied class wins over `other` on one node: it is kept
        longer; on a tie, the one that may be written (it keeps more)."""
        mine, theirs = self.keep_until or 0.0, other.keep_until or 0.0
        return mine > theirs or (mine == theirs and other.never_write and not self.never_write)


NONE = Retention("none", 0.0)
CLASSES: dict[str, Retention] = {
    r.name: r
    for r in (
        NONE,
        Retention("5m", 300.0),
        Retention("1h", 3600.0),
        Retention("24h", 86400.0),
        # OpenAI keeps in_memory prefixes for minutes of inactivity: five here, as "5m".
        Retention("in_memory", 300.0, never_write=True),
    )
}

# The prefix up to each end (a token count) gets its class.
Marks = tuple[tuple[int, Retention], ...]


def retention_class(value: Retention | str | None) -> Retention:
    """The class `value` names (a Retention is taken as it is; None is "none")."""
    if value is None:
        return NONE
    if isinstance(value, Retention):
        return value
    found = CLASSES.get(value) if isinstance(value, str) else None
    if found is None:
        raise SettingsError(f"retention must be one of {', '.join(CLASSES)}, got {value!r}")
    return found


def marks(value, n_tokens: int) -> Marks:
    """`value` as marks over an insert of `n_tokens`: a class (or its name) for the
    whole of it, or (end, class) pairs for the prefix up to each end."""
    if value is None or isinstance(value, (str, Retention)):
        r = retention_class(value)
        return () if r is NONE else ((n_tokens, r),)
    out = []
    for end, r in value:
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise SettingsError(f"a retention mark's end must be a token count, got {end!r}")
        r = retention_class(r)
        if r is not NONE and end > 0:
            out.append((min(end, n_tokens), r))
    return tuple(out)


def strongest(found: Iterable[Retention]) -> Retention | None:
    best = None
    for r in found:
        if best is None or r.outlasts(best):
            best = r
    return best


def covering(given: Marks, start: int) -> Retention | None:
    """The strongest class of the marks whose prefix reaches past `start` (a node
    that starts there holds some of it)."""
    return strongest(r for end, r in given if end > start)


def record_fields(r: Retention, recorded_until: float | None) -> dict:
    """A node record's retention fields once `r` applies: none to change when the
    record keeps the node as long already."""
    if r.never_write or r.keep_until is None or (recorded_until is not None and recorded_until >= r.keep_until):
        return {}
    return {"retention": r.name, "keep_until": r.keep_until}


@dataclass(frozen=True)
class RetentionFigures:
    """What retention did in this process.

    held: nodes kept now, by class (an in_memory node past its time is not held).
    kept: times an eviction passed over a retained node it would otherwise have
        taken (memory or disk).
    expired: retained nodes whose time passed.
    never_written: in_memory nodes that left memory without being written.
    """

    held: dict[str, int]
    kept: int = 0
    expired: int = 0
    never_written: int = 0


class Retained:
    """The retention of this process's nodes, by node key, read against `clock`."""

    SWEEP_EVERY = 256  # applications between sweeps of what expired

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.by_key: dict[bytes, Retention] = {}
        self.counts: Counter = Counter()
        self.lock = threading.Lock()
        self._since_sweep = 0

    def apply(self, key: bytes, applied: Retention) -> Retention:
        """Give `key` the applied class unless what it has outlasts it; returns what it has now."""
        with self.lock:
            old = self.by_key.get(key)
            if old is None or applied.outlasts(old):
                self.by_key[key] = old = applied
            self._since_sweep += 1
            if self._since_sweep >= self.SWEEP_EVERY:
                self._sweep()
            return old

    def of(self, key: bytes) -> Retention | None:
        with self.lock:
            return self.by_key.get(key)

    def kept(self, key: bytes) -> bool:
        """Whether `key` is retained now (eviction takes it last)."""
        r = self.by_key.get(key)
        return r is not None and r.kept(self.clock())

    def never_write(self, key: bytes) -> bool:
        r = self.by_key.get(key)
        return r is not None and r.never_write

    def move(self, key: bytes, to: bytes) -> None:
        """A node was split: its upper half, `to`, is kept as it was."""
        r = self.of(key)
        if r is not None:
            self.apply(to, r)

    def drop(self, key: bytes) -> Retention | None:
        """`key` left this process (removed, or an in_memory node left memory)."""
        with self.lock:
            return self.by_key.pop(key, None)

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def figures(self) -> RetentionFigures:
        with self.lock:
            self._sweep()
            held = Counter(r.name for r in self.by_key.values() if r.keep_until is not None)
            return RetentionFigures(
                held={name: held[name] for name in CLASSES if name != NONE.name},
                kept=self.counts["kept"],
                expired=self.counts["expired"],
                never_written=self.counts["never_written"],
            )

    def _sweep(self) -> None:
        """Forget what expired; an in_memory node stays known (never written) while it lives."""
        self._since_sweep = 0
        now = self.clock()
        for key, r in list(self.by_key.items()):
            if r.keep_until is None or r.kept(now):
                continue
            self.counts["expired"] += 1
            if r.never_write:
                self.by_key[key] = replace(r, keep_until=None)
            else:
                del self.by_key[key]


def keys_of(key_or_nodes) -> Sequence[bytes]:
    """Node keys from a key, a node, or an iterable of either."""
    if isinstance(key_or_nodes, (bytes, bytearray)):
        return [bytes(key_or_nodes)]
    if hasattr(key_or_nodes, "key"):
        return [key_or_nodes.key]
    return [k if isinstance(k, (bytes, bytearray)) else k.key for k in key_or_nodes]
