"""Writing a node's file in the safetensors format, with the disk kept busy.

mx.save_safetensors writes the whole file into the page cache, so the fsync
after it starts the disk only once the last byte is in memory: writing and
flushing take turns. Here writeback of each stretch written starts at once
(Linux's sync_file_range, as RocksDB's bytes_per_sync does), so the disk
works while the rest is copied and the final fsync waits for the tail only.

The arrays may go in before the header (`final_metadata`): the cold tier
hashes them on its hashing threads while they are written, and the header,
which holds their checksums, is written last into the room left for it (a
checksum's length is known before its value). The file is byte for byte the
one written in order, and it is renamed into place only once whole.

And no more than IN_FLIGHT stretches are queued at the disk at a time: the
writer waits for the oldest before it hands over another (RocksDB's
strict_bytes_per_sync), since copying into the page cache outruns any disk
and a spill of gigabytes would otherwise queue all of them at once, ahead of
every other write and fsync of the machine. On an H200 host's disk this made
no measurable difference to an index commit beside a 2.5 GB spill, nor to the
spill's speed (tools/bench/probe_writeback.py, in git history at commit
cf0ce12); it bounds the queue where a disk is slower.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import mlx.core as mx

from . import pacing

DTYPE_NAMES = {
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
WRITE_CHUNK = 32 << 20  # one write() call
WRITEBACK_BYTES = 32 << 20  # a stretch handed to the disk as soon as it is written
IN_FLIGHT = 2  # stretches under writeback at once: the writer waits for older ones
SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4
WAIT_FOR_RANGE = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: the final fsync does all the flushing
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _load_sync_file_range()


def encode_header(tensors: Sequence[tuple[str, mx.Dtype, tuple, int]], metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header of tensors (name, dtype, shape, bytes) laid
    out in the given order, padded with spaces to 8 bytes as safetensors asks."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}  # as MLX orders it
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"array {name!r}: dtype {dtype} has no safetensors name")
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


Bytes = memoryview | Callable[[], Iterable[memoryview]]


def write_safetensors(
    fd: int,
    named: Sequence[tuple[str, mx.array, Bytes]],
    metadata: dict[str, str],
    *,
    durable: bool,
    final_metadata: Callable[[], dict[str, str]] | None = None,
) -> int:
    """Write arrays (name, array, its row-major bytes as the host reads them, or
    a function giving them in chunks) and metadata to the open file `fd`, from
    its start; returns the bytes written.
    durable: writeback starts as each stretch is written, at most IN_FLIGHT
    stretches at a time (the caller fsyncs).
    final_metadata: the metadata to write, asked for once the arrays are
    written (checksums computed meanwhile); `metadata` then holds values of
    the same lengths, and the header goes in last, in the room left for it.
    A final header of another length raises ValueError."""
    tensors = [(n, a.dtype, a.shape, a.nbytes) for n, a, _ in named]
    head = encode_header(tensors, metadata)
    last = final_metadata is not None  # the header goes in after the arrays
    written = flushed = len(head) if last else 0
    os.lseek(fd, written, os.SEEK_SET)
    started: deque[tuple[int, int]] = deque()  # stretches handed to the disk, oldest first
    for data in [*([] if last else [memoryview(head)]), *(v for _, _, v in named)]:
        for chunk in _chunks(data):
            pacing.wait()  # requests waiting for their first tokens go first
            written += _write_all(fd, chunk)
            if durable and _sync_file_range is not None and written - flushed >= WRITEBACK_BYTES:
                # Advisory, both: the caller's fsync checks every byte.
                _sync_file_range(fd, flushed, written - flushed, SYNC_FILE_RANGE_WRITE)
                started.append((flushed, written - flushed))
                flushed = written
                while len(started) > IN_FLIGHT:
                    _sync_file_range(fd, *started.popleft(), WAIT_FOR_RANGE)
    expected = len(head) + sum(a.nbytes for _, a, _ in named)
    if written != expected:  # a source that gave fewer or more bytes than its array holds
        raise OSError(errno.EIO, f"wrote {written} bytes where the header describes {expected}")
    if last:
        final = encode_header(tensors, final_metadata())
        if len(final) != len(head):
            raise ValueError(f"the final header takes {len(final)} bytes where {len(head)} were left for it")
        _pwrite_all(fd, memoryview(final), 0)
    return written


def _chunks(data: Bytes) -> Iterator[memoryview]:
    if callable(data):
        yield from data()
        return
    data = data.cast("B") if data.nbytes else data
    for lo in range(0, data.nbytes, WRITE_CHUNK):
        yield data[lo : lo + WRITE_CHUNK]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n


def _write_all(fd: int, data: memoryview) -> int:
    done = 0
    while done < data.nbytes:
        n = os.write(fd, data[done:])
        if n <= 0:  # a regular file takes at least a byte or raises; never spin
            raise OSError(errno.EIO, "write made no progress")
        done += n
    return done
