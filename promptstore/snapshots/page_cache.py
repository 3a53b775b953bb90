"""How much of a file the page cache holds: a read of those bytes runs at
memory speed, of the others at the disk's (the cold plan asks this of every
cold node of a hit, so it is asked in microseconds where the kernel can).

Linux 6.5 and later answer in one call (`cachestat`, without touching the
file's pages); elsewhere the file is mapped and `mincore` lists its pages.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from pathlib import Path

import numpy as np

CACHESTAT = 451  # the syscall's number (one table for every Linux architecture since 6.5)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


_libc = None
_cachestat = sys.platform == "linux"  # until the kernel says it has no such call


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.syscall.restype = ctypes.c_long
        _libc = lib
    return _libc


def resident_bytes(path: Path) -> int | None:
    """Bytes of the file in the page cache; None where that cannot be told."""
    try:
        _lib()
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except (OSError, AttributeError):
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        pages = cachestat_pages(fd) if _cachestat else None
        if pages is None:
            pages = mincore_pages(fd, size)
        return None if pages is None else min(size, pages * mmap.PAGESIZE)
    except OSError:
        return None
    finally:
        os.close(fd)


def cachestat_pages(fd: int) -> int | None:
    """Pages of the open file in the page cache (cachestat); None where the
    kernel has no such call (it is then not asked again) or refuses."""
    global _cachestat
    lib, stat = _lib(), _Stat()
    whole = _Range(0, 0)  # len 0: to the end of the file
    if lib.syscall(ctypes.c_long(CACHESTAT), fd, ctypes.byref(whole), ctypes.byref(stat), 0) == 0:
        return int(stat.nr_cache)
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a filter that forbids it
        _cachestat = False
    return None


def mincore_pages(fd: int, size: int) -> int | None:
    """Pages of the open file in the page cache (mincore over a mapping); None
    where it cannot be mapped."""
    lib = _lib()
    addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        if lib.mincore(addr, size, vec) != 0:
            return None
        return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
    finally:
        lib.munmap(addr, size)
