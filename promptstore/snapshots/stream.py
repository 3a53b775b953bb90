"""Streaming cold files into MLX, every byte checksummed as it arrives.

MLX's loader takes a file object and reads each array into the buffer it has
just allocated (`readinto`). A Feed is such a file object, made up on the
fly: its arrays are whatever the caller wants (a file's arrays as stored, or
a restored cache's buffers assembled from several files and memory), and it
fills each with `os.preadv` in chunks small enough to be hashed while they
are still in the CPU's cache: one pass over the bytes, no second hashing
pass, no copy of a stored array before it reaches the cache.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import xxhash

from ..errors import ColdFileError

CHUNK = 1 << 20  # read, then hashed while still in the CPU's cache

SAFETENSORS_DTYPE = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.float32: "F32",
    mx.uint64: "U64",
    mx.int64: "I64",
}
MX_DTYPE = {v: k for k, v in SAFETENSORS_DTYPE.items()}
# Same-size integer types: raw bytes of any dtype, and a second one to view through.
_INTS = {1: (mx.uint8, mx.int8), 2: (mx.uint16, mx.int16), 4: (mx.uint32, mx.int32), 8: (mx.uint64, mx.int64)}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def unified_memory() -> bool:
    """Whether the host may write MLX buffers in place (CPU, Apple silicon): not CUDA,
    where arrays live in device memory and reach the host only by copy."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def raw_bytes(arrays: list[mx.array]) -> list[memoryview]:
    """Each array's bytes, row-major, as a flat byte view (no copy where it is contiguous)."""
    ints = [a.view(_INTS[a.itemsize][0]) for a in arrays]
    mx.eval(ints)  # once for all: each evaluation has a cost of its own
    views = [memoryview(a) for a in ints]
    strided = [i for i, v in enumerate(views) if not v.c_contiguous]
    if strided:
        # Strided arrays (MLX may hand one over for a copy of a slice): the same
        # bytes, laid out row-major first.
        flat = [mx.contiguous(ints[i]) for i in strided]
        mx.eval(flat)
        for i, a in zip(strided, flat):
            views[i] = memoryview(a)
    return [v.cast("B") for v in views]


class SourceFile:
    """An open cold file, shared by the arrays read from it; closed when the last goes."""

    def __init__(self, f, rel: str):
        self.f, self.rel, self.fd = f, rel, f.fileno()

    def close(self) -> None:
        self.f.close()

    def __del__(self) -> None:
        self.f.close()


@dataclass(frozen=True)
class Source:
    """One stored array: where its bytes are, and the xxh3-128 they must have."""

    file: SourceFile
    name: str
    offset: int
    nbytes: int
    digest: str


def _io_pool() -> ThreadPoolExecutor:
    """Threads that only read (they never wait on other tasks), so any thread may wait on them."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(IO_THREADS, thread_name_prefix="promptstore-io"))
        return _pool[1]


IO_THREADS = min(8, os.cpu_count() or 1)
PARALLEL_CHUNKS = 8  # a source this many chunks long is read on the reading threads
_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


class Pass:
    """One read of a Source from its first byte to its last, hashed in order as it
    arrives: chunks are read side by side on the reading threads, each hashed
    here once it is in, while it is still in the CPU's cache."""

    def __init__(self, source: Source):
        self.source, self.done, self.hasher = source, 0, xxhash.xxh3_128()

    def take(self, spans: list[tuple[int, memoryview | None]]) -> None:
        """The next bytes of the source, span by span: (n, into) reads n bytes
        into `into` (n long) or, when it is None, reads and drops them."""
        batches = list(_batches(spans))
        side_by_side = len(batches) >= PARALLEL_CHUNKS and IO_THREADS > 1
        reads, at = [], self.source.offset + self.done
        for views, size in batches:
            reads.append(_io_pool().submit(self._read, views, size, at) if side_by_side else None)
            at += size
        at = self.source.offset + self.done
        for (views, size), read in zip(batches, reads):
            if read is None:
                self._read(views, size, at)
            else:
                read.result()
            for v in views:
                self.hasher.update(v)
            at += size
        self.done += sum(size for _, size in batches)

    def _read(self, views: list[memoryview], size: int, at: int) -> None:
        src, got = self.source, 0
        while got < size:
            n = os.preadv(src.file.fd, _after(views, got), at + got)
            if n <= 0:
                raise ColdFileError(f"{src.file.rel}: ends inside array {src.name!r}", "unreadable", src.file.rel)
            got += n

    def check(self) -> None:
        src = self.source
        if self.done != src.nbytes:
            raise ColdFileError(f"{src.file.rel}: array {src.name!r} read in part", "unreadable", src.file.rel)
        if self.hasher.hexdigest() != src.digest:
            raise ColdFileError(f"{src.file.rel}: array {src.name!r} fails its checksum", "checksum", src.file.rel)


