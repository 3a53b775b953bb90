"""Where snapshot arrays live, and the moves between host and accelerator memory.

On CPU and Apple silicon memory is one: a file read on MLX's CPU stream lands
where the model reads it, and the host reads any array in place. On CUDA, MLX
keeps arrays made on the CPU stream in managed memory (a GPU kernel migrates
it on first touch) and moves a device array into managed memory for good the
moment the host reads it, with the reader's GIL held. These helpers keep hot
arrays on the device, take host reads off the GIL, and move read files to the
device ahead of their first use.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import mlx.core as mx

log = logging.getLogger("promptstore.snapshots")

# Files are read on MLX's CPU stream: into memory every backend's device can use
# (unified on Apple silicon, managed on CUDA), read by MLX's I/O threads in parallel.
LOAD_STREAM = mx.cpu


def is_cuda() -> bool:
    """Whether MLX runs on its CUDA backend."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


CUDA = is_cuda()


def host_readable(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Arrays with the same bytes that the host reads without moving the originals.

    CUDA: device-to-device copies, moved to managed memory by a one-element read
    on the CPU stream (inside mx.eval, so without the GIL); the originals stay on
    the device. Elsewhere: the arrays themselves (the host reads them in place).
    """
    if not CUDA or not arrays:
        return arrays
    copies = {name: mx.contiguous(mx.array(a)) for name, a in arrays.items()}
    mx.eval([mx.sum(c.reshape(-1)[:1], stream=mx.cpu) for c in copies.values() if c.size])
    return copies


def to_device(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Arrays read from a file, placed where the model reads them fastest.

    CUDA: copies in device memory, so a hit's first use does not migrate managed
    pages a fault at a time (the copy migrates them here, off the hit's path).
    Elsewhere: the arrays themselves.
    """
    if not CUDA or not arrays:
        return arrays
    out = {name: mx.array(a) for name, a in arrays.items()}
    mx.eval(list(out.values()))
    return out


# --- prefetching managed memory to the GPU (CUDA only; a hint, never needed for correctness) ---

_prefetcher = None
_prefetcher_lock = threading.Lock()


class _Prefetcher:
    """cudaMemPrefetchAsync of managed ranges to the current device, through the
    CUDA runtime MLX loaded. Managed memory stays coherent whatever this does."""

    def __init__(self):
        path = next(
            (line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line and "/" in line), None
        )
        if path is None:
            raise OSError("the CUDA runtime is not loaded")
        self.lib = ctypes.CDLL(path)
        self.device = ctypes.c_int(0)
        self.lib.cudaGetDevice(ctypes.byref(self.device))
        self.stream = ctypes.c_void_p(2)  # cudaStreamPerThread
        if hasattr(self.lib, "cudaMemPrefetchAsync_v2") or ".so.13" in path:

            class Location(ctypes.Structure):
                _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

            fn = getattr(self.lib, "cudaMemPrefetchAsync_v2", None) or self.lib.cudaMemPrefetchAsync
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, Location, ctypes.c_uint, ctypes.c_void_p]
            location = Location(1, self.device.value)  # cudaMemLocationTypeDevice
            self.call = lambda ptr, n: fn(ptr, n, location, 0, self.stream)
        else:
            fn = self.lib.cudaMemPrefetchAsync
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            self.call = lambda ptr, n: fn(ptr, n, self.device.value, self.stream)
        self.lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]

    def __call__(self, arrays) -> bool:
        for a in arrays:
            if a.nbytes == 0:
                continue
            view = memoryview(a)  # managed memory already: nothing moves
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(view))
            if self.call(ptr, a.nbytes) != 0:
                return False
        return self.lib.cudaStreamSynchronize(self.stream) == 0


def prefetch(arrays) -> bool:
    """Migrate host-resident arrays (read on the CPU stream) to the GPU now, at the
    bus's speed, instead of a page fault at a time at their first use. False where
    there is nothing to do (not CUDA) or the runtime refused."""
    global _prefetcher
    if not CUDA:
        return False
    with _prefetcher_lock:
        if _prefetcher is None:
            try:
                _prefetcher = _Prefetcher()
            except (OSError, AttributeError) as e:
                log.info("no managed-memory prefetch (%s): pages migrate on first use", e)
                _prefetcher = False
    return bool(_prefetcher) and _prefetcher(list(arrays))
