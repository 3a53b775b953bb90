"""Reading a node file's arrays on promptstore's reading threads (CUDA).

MLX only allocates the arrays: one block per GiB of a file, each array a view
of its own aligned span. Each array's bytes are read with `pread` in chunks of
a few MB on up to 16 threads, many arrays and files at once, hashed (xxh3-128,
streaming) while the chunk is in the CPU's cache, and put where the model
reads them. Small arrays that lie back to back in the file (a node of a few
tokens holds tens of arrays of tens of KB) are read as one run, a chunk at
most, in one task:

- on CUDA, into one of the thread's two pinned staging buffers, then copied
  to the block in device memory asynchronously while the next chunk is read
  (`StagedCopies`); a read goes at the speed of the page cache or the disk
  and of the bus, not of one loader thread and a migration of managed pages;
- where the host writes the array's memory itself (CPU, Apple silicon), the
  chunk is read straight into it (`HostWrites`). There MLX's own loader is as
  fast (filling fresh memory costs what reading into it does, and MLX makes no
  array without filling it), so the cold tier uses MLX's loader on those
  backends and this placement serves the tests of the reader's logic.

The same threads place a node file's bytes already in memory (a remote hit's
blob, `BytesRead`): each chunk copied from there instead of read from a file,
hashed and placed alike; on CUDA that replaces a copy into MLX's managed
memory at a fraction of the bus's speed.

Nothing in Python runs inside MLX's loader, and nothing here uses a byte: the
caller compares the digests before any array leaves the cold tier.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future

import mlx.core as mx
import numpy as np
import xxhash

from . import device
from .pool import ProcessPool
from .safetensors_writer import DTYPE_NAMES

log = logging.getLogger("promptstore.snapshots")

CHUNK = 4 << 20  # bytes read, hashed and copied at a time
THREADS = max(2, min(16, os.cpu_count() or 1))
BLOCK_BYTES = 1 << 30  # arrays allocated as one block (a dimension of MLX holds under 2 GiB)

MLX_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # safetensors dtype -> MLX


class ShortRead(OSError):
    """The file ended before an array's last byte (it shrank after its header was read)."""


_read_pool = ProcessPool(THREADS, "promptstore-read")  # the reading threads


# fill(view, offset): the source's bytes [offset, offset + len(view)) into view,
# or ShortRead where the source ends first.
Fill = Callable[[memoryview, int], None]


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ShortRead(f"the file ends {len(view) - done} bytes before an array does")
        done += got


def _copy_from(data: memoryview, view: memoryview, offset: int) -> None:
    if offset + len(view) > len(data):
        raise ShortRead(f"the bytes end {offset + len(view) - len(data)} bytes before an array does")
    # numpy's copy lets go of the interpreter (a memoryview's does not): the threads copy side by side
    np.copyto(np.frombuffer(view, np.uint8), np.frombuffer(data, np.uint8, len(view), offset))


ALIGN = 256  # where each array starts in its block
ENDS = 16  # bytes at each end of an array read back from where it landed


class Ends:
    """The first and last ENDS bytes of an array, kept as its chunks go by (the
    two overlap in an array shorter than 2 x ENDS bytes)."""

    def __init__(self):
        self.head = self.last = b""

    def add(self, chunk: memoryview) -> None:
        if len(self.head) < ENDS:
            self.head += bytes(chunk[: ENDS - len(self.head)])
        self.last = (self.last + bytes(chunk[max(0, len(chunk) - ENDS) :]))[-ENDS:]

    def value(self) -> bytes:
        return self.head + self.last


