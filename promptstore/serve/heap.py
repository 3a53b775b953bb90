"""The process heap on MLX's CPU backend: kept once grown, and grown before the
first request.

On the CPU backend every array MLX makes is a `malloc` of its own, and MLX keeps
freed buffers for reuse only up to its cache limit (mx.set_cache_limit), 32 MiB
by default there. glibc gives freed memory back to the kernel past its
thresholds: the free top of a heap past
M_TRIM_THRESHOLD, a thread's heap once it is wholly free, any block past
M_MMAP_THRESHOLD (which rises only as such blocks are freed). The next prefill's
arrays then fault it back a page at a time, each page zeroed by the kernel,
inside whatever request meets it. Three prompts' prefill of 281 tokens each
over 772 restored (the CPU chat's first round, the bench's small llama, 2
cores) took 341 ms in a fresh process, with ~44,000 page faults, and 300 ms
the time after, with none; with a reserve, 302 ms the first time, with 41
(medians of five processes each way, `tools/bench/probe_heap.py`, in git history at commit a077c50). In
mlx_lm.server and in `promptstore serve` without it, that round faulted
~40,000-45,000 pages.

So, on the CPU backend with glibc, the server keeps up to `reserve` bytes of
freed heap (M_TOP_PAD and M_TRIM_THRESHOLD; blocks up to M_MMAP_THRESHOLD's
largest, 32 MiB, come from the heap) and touches that much once while it
starts, on the thread that runs the model, whose heap the model's arrays come
from. The process holds that memory from then on, as MLX's GPU allocators hold
their caches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

import mlx.core as mx

log = logging.getLogger("promptstore.serve")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit: larger blocks are always mapped on their own
TOUCH_BLOCK = 16 << 20  # the reserve is touched in blocks under that, so they come from the heap
DEFAULT_RESERVE = 512 << 20


def _glibc():
    """The C library when it is glibc (mallopt with these parameters), else None."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 — glibc's own: musl and macOS have no such symbol
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    return libc


def keep_heap(reserve: int) -> tuple[int, float] | None:
    """On MLX's CPU backend with glibc: keep up to `reserve` bytes of freed heap and
    touch that much now, on the calling thread (call it from the thread that runs
    the model). Returns (bytes touched, seconds), or None where nothing was done
    (a GPU, another C library, a reserve of 0)."""
    if reserve <= 0 or mx.default_device() != mx.cpu:
        return None
    libc = _glibc()
    if libc is None:
        return None
    started = time.perf_counter()
    pad = min(reserve, 2**31 - 1)
    if not (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        and libc.mallopt(M_TRIM_THRESHOLD, pad)
        and libc.mallopt(M_TOP_PAD, pad)
    ):
        log.warning("the C library refused the heap settings: the heap is left as it is")
        return None
    blocks, touched = [], 0
    try:
        while touched < reserve:
            size = min(TOUCH_BLOCK, reserve - touched)
            block = libc.malloc(size)
            if not block:
                break
            ctypes.memset(block, 0, size)
            blocks.append(block)
            touched += size
    finally:
        for block in blocks:
            libc.free(block)
    return touched, time.perf_counter() - started
