"""The GPU runtime's libraries read once at start (--read-gpu-libraries), so
their pages are in the page cache before a request's kernels need them."""

from __future__ import annotations

import time
from pathlib import Path

LIBRARY_CHUNK = 16 << 20
READERS = 8  # files read at once: a virtual disk serves parallel reads faster than one stream


def runtime_libraries(maps: str | Path = "/proc/self/maps") -> list[Path]:
    """The shared libraries this process maps (MLX's, the CUDA runtime's,
    cuBLAS's, cuDNN's, the driver's, Python's own), where a CUDA library is
    among them; empty elsewhere (CPU, Apple silicon).

    After a reboot or a dropped page cache, the first request that meets a
    kernel the kernel warm-up did not (cuBLAS picks its kernels by shape) reads it
    from disk a page fault at a time, inside the request."""
    mapped: set[Path] = set()
    try:
        with open(maps) as lines:
            for line in lines:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if ".so" in Path(path).name and path.startswith("/"):
                    mapped.add(Path(path))
    except OSError:
        return []
    if not any("/nvidia/" in str(p) or p.name.startswith(GPU_LIBRARIES) for p in mapped):
        return []
    return sorted(mapped)


GPU_LIBRARIES = ("libcu", "libnvrtc")  # libcuda, libcudart, libcublas, libcudnn, ...; and NVRTC


def read_libraries(paths: list[Path], deadline_s: float = 30.0) -> tuple[int, int, float]:
    """Read `paths` once, several at a time, so their pages are in the page cache
    before a request's kernels need them. Bounded in time; returns (files,
    bytes, seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    started = time.perf_counter()

    def read(path: Path) -> int:
        n = 0
        try:
            with open(path, "rb", buffering=0) as f:
                while time.perf_counter() - started < deadline_s:
                    chunk = f.read(LIBRARY_CHUNK)
                    if not chunk:
                        return n
                    n += len(chunk)
        except OSError:
            return -1
        return n

    with ThreadPoolExecutor(READERS, thread_name_prefix="promptstore-libraries") as pool:
        sizes = list(pool.map(read, paths))
    return sum(n >= 0 for n in sizes), sum(n for n in sizes if n > 0), time.perf_counter() - started