class _Placement:
    """Where a file's arrays land: blocks MLX allocates (one per BLOCK_BYTES of
    arrays, all made in one batch before any read starts, so the reads never
    compete with the allocation for the interpreter), each array a view of its
    own aligned span of a block."""

    def allocate(self, specs: list[tuple[list[int], mx.Dtype]]) -> list[tuple[mx.array, object]]:
        """Each array of `specs` (a view of its span of a block) and what its reads
        write through; `self.placed` keeps the blocks and each array's (block,
        offset, nbytes), for the read-back of where the bytes landed (so a
        placement serves one file: `destination()` makes one for each)."""
        spans, sizes = [], [0]  # (block, offset, nbytes) of each array; each block's size
        for shape, dtype in specs:
            nbytes = math.prod(shape) * dtype.size
            padded = -(-nbytes // ALIGN) * ALIGN
            if sizes[-1] and sizes[-1] + padded > BLOCK_BYTES:
                sizes.append(0)
            spans.append((len(sizes) - 1, sizes[-1], nbytes))
            sizes[-1] += padded
        made = self._blocks([n for n in sizes if n])  # an empty file makes none
        arrays = [
            made[i][0][o : o + n].view(dtype).reshape(shape) if n else mx.zeros(shape, dtype)
            for (i, o, n), (shape, dtype) in zip(spans, specs)
        ]
        mx.eval(arrays)
        self.placed = ([block for block, _ in made], spans)
        return [(a, self._target(made[i][1], o, n) if n else None) for a, (i, o, n) in zip(arrays, spans)]

    def read_run(self, fill: Fill, offset: int, items: list[tuple[int, int, object]]) -> list[tuple[str, bytes]]:
        """Arrays that lie back to back in the source, read in one task: `items` are
        each one's (offset from `offset`, nbytes, where it goes); each one's digest
        and ends, in order."""
        return [self.read(fill, offset + at, nbytes, where) for at, nbytes, where in items]

    def _blocks(self, sizes: list[int]) -> list[tuple[mx.array, object]]:
        """Blocks of these sizes, each with what the reads write through (a view, an address)."""
        raise NotImplementedError

    def _target(self, base, offset: int, nbytes: int):
        raise NotImplementedError


class HostWrites(_Placement):
    """Arrays whose memory the host writes in place (CPU, Apple silicon): each
    chunk is read straight into it."""

    def _blocks(self, sizes: list[int]) -> list[tuple[mx.array, memoryview]]:
        blocks = [mx.zeros((n,), mx.uint8, stream=mx.cpu) for n in sizes]
        mx.eval(blocks)
        return [(b, memoryview(b).cast("B")) for b in blocks]

    def _target(self, base: memoryview, offset: int, nbytes: int) -> memoryview:
        return base[offset : offset + nbytes]

    def read(self, fill: Fill, offset: int, nbytes: int, view: memoryview) -> tuple[str, bytes]:
        digest, ends = xxhash.xxh3_128(), Ends()
        for start in range(0, nbytes, CHUNK):
            chunk = view[start : min(start + CHUNK, nbytes)]
            fill(chunk, offset + start)
            digest.update(chunk)
            ends.add(chunk)
        return digest.hexdigest(), ends.value()


class _Staging(threading.local):
    """Each reading thread's two pinned buffers (made at its first staged read,
    kept for the process's life), with the size they were made at."""

    buffers: list | None = None
    size = 0


_staging = _Staging()


class StagedCopies(_Placement):
    """CUDA: each block in device memory, filled from each reading thread's two
    pinned buffers by asynchronous copies while the next chunk is read.

    A block is the output of a one-thread kernel that writes the block's device
    address beside it: MLX allocates it (without filling it) and never moves
    it, so the copies land where the model reads. Where that kernel cannot be
    built, a block is made by MLX and moved into managed memory, whose pages
    stay on the device (the host can name their addresses), at the cost of
    that move."""

    def __init__(self, runtime):
        self.runtime = runtime

    def _blocks(self, sizes: list[int]) -> list[tuple[mx.array, int]]:
        kernel = _address_kernel()
        if kernel is not None:
            made = [
                kernel(
                    inputs=[mx.array(0, mx.uint8)],
                    output_shapes=[(n,), (1,)],
                    output_dtypes=[mx.uint8, mx.uint64],
                    grid=(1, 1, 1),
                    threadgroup=(1, 1, 1),
                )
                for n in sizes
            ]
            mx.eval(made)
            return [(block, int(address.item())) for block, address in made]
        blocks = [mx.zeros((n,), mx.uint8) for n in sizes]
        mx.eval(blocks)
        device.host_address_space(blocks)
        return [(b, device.address(b)) for b in blocks]

    def _target(self, base: int, offset: int, nbytes: int) -> int:
        return base + offset

    def _buffers(self) -> tuple[list, int]:
        if _staging.buffers is None:
            rt = self.runtime
            _staging.size = CHUNK
            _staging.buffers = [[*rt.pinned(CHUNK), rt.event(), False] for _ in range(2)]
        return _staging.buffers, _staging.size

    def read(self, fill: Fill, offset: int, nbytes: int, address: int) -> tuple[str, bytes]:
        rt = self.runtime
        buffers, chunk = self._buffers()
        digest, ends = xxhash.xxh3_128(), Ends()
        try:
            for i, start in enumerate(range(0, nbytes, chunk)):
                buffer = buffers[i % 2]
                ptr, view, done, busy = buffer
                if busy:
                    rt.wait(done)  # its previous chunk is on the device
                    buffer[3] = False
                m = min(chunk, nbytes - start)
                fill(view[:m], offset + start)
                digest.update(view[:m])
                ends.add(view[:m])
                rt.copy_async(address + start, ptr, m, done)
                buffer[3] = True
        finally:
            rt.sync()  # nothing of this array is in flight once it returns (or raises)
            for buffer in buffers:
                buffer[3] = False
        return digest.hexdigest(), ends.value()

    def read_run(self, fill: Fill, offset: int, items: list[tuple[int, int, int]]) -> list[tuple[str, bytes]]:
        """The run read into one staging buffer at once, each array hashed and
        copied on from its part of it: one read, one wait for the device, where
        array by array a node of a few tokens (tens of arrays of tens of KB) cost
        a task, a read and a wait each."""
        buffers, size = self._buffers()
        span = items[-1][0] + items[-1][1]
        if span > size:  # buffers made at a smaller CHUNK
            return super().read_run(fill, offset, items)
        rt, buffer = self.runtime, buffers[0]
        ptr, view, done, busy = buffer
        out = []
        try:
            if busy:
                rt.wait(done)
                buffer[3] = False
            fill(view[:span], offset)
            for at, nbytes, address in items:
                part, ends = view[at : at + nbytes], Ends()
                ends.add(part)
                out.append((xxhash.xxh3_128_hexdigest(part), ends.value()))
                rt.copy_async(address, ptr + at, nbytes, done)
        finally:
            rt.sync()  # nothing of the run is in flight once it returns (or raises)
            buffer[3] = False
        return out


def _address_kernel():
    """The block-and-address kernel (built once; None where it cannot be, logged)."""
    return device.kernel_once("promptstore_block_address", _block_address_kernel, "blocks are made in managed memory")


def _block_address_kernel():
    kernel = mx.fast.cuda_kernel(
        name="promptstore_block_address",
        input_names=["unused"],
        output_names=["block", "address"],
        source="if (blockIdx.x == 0 && threadIdx.x == 0) { address[0] = (uint64_t)block; }",
    )
    block, address = kernel(
        inputs=[mx.array(0, mx.uint8)],
        output_shapes=[(256,), (1,)],
        output_dtypes=[mx.uint8, mx.uint64],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
    )
    mx.eval(block, address)
    if not address.item():
        raise RuntimeError("the kernel wrote no address")
    return kernel


def prepare() -> None:
    """CUDA: build what a read runs before the first read, which a request may
    wait for: the block-and-address kernel (built in every process) and the
    gather that checks a read's ends (compiled once per machine, then loaded
    from MLX's disk cache). Built at a process's first read, they cost that
    read 1.4-2.3 s on an H100, 4.0 s where the gather had never been compiled
    (tools/bench/probe_first_read.py, in git history at commit 42029d8). Elsewhere
    nothing is built."""
    if device.runtime() is None:
        return
    _address_kernel()
    probe = mx.zeros((2 * ENDS,), mx.uint8)
    blocks_match([probe], [(0, 0, 2 * ENDS)], [bytes(2 * ENDS)])


def destination():
    """How this process places what it reads: staged copies on CUDA (when its
    runtime is reachable), else writes in place."""
    runtime = device.runtime()
    return StagedCopies(runtime) if runtime is not None else HostWrites()


class ArrayReads:
    """The placing of one node file's arrays from a source (`fill`), under way on
    the reading threads.

    `result()` gives the arrays and each one's xxh3-128 once every read is done
    (or raises the first error: OSError, ShortRead, device.CudaError;
    LandedElsewhere when the bytes read back from the arrays are not the
    source's). `done` is called once, when the last read ends, whoever waits
    for it.
    """

    def __init__(self, fill: Fill, tensors: dict, base: int, placing=None, done: Callable[[], None] | None = None):
        self.arrays: dict[str, mx.array] = {}
        self._reads: dict[str, tuple[Future, int | None]] = {}  # each array's read: alone, or its place in a run
        self._placing = placing = placing if placing is not None else destination()
        # The source stays usable while this constructor or any read may use it.
        self._fill, self._done, self._users, self._lock = fill, done, 1, threading.Lock()
        try:
            names = sorted(tensors, key=lambda n: tensors[n]["data_offsets"][0])
            specs = [(tensors[n]["shape"], MLX_DTYPES[tensors[n]["dtype"]]) for n in names]
            pool = _read_pool()
            run: list[tuple[str, int, int, object]] = []  # arrays back to back, CHUNK bytes at most together
            for name, (array, where) in zip(names, placing.allocate(specs)):
                self.arrays[name] = array
                begin, end = tensors[name]["data_offsets"]
                if end <= begin:
                    continue
                if run and (begin != run[-1][1] + run[-1][2] or end - run[0][1] > CHUNK):
                    self._submit_run(pool, run, base)
                    run = []
                if end - begin >= CHUNK:
                    self._submit(pool, [name], placing.read, self._fill, base + begin, end - begin, where)
                else:
                    run.append((name, begin, end - begin, where))
            self._submit_run(pool, run, base)
        finally:
            self._release()

    def _submit_run(self, pool, run: list[tuple[str, int, int, object]], base: int) -> None:
        """Arrays of a few KB each (a node of a few tokens) read as one task, not one each."""
        if len(run) == 1:
            name, begin, nbytes, where = run[0]
            self._submit(pool, [name], self._placing.read, self._fill, base + begin, nbytes, where)
        elif run:
            first = run[0][1]
            items = [(begin - first, nbytes, where) for _, begin, nbytes, where in run]
            self._submit(pool, [n for n, *_ in run], self._placing.read_run, self._fill, base + first, items)

    def _submit(self, pool, names: list[str], read, *args) -> None:
        with self._lock:
            self._users += 1
        try:
            future = pool.submit(read, *args)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: self._release())
        for i, name in enumerate(names):
            self._reads[name] = (future, i if len(names) > 1 else None)

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users:
                return
        if self._done is not None:
            self._done()

    def result(self) -> tuple[dict[str, mx.array], dict[str, str]]:
        digests, ends, error = {}, {}, None
        for name, (read, i) in self._reads.items():
            try:
                got = read.result()
                digests[name], ends[name] = got if i is None else got[i]
            except BaseException as e:  # every read is waited for before anything is raised
                error = error or e
        if error is not None:
            raise error
        _check_landed(self._placing, list(self.arrays), ends)
        empty = xxhash.xxh3_128_hexdigest(b"")
        return self.arrays, {name: digests.get(name, empty) for name in self.arrays}


