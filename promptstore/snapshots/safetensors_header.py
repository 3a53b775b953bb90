"""A strict reader of safetensors headers, run before MLX touches a file.

A crafted header (huge, overlapping or out-of-file offsets, unknown dtypes,
sizes that disagree with shapes) is refused here with a ValueError, so MLX
only ever loads files whose layout is consistent.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct

MAX_HEADER = 16 << 20
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
}


def read_header(path: str | os.PathLike) -> tuple[dict, dict]:
    """(tensors by name: {dtype, shape, data_offsets}, string metadata)."""
    fd = open_regular(path)
    try:
        header, metadata, _ = header_of_fd(fd)
        return header, metadata
    finally:
        os.close(fd)


def open_regular(path: str | os.PathLike) -> int:
    """A descriptor of `path` opened for reading, if it is a regular file (not
    through a symlink); else ValueError. O_NONBLOCK: a FIFO or device put in
    place of a file must not hang the reader."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def header_of_fd(fd: int) -> tuple[dict, dict, int]:
    """read_header of an open file, with the offset its tensor data starts at."""
    size = os.fstat(fd).st_size
    length = header_length(os.pread(fd, 8, 0), size)
    raw = os.pread(fd, length, 8)
    if len(raw) != length:
        raise ValueError("file ends inside its header")
    header, metadata = parse_header(raw, size - 8 - length)
    return header, metadata, 8 + length


def header_of_bytes(data: memoryview) -> tuple[dict, dict, int]:
    """read_header of a file's bytes held in memory, with the offset its tensor
    data starts at."""
    length = header_length(data[:8], data.nbytes)
    header, metadata = parse_header(bytes(data[8 : 8 + length]), data.nbytes - 8 - length)
    return header, metadata, 8 + length


def header_length(head: bytes | memoryview, size: int) -> int:
    """The header's length, from a file's first 8 bytes and its size."""
    if len(head) != 8:
        raise ValueError("file shorter than a safetensors header")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER or 8 + length > size:
        raise ValueError(f"header length {length} does not fit a file of {size} bytes")
    return length


def parse_header(raw: bytes, data_size: int) -> tuple[dict, dict]:
    """The header's JSON, checked against the `data_size` bytes of tensor data after it."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError("header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("metadata must map strings to strings")
    _check_layout(header, data_size)
    return header, metadata


def _check_layout(tensors: dict, data_size: int) -> None:
    spans = []
    for name, info in tensors.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {name!r}: malformed entry")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in ITEMSIZE:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"tensor {name!r}: bad offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise ValueError(f"tensor {name!r}: offsets {offsets} outside the data")
        if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {shape} {dtype}")
        spans.append((begin, end))
    spans.sort()
    cursor = 0
    for begin, end in spans:
        if begin != cursor:
            raise ValueError("tensor data overlaps or leaves gaps")
        cursor = end
    if cursor != data_size:
        raise ValueError(f"tensor data covers {cursor} of {data_size} bytes")
