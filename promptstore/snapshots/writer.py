"""The background writer: spills nodes to the cold tier off the caller's thread.

A bounded queue gives back-pressure instead of unbounded memory; each job is
written (temp file, fsync, rename) and then handed to `publish`, which records
it in the index. A failed write (disk full, read-only filesystem) goes to
`failed`, and the node stays in memory; while the disk refuses, jobs wait its
back-off (disk_health.py) instead of being tried, and `retry` is called each
time the back-off has passed, to hand them over again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..caches import Snapshot
from ..errors import DiskWriteError
from ..identity import NodeId
from . import pacing
from .cold import ColdTier, FileRef
from .disk_health import DiskHealth

log = logging.getLogger("promptstore.snapshots")


_WAKE = object()  # a job that only wakes the writer


@dataclass(eq=False)
class SpillJob:
    node: NodeId
    snapshots: list[Snapshot]
    present: list[bool] | None = None  # per layer, when the job holds less than the node's record says
    done: threading.Event = field(default_factory=threading.Event)
    ref: FileRef | None = None
    error: Exception | None = None


class Writer:
    """One thread writing SpillJobs in order."""

    def __init__(
        self,
        cold: ColdTier,
        publish: Callable[[SpillJob], None],
        failed: Callable[[SpillJob], None],
        maxsize: int = 64,
        retry: Callable[[], int] | None = None,
    ):
        self.cold, self.publish, self.failed, self.retry = cold, publish, failed, retry
        self.health = DiskHealth(cold.root)
        self._waiting = False  # refused jobs wait for a retry (set when one fails, cleared when none is left)
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._pace: pacing.Pace | None = None
        self.thread = threading.Thread(target=self._run, name="promptstore-writer", daemon=True)
        self.thread.start()

    def give_way(self, busy: Callable[[], bool] | None, at_most: float = 1.0) -> None:
        """Hold each spill, between its chunks, while `busy()` is true (requests
        wait for their first tokens), for at most `at_most` seconds per spill;
        None: never hold. Called from any thread; spills from then on follow it."""
        self._pace = pacing.Pace(busy, at_most) if busy is not None else None

    def submit(self, job: SpillJob) -> SpillJob:
        """Queue a job (blocks while the queue is full)."""
        self.queue.put(job)
        return job

    def offer(self, job: SpillJob) -> bool:
        """Queue a job unless the queue is full (then False, and nothing queued): never waits."""
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            return False
        return True

    def write_now(self, job: SpillJob) -> SpillJob:
        """Write in the caller's thread (the `sync` durability)."""
        self._do(job)
        return job

    def flush(self) -> None:
        """Wait until every queued job is written or failed."""
        self.queue.join()

    def close(self) -> None:
        self.flush()
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        # MLX streams belong to threads: this one needs its own.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        while True:
            try:
                job = self.queue.get(timeout=self._retry_wait())
            except queue.Empty:
                self._retry()
                continue
            try:
                if job is None:
                    return
                if job is _WAKE:
                    continue
                pace = self._pace
                if pace is not None:
                    pace.begin()
                pacing.install(pace)
                self._do(job)
            finally:
                self.queue.task_done()

    def _retry_wait(self) -> float | None:
        """How long the queue may stay quiet: until the disk's back-off passes, while
        refused jobs wait for it; for ever otherwise."""
        wait = self.health.retry_in()
        return None if wait is None or self.retry is None or not self._waiting else max(wait, 0.05)

    def _retry(self, over: bool = False) -> None:
        """Hand refused jobs over again once the back-off has passed (or the spell is `over`)."""
        try:
            if self.retry is not None and (over or self.health.retry_in() == 0.0):
                self._waiting = self.retry() > 0
        except Exception:  # a bug must not kill the writer thread
            self._waiting = False
            log.exception("handing refused spills over again failed")

    def _failed(self, job: SpillJob) -> None:
        self._waiting = True
        if threading.current_thread() is not self.thread:  # a sync write: the writer waits for a job
            try:
                self.queue.put_nowait(_WAKE)  # to time the retry
            except queue.Full:
                pass  # it has jobs: it wakes anyway
        self.failed(job)

    def _do(self, job: SpillJob) -> None:
        if not self.health.may_try():
            job.error = DiskWriteError("not tried: the disk refused the last write, and its back-off has not passed")
            self._failed(job)
            job.done.set()
            return
        try:
            started = time.perf_counter()
            job.ref = self.cold.write(job.node, job.snapshots)
            written = time.perf_counter()
            self.publish(job)
            if self.health.accepted():
                self._retry(over=True)  # the spell is over: what waited goes now
            pace = pacing.current()
            log.debug(
                "spill of %s: %.1f MB written in %.1f ms, published in %.1f ms, held %.1f ms",
                job.node.key.hex()[:12],
                job.ref.nbytes / 1e6,
                (written - started) * 1e3,
                (time.perf_counter() - written) * 1e3,
                pace.held * 1e3 if pace is not None else 0.0,
            )
        except DiskWriteError as e:
            job.error = e
            self.health.refused(e, sum(s.nbytes for s in job.snapshots if s is not None))
            log.debug("spill of %s failed; it stays in memory: %s", job.node.key.hex()[:12], e)
            self._failed(job)
        except Exception as e:  # a bug must not kill the writer thread silently
            job.error = e
            log.exception("spill of %s failed", job.node.key.hex()[:12])
            self.failed(job)
        finally:
            job.done.set()