def _batches(spans: list[tuple[int, memoryview | None]]):
    """(views, bytes) of about CHUNK bytes each, in order; spans to drop get scratch memory of their own."""
    views, size = [], 0
    for n, into in spans:
        at = 0
        while at < n:
            k = min(n - at, CHUNK - size)
            views.append(into[at : at + k] if into is not None else memoryview(bytearray(k)))
            at, size = at + k, size + k
            if size == CHUNK:
                yield views, size
                views, size = [], 0
    if views:
        yield views, size


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """`views` without their first `skip` bytes (after a short read)."""
    out = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:])
        skip = 0
    return out


def read_whole(source: Source, into: memoryview) -> None:
    """Every byte of `source` into `into`, verified."""
    p = Pass(source)
    p.take([(source.nbytes, into)])
    p.check()


@dataclass(frozen=True)
class Tensor:
    """One array of a Feed: what MLX allocates, and what fills it (given its bytes)."""

    name: str
    dtype: mx.Dtype
    shape: tuple[int, ...]
    fill: Callable[[memoryview], None]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size


# MLX's reader of a file object lets go of it on MLX's own reading thread, taking
# the GIL; doing that while the interpreter exits aborts the process. So an exit
# first waits (briefly) until MLX has let go of every Feed.
_held_by_mlx = [0]
_held_lock = threading.Lock()


def _let_go() -> None:
    with _held_lock:
        _held_by_mlx[0] -= 1


@atexit.register
def _settle() -> None:
    deadline = time.monotonic() + 2.0
    while _held_by_mlx[0] > 0 and time.monotonic() < deadline:
        time.sleep(0.001)