class FileRead(ArrayReads):
    """The reading of one open file's arrays; the descriptor is closed when the
    last read ends."""

    def __init__(self, fd: int, tensors: dict, base: int, placing=None):
        super().__init__(functools.partial(_pread_into, fd), tensors, base, placing, done=lambda: os.close(fd))


class BytesRead(ArrayReads):
    """The placing of a node file's arrays from its bytes held in memory (which
    must stay as they are until `result()` returns)."""

    def __init__(self, data: memoryview, tensors: dict, base: int, placing=None):
        super().__init__(functools.partial(_copy_from, data), tensors, base, placing)


class LandedElsewhere(RuntimeError):
    """The bytes read back from where the arrays live are not the bytes read from
    the source (the checksums, taken as the bytes were read, cannot see that)."""


failed: str | None = None  # set once copies are found to land elsewhere: this process reads through MLX


def _check_landed(placing: _Placement, names: list[str], ends: dict[str, bytes]) -> None:
    """Read back the first and last ENDS bytes of every array in `ends` from the
    blocks MLX keeps them in (`names`: the arrays in the order allocate placed
    them) and compare them with what was read from the source."""
    global failed
    blocks, spans = placing.placed
    read = [(spans[i], ends[name]) for i, name in enumerate(names) if name in ends]
    if not blocks_match(blocks, [span for span, _ in read], [end for _, end in read]):
        failed = "bytes read back from the arrays differ from the file's"
        raise LandedElsewhere(failed)


