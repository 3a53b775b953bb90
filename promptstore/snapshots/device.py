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
import functools
import logging
import threading
from collections.abc import Callable, Iterator

import mlx.core as mx

from . import pacing

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


# --- staged reads of device arrays (CUDA): the spill's way to the host ---

STAGE_BYTES = 16 << 20  # one copy into a pinned buffer


class _Stage(threading.local):
    """Each thread's two pinned buffers (made at its first staged read)."""

    buffers: list | None = None


_stage = _Stage()
staging_failed: str | None = None  # why staging stopped (bytes found to differ, a runtime error): host reads since


def staged_sources(arrays: dict[str, mx.array]) -> dict[str, Callable[[], Iterator[memoryview]]] | None:
    """CUDA: for each array, a function giving its bytes in row-major order as
    chunks the GPU's copy engine copied from where the array lives into this
    thread's two pinned host buffers in turn (the next chunk's copy under way
    while the caller uses this one; a chunk is valid until the caller asks for
    the next). Nothing is copied on the device, no page moves, and the host
    reads none of the arrays' memory: a batch running beside a spill is slowed
    far less than by host reads of managed copies (host_readable), which move
    every page (on an H200, a batch over four 5k-token caches beside the spill
    of 2.6 GB: 115 ms staged against 161-177 host-read and 97-108 with no
    spill; the spill itself 0.2 s against 0.4-0.8).

    None where this cannot be done (not CUDA, the runtime or the address kernel
    unreachable, or staging stopped in this process): the caller reads
    host_readable copies."""
    rt = runtime()
    if rt is None or staging_failed is not None or not arrays:
        return None
    owned = {name: mx.contiguous(a) for name, a in arrays.items()}  # a view of part of a buffer becomes its own
    addresses = device_addresses(list(owned.values()))
    if addresses is None:
        return None
    return {
        name: functools.partial(_staged_chunks, rt, a, at, a.nbytes)  # the partial keeps the array alive
        for (name, a), at in zip(owned.items(), addresses)
    }


def _staged_chunks(rt, array: mx.array, at: int, nbytes: int) -> Iterator[memoryview]:
    if _stage.buffers is None:
        _stage.buffers = [[*rt.pinned(STAGE_BYTES), rt.event()] for _ in range(2)]
    buffers, waiting = _stage.buffers, None
    try:
        for i, offset in enumerate(range(0, nbytes, STAGE_BYTES)):
            pacing.wait()  # requests waiting for their first tokens go first
            ptr, _, done = buffers[i % 2]
            n = min(STAGE_BYTES, nbytes - offset)
            rt.copy_async(ptr, at + offset, n, done)  # into the buffer the caller gave back
            if waiting is not None:
                rt.wait(waiting[0][2])
                yield waiting[0][1][: waiting[1]]
            waiting = (buffers[i % 2], n)
        if waiting is not None:
            rt.wait(waiting[0][2])
            yield waiting[0][1][: waiting[1]]
    finally:
        rt.sync()  # no copy into the buffers is in flight once the caller stops


def stop_staging(reason: str) -> None:
    """Spills of this process read through host copies from now on (logged)."""
    global staging_failed
    staging_failed = reason
    log.warning("%s: spills read through host copies from now on", reason)


class StagedElsewhere(RuntimeError):
    """The bytes the copy engine staged are not the array's (an address the
    kernel reported was not where MLX keeps the array)."""


_kernels: dict[str, object] = {}
_kernels_lock = threading.Lock()


def kernel_once(name: str, build: Callable[[], object], without: str):
    """The CUDA kernel `build` makes and runs once, built once per process; None
    where it cannot be (an MLX without cuda_kernel, or no compiler at hand),
    logged once as what happens `without` it."""
    with _kernels_lock:
        if name not in _kernels:
            try:
                _kernels[name] = build()
            except Exception as e:
                log.info("%s (no %s kernel: %s)", without, name, e)
                _kernels[name] = None
        return _kernels[name]


def device_addresses(arrays: list[mx.array]) -> list[int] | None:
    """Where each array's memory is, as the GPU sees it: a one-thread kernel
    given the array as input writes the pointer MLX hands it (row-contiguous
    arrays are handed as they are, offset included). None where the kernel
    cannot be built."""
    kernel = kernel_once("promptstore_array_address", _array_address_kernel, "spills read through host copies")
    return _run_address_kernel(kernel, arrays) if kernel is not None else None


def _array_address_kernel():
    kernel = mx.fast.cuda_kernel(
        name="promptstore_array_address",
        input_names=["a"],
        output_names=["address"],
        source="if (blockIdx.x == 0 && threadIdx.x == 0) { address[0] = (uint64_t)a; }",
    )
    _run_address_kernel(kernel, [mx.zeros((1,), mx.uint8)])  # built now, not in a spill
    return kernel


def _run_address_kernel(kernel, arrays: list[mx.array]) -> list[int]:
    """Every array is handed as flat bytes (a view: the same memory), so that one
    build serves them all: MLX builds a kernel again for each input dtype, and a
    build beside a request stalls it (1.3 s on an H200)."""
    one = dict(output_shapes=[(1,)], output_dtypes=[mx.uint64], grid=(1, 1, 1), threadgroup=(1, 1, 1))
    outs = [kernel(inputs=[a.reshape(-1).view(mx.uint8)], **one)[0] if a.nbytes else None for a in arrays]
    mx.eval([o for o in outs if o is not None])
    return [int(o.item()) if o is not None else 0 for o in outs]


def prepare_staging() -> None:
    """Build the address kernel now (CUDA; about a second the first time, which
    a spill beside a request should not spend)."""
    if runtime() is not None:
        device_addresses([])


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
