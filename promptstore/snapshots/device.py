"""Where snapshot arrays live, and the moves between host and accelerator memory.

On CPU and Apple silicon memory is one: a file read on MLX's CPU stream lands
where the model reads it, and the host reads any array in place. On CUDA, MLX
keeps arrays made on the CPU stream in managed memory (a GPU kernel migrates
it on first touch) and moves a device array into managed memory for good the
moment the host reads it, with the reader's GIL held. These helpers keep hot
arrays on the device, take host reads off the GIL, and reach the CUDA runtime
MLX loaded: the staged copies of promptstore's reader (reader.py) and the
prefetch of files MLX's loader read into managed memory.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import mlx.core as mx

log = logging.getLogger("promptstore.snapshots")

# Where MLX's loader reads cold files (CPU, Apple silicon; CUDA without promptstore's
# reader): memory every backend's device can use, read by MLX's I/O threads.
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
    host_address_space(list(copies.values()))
    return copies


# Bytes of host-read copies dropped since MLX's buffer cache was last emptied;
# past CLEAR_BYTES, release_host_copies empties it.
CLEAR_BYTES = 256 << 20
_dropped = 0
_dropped_lock = threading.Lock()


def release_host_copies(copies: dict[str, mx.array], *, flush: bool = False) -> None:
    """Drop host_readable's copies (the caller holds no other reference). CUDA:
    their pages now sit in host memory, and MLX keeps freed buffers for reuse: a
    later kernel given one faults its pages back one by one, inside whatever
    request it serves (on an H200, a batch over four 5k-token caches right after
    2.6 GB of spill copies were dropped: 132-154 ms; emptied: 109-112; with no
    spill before it: 111-115; on an H100, the 28 GB left by an 8B model's weights
    digest made the next batches 1.4-2.0 s instead of 0.2). So once CLEAR_BYTES
    of copies have been dropped, or at once with `flush`, MLX's buffer cache is
    emptied. Elsewhere the copies are the originals: nothing to do."""
    global _dropped
    if not CUDA:
        return
    nbytes = sum(a.nbytes for a in copies.values())
    copies.clear()
    with _dropped_lock:
        _dropped += nbytes
        if _dropped < CLEAR_BYTES and not (flush and _dropped):
            return
        _dropped = 0
    mx.clear_cache()


def address(array: mx.array) -> int:
    """The host address of an array's memory (on CUDA, managed memory: call it
    only on arrays already there, as host_address_space leaves them)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(array)))


def host_address_space(arrays: list[mx.array]) -> None:
    """CUDA: move arrays MLX made in device memory into managed memory, where
    the host can address them, by a one-element read on the CPU stream (inside
    mx.eval, so without the GIL). A buffer moves by a copy on the device: its
    pages stay there."""
    if CUDA:
        mx.eval([mx.sum(a.reshape(-1)[:1], stream=mx.cpu) for a in arrays if a.size])


# --- the CUDA runtime MLX loaded (prefetches and staged copies; CUDA only) ---

_runtime = None
_runtime_lock = threading.Lock()


class CudaError(RuntimeError):
    """The CUDA runtime refused a call (not the fault of any file)."""


class _Runtime:
    """The CUDA runtime MLX loaded, called through ctypes (each call releases
    the GIL): prefetches of managed ranges to the current device, and copies
    from pinned staging buffers on each thread's own stream."""

    def __init__(self):
        path = next(
            (line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line and "/" in line), None
        )
        if path is None:
            raise OSError("the CUDA runtime is not loaded")
        lib = self.lib = ctypes.CDLL(path)
        vp = ctypes.c_void_p
        self.device = ctypes.c_int(0)
        lib.cudaGetDevice(ctypes.byref(self.device))
        self.stream = vp(2)  # cudaStreamPerThread: each thread its own stream
        if hasattr(lib, "cudaMemPrefetchAsync_v2") or ".so.13" in path:

            class Location(ctypes.Structure):
                _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

            fn = getattr(lib, "cudaMemPrefetchAsync_v2", None) or lib.cudaMemPrefetchAsync
            fn.argtypes = [vp, ctypes.c_size_t, Location, ctypes.c_uint, vp]
            location = Location(1, self.device.value)  # cudaMemLocationTypeDevice
            self._prefetch = lambda ptr, n: fn(ptr, n, location, 0, self.stream)
        else:
            fn = lib.cudaMemPrefetchAsync
            fn.argtypes = [vp, ctypes.c_size_t, ctypes.c_int, vp]
            self._prefetch = lambda ptr, n: fn(ptr, n, self.device.value, self.stream)
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaHostAlloc.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t, ctypes.c_uint]
        lib.cudaMemcpyAsync.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp]
        lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cudaEventRecord.argtypes = [vp, vp]
        lib.cudaEventSynchronize.argtypes = [vp]

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise CudaError(f"{what} failed (CUDA error {code})")

    def prefetch(self, arrays) -> bool:
        for a in arrays:
            if a.nbytes and self._prefetch(address(a), a.nbytes) != 0:
                return False
        return self.lib.cudaStreamSynchronize(self.stream) == 0

    def pinned(self, nbytes: int) -> tuple[int, memoryview]:
        """Page-locked host memory (never freed: staging buffers live as long as
        the process), as its address and a writable view."""
        ptr = ctypes.c_void_p()
        self.check(self.lib.cudaHostAlloc(ctypes.byref(ptr), nbytes, 0), "cudaHostAlloc")
        return ptr.value, memoryview((ctypes.c_char * nbytes).from_address(ptr.value)).cast("B")

    def event(self) -> ctypes.c_void_p:
        event = ctypes.c_void_p()
        self.check(self.lib.cudaEventCreateWithFlags(ctypes.byref(event), 2), "cudaEventCreate")  # no timing
        return event

    def copy_async(self, dst: int, src: int, nbytes: int, done: ctypes.c_void_p) -> None:
        """Copy on this thread's stream; `done` is recorded after it."""
        self.check(self.lib.cudaMemcpyAsync(dst, src, nbytes, 4, self.stream), "cudaMemcpyAsync")  # cudaMemcpyDefault
        self.check(self.lib.cudaEventRecord(done, self.stream), "cudaEventRecord")

    def wait(self, event: ctypes.c_void_p) -> None:
        self.check(self.lib.cudaEventSynchronize(event), "cudaEventSynchronize")

    def sync(self) -> None:
        """Wait for everything this thread queued."""
        self.check(self.lib.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")


def runtime() -> _Runtime | None:
    """The CUDA runtime MLX loaded; None where MLX does not run on CUDA, or the
    runtime cannot be reached (logged once)."""
    global _runtime
    if not CUDA:
        return None
    with _runtime_lock:
        if _runtime is None:
            try:
                _runtime = _Runtime()
            except (OSError, AttributeError) as e:
                log.info("the CUDA runtime is not reachable (%s): reads go through MLX's loader", e)
                _runtime = False
    return _runtime or None


def prefetch(arrays) -> bool:
    """Migrate host-resident arrays (read on the CPU stream) to the GPU now, at the
    bus's speed, instead of a page fault at a time at their first use. False where
    there is nothing to do (not CUDA) or the runtime refused."""
    rt = runtime()
    return rt is not None and rt.prefetch(list(arrays))