def blocks_match(blocks: list[mx.array], spans: list[tuple[int, int, int]], ends: list[bytes]) -> bool:
    """Whether the first and last ENDS bytes of each (block, offset, nbytes) span
    are the bytes given, in order: one gather from each block (one kernel where
    slicing every array's two ends cost two slices and a join each), read by
    the host from a new array."""
    if not spans:
        return True
    positions: dict[int, list[np.ndarray]] = defaultdict(list)  # each block's byte positions to read back
    filled: dict[int, int] = defaultdict(int)
    order = []  # each span's (block, where its bytes start among that block's, how many)
    for block, offset, nbytes in spans:
        k = min(ENDS, nbytes)
        where = np.r_[offset : offset + k, offset + nbytes - k : offset + nbytes]
        order.append((block, filled[block], len(where)))
        filled[block] += len(where)
        positions[block].append(where)
    taken = {b: mx.take(blocks[b], mx.array(np.concatenate(p).astype(np.uint32))) for b, p in positions.items()}
    mx.eval(list(taken.values()))
    host = {b: bytes(memoryview(t)) for b, t in taken.items()}
    landed = b"".join(host[b][at : at + n] for b, at, n in order)
    return landed == b"".join(ends)


def ends_match(arrays: dict[str, mx.array], ends: dict[str, bytes]) -> bool:
    """Whether the first and last ENDS bytes of each array in `ends`, as MLX
    keeps it, are the bytes given (one small gather, read by the host from a
    new array: the arrays themselves stay where they are)."""
    probes = []
    for name in ends:
        flat = arrays[name].reshape(-1).view(mx.uint8)
        k = min(ENDS, flat.size)
        probes += [flat[:k], flat[flat.size - k :]]
    if not probes:
        return True
    landed = mx.concatenate(probes)
    mx.eval(landed)
    return bytes(memoryview(landed)) == b"".join(ends.values())
