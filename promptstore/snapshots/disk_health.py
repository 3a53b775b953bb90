"""Whether the disk takes the cold tier's writes, and what it refused.

A refused write (a full disk, a read-only or failing one) starts a spell: one
warning, then writes wait a back-off (1 s, doubling up to a minute) before the
next is tried, instead of each node failing again every second; the store is
`degraded` (serve's /health says so) until a write goes through, which ends
the spell with one more warning and its counts. What was refused stays in
memory meanwhile and is tried again as the back-off allows.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("promptstore.snapshots")

FIRST_WAIT_S = 1.0
LONGEST_WAIT_S = 60.0


@dataclass(frozen=True)
class DiskState:
    """What /health and /metrics say of the disk.

    refusing: a write was refused and none has gone through since; `since` (the
    clock's seconds) and `reason` (the last refusal) describe the spell.
    refused_writes, refused_bytes: writes the disk refused since the store opened.
    deferred_writes: writes not tried because the back-off had not passed.
    """

    refusing: bool
    since: float | None
    reason: str | None
    refused_writes: int
    refused_bytes: int
    deferred_writes: int


class DiskHealth:
    """The disk's answers to the writes of one store, for every thread that writes."""

    def __init__(self, root: str | os.PathLike | None = None, clock: Callable[[], float] = time.monotonic):
        self.root, self.clock = root, clock  # root: a folder on the disk, to say how full it is
        self._lock = threading.Lock()
        self._since: float | None = None
        self._reason: str | None = None
        self._wait = FIRST_WAIT_S
        self._retry_at = 0.0
        self._spell_writes = self._spell_bytes = 0
        self.refused_writes = self.refused_bytes = self.deferred_writes = 0

    @property
    def refusing(self) -> bool:
        return self._since is not None

    def may_try(self) -> bool:
        """Whether a write may go to the disk now: always, unless the disk refused
        the last one and its back-off has not passed (then it counts as deferred)."""
        with self._lock:
            if self._since is None or self.clock() >= self._retry_at:
                return True
            self.deferred_writes += 1
            return False

    def retry_in(self) -> float | None:
        """Seconds until the back-off lets the next write try; None when not refusing."""
        with self._lock:
            return None if self._since is None else max(0.0, self._retry_at - self.clock())

    def try_now(self) -> None:
        """Let the next write try at once (a close's last attempt)."""
        with self._lock:
            self._retry_at = 0.0

    def refused(self, error: BaseException, nbytes: int) -> None:
        """A write of `nbytes` failed: count it, start (or go on with) the spell, and
        wait longer before the next try."""
        with self._lock:
            now = self.clock()
            self.refused_writes += 1
            self.refused_bytes += nbytes
            self._spell_writes += 1
            self._spell_bytes += nbytes
            self._reason = _reason(error, _free_bytes(self.root))
            first = self._since is None
            if first:
                self._since, self._wait = now, FIRST_WAIT_S
            else:
                self._wait = min(self._wait * 2, LONGEST_WAIT_S)
            self._retry_at = now + self._wait
        if first:
            log.warning(
                "the disk refuses writes (%s): what is not on disk stays in memory and is tried again "
                "after a back-off of %.0f s up to %.0f s; the store is degraded until a write goes through",
                self._reason,
                FIRST_WAIT_S,
                LONGEST_WAIT_S,
            )
        else:
            log.debug("the disk refused a write again (%s); next try in %.0f s", error, self._wait)

    def accepted(self) -> bool:
        """A write went through; True if it ended a spell (said once, with its counts)."""
        with self._lock:
            if self._since is None:
                return False
            lasted, writes, nbytes = self.clock() - self._since, self._spell_writes, self._spell_bytes
            self._since = self._reason = None
            self._spell_writes = self._spell_bytes = 0
            self._wait, self._retry_at = FIRST_WAIT_S, 0.0
        log.warning(
            "the disk takes writes again after %.0f s: it refused %d writes (%.1f MB) meanwhile; "
            "what waited in memory is written now",
            lasted,
            writes,
            nbytes / 1e6,
        )
        return True

    def state(self) -> DiskState:
        with self._lock:
            return DiskState(
                self._since is not None,
                self._since,
                self._reason,
                self.refused_writes,
                self.refused_bytes,
                self.deferred_writes,
            )


# What a system says when a disk refuses a write; a reason names one of these when it can.
SAID = ("No space left on device", "Disk quota exceeded", "Read-only file system", "Input/output error")


FULL_BELOW = 1 << 20  # free bytes under which a disk is full, whatever a short write was called


def _reason(error: BaseException, free: int | None) -> str:
    """What the system said (No space left on device, ...), not the file's name:
    /health says it to anyone, and a file's name holds a node's key. LMDB calls
    a write that came short an I/O error: on a disk with next to no room left,
    that is a full disk."""
    while error.__cause__ is not None and not isinstance(error, OSError):
        error = error.__cause__
    if isinstance(error, OSError) and error.strerror:
        said = error.strerror
    else:
        said = next((s for s in SAID if s in str(error)), "the disk refused a write")
    if said != SAID[0] and free is not None and free < FULL_BELOW:
        return f"{SAID[0]} ({said}, {free >> 10} KiB free)"
    return said


def _free_bytes(root) -> int | None:
    try:
        st = os.statvfs(root) if root is not None else None
    except OSError:
        return None
    return None if st is None else st.f_bavail * st.f_frsize
