"""Pools of threads that belong to one process: made at first use, and made again
in a forked child (a fork inherits no threads, only a pool object that names them)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


class ProcessPool:
    """A pool of threads of this process, made at first use (a forked child
    makes its own)."""

    def __init__(self, workers: int, name: str):
        self.workers, self.name = workers, name
        self._pool: tuple[int, ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool[0] != os.getpid():
                self._pool = (os.getpid(), ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name))
            return self._pool[1]