class Feed:
    """A safetensors file object for `mx.load` whose arrays are filled by callbacks."""

    closed = False

    def __init__(self, tensors: list[Tensor]):
        with _held_lock:
            _held_by_mlx[0] += 1
        weakref.finalize(self, _let_go).atexit = False  # counted down by MLX letting go, not by the exit
        table, offset, self._at = {}, 0, {}
        for t in tensors:
            table[t.name] = {
                "dtype": SAFETENSORS_DTYPE[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            if t.nbytes:
                self._at[offset] = t
            offset += t.nbytes
        text = json.dumps(table, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._head = struct.pack("<Q", len(text)) + text
        self.size, self.pos = len(self._head) + offset, 0
        self.error: BaseException | None = None

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset + (0, self.pos, self.size)[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, view) -> int:
        n = len(view)
        try:
            if self.pos < len(self._head):
                n = min(n, len(self._head) - self.pos)
                view[:n] = self._head[self.pos : self.pos + n]
            elif n:
                tensor = self._at.get(self.pos - len(self._head))
                if tensor is None or tensor.nbytes != n:
                    raise ColdFileError(
                        f"MLX asked for {n} bytes at {self.pos}, which no array starts at", "unreadable"
                    )
                tensor.fill(memoryview(view).cast("B"))
        except BaseException as e:  # MLX sees a short read and raises; load() re-raises this
            self.error = self.error or e
            return 0
        self.pos += n
        return n

    def load(self) -> dict[str, mx.array]:
        """Every array, allocated by MLX and filled (and verified) by its callback."""
        try:
            arrays = mx.load(self, format="safetensors")
        except RuntimeError as e:
            if self.error is not None:
                raise self.error from None
            raise ColdFileError(f"MLX could not load: {e}", "unreadable") from None
        if self.error is not None:
            raise self.error
        return {name: _detached(a) for name, a in arrays.items()}


def _detached(a: mx.array) -> mx.array:
    """The same buffer under an array that no longer holds MLX's reader of the Feed
    (one still alive when the interpreter exits aborts it)."""
    other = next(t for t in _INTS[a.itemsize] if t != a.dtype)
    out = a.view(other).view(a.dtype)
    mx.eval(out)
    return out


class StoredArray:
    """A token array (`[B, H, positions, D]`) of a cold file, not read yet.

    A restore slices it along the positions and joins it with its other pieces
    (caches.join): its rows then go from the file straight into the restored
    cache's new buffer, the whole stored array checksummed on the way, before
    the buffer is handed over.
    """

    def __init__(self, source: Source, dtype: mx.Dtype, shape: tuple[int, ...], rows: tuple[int, int] | None = None):
        self.source, self.dtype, self.stored_shape = source, dtype, tuple(shape)
        self.rows = rows if rows is not None else (0, shape[2])

    @property
    def shape(self) -> tuple[int, ...]:
        b, h, _, d = self.stored_shape
        return (b, h, self.rows[1] - self.rows[0], d)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.size

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.size

    def __getitem__(self, key) -> StoredArray:
        rows = key[1] if isinstance(key, tuple) and len(key) == 3 and key[0] is Ellipsis else None
        if not isinstance(rows, slice) or key[2] != slice(None) or rows.step not in (None, 1):
            raise TypeError(f"a stored array slices only as [..., lo:hi, :], not {key!r}")
        lo, hi, _ = rows.indices(self.shape[2])
        base = self.rows[0]
        return StoredArray(self.source, self.dtype, self.stored_shape, (base + lo, base + max(lo, hi)))

    def join(self, pieces: list, axis: int) -> mx.array:
        return assemble(pieces, axis)

    def __repr__(self) -> str:
        return f"StoredArray({self.source.file.rel}:{self.source.name} rows {self.rows} of {self.stored_shape})"


def assemble(pieces: list, axis: int) -> mx.array:
    """`pieces` (mx arrays and StoredArrays, `[B, H, positions, D]`) joined on the
    positions: with unified memory into one new buffer, each stored row read
    straight into its place; on a device with memory of its own, each run of
    stored pieces is loaded as one array and the runs joined on the device."""
    if axis != 2 or any(p.ndim != 4 for p in pieces):
        raise ValueError("stored pieces join along axis 2 of [B, H, positions, D] arrays")
    ready = [p for p in pieces if isinstance(p, mx.array)]
    mx.eval(ready)  # before the load: MLX calls back into fills mid-load
    if unified_memory():
        return _load_joined(pieces, [_row_view(p) if isinstance(p, mx.array) else p for p in pieces])
    parts, run = [], []
    for p in [*pieces, None]:
        if isinstance(p, StoredArray):
            run.append(p)
            continue
        if run:
            parts.append(_load_joined(run, run))
            run = []
        if p is not None:
            parts.append(p)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _row_view(a: mx.array) -> np.ndarray:
    """An evaluated array as (B * H, positions, row bytes), a view where the layout allows."""
    b, h, n, d = a.shape
    rows = np.asarray(memoryview(a.view(_INTS[a.itemsize][0])))
    return rows.view(np.uint8).reshape(b * h, n, d * a.itemsize)


def _load_joined(pieces: list, sources: list) -> mx.array:
    """One array of `pieces`' total positions, filled in order from `sources`
    (a StoredArray, or rows in memory as _row_view gives them)."""
    b, h, _, d = pieces[0].shape
    dtype = pieces[0].dtype
    total = sum(p.shape[2] for p in pieces)

    def fill(view: memoryview) -> None:
        dest = np.frombuffer(view, dtype=np.uint8).reshape(b * h, total, d * dtype.size)
        at = 0
        for piece, src in zip(pieces, sources):
            n = piece.shape[2]
            if isinstance(src, StoredArray):
                _read_rows(src, dest[:, at : at + n])
            else:
                dest[:, at : at + n] = src
            at += n

    (out,) = Feed([Tensor("joined", dtype, (b, h, total, d), fill)]).load().values()
    return out


def _read_rows(piece: StoredArray, dest: np.ndarray) -> None:
    """Rows `piece.rows` of every (batch, head) into `dest` (B * H, rows, row bytes);
    the rows around them are read too, so the whole stored array is checksummed."""
    lo, hi = piece.rows
    _, _, length, d = piece.stored_shape
    row = d * piece.dtype.size
    p = Pass(piece.source)
    spans = []
    for i in range(dest.shape[0]):
        placed = memoryview(dest[i]).cast("B") if hi > lo else None
        spans += [(lo * row, None), ((hi - lo) * row, placed), ((length - hi) * row, None)]
    p.take([(n, v) for n, v in spans if n])
    p.check()
