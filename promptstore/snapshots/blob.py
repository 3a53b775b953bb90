"""A node file's bytes held in memory (a blob the remote tier fetched): checked
as `ColdTier.load` checks a file (header, the node's identity, the record, every
array's xxh3-128 over its bytes) before any array is made from them."""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import numpy as np

from ..caches import Snapshot
from ..errors import ColdFileError
from ..identity import NodeId
from . import device, reader
from .cold import checked_identity, checked_record, checked_snapshots, parallel_reads, span_checksums
from .safetensors_header import header_of_bytes

log = logging.getLogger("promptstore.snapshots")

NUMPY_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "F16": np.float16,
    "BF16": np.uint16,  # numpy has no bfloat16: the bits, viewed as such in MLX
    "U32": np.uint32,
    "I32": np.int32,
    "F32": np.float32,
    "U64": np.uint64,
    "I64": np.int64,
}


def load_bytes(data: memoryview, node: NodeId, rel: str) -> list[Snapshot]:
    """The verified snapshots of a node file's bytes held in memory, checked as
    `ColdTier.load` checks a file (header, the node's identity, the record, every
    array's xxh3-128 over its bytes) before any array is made from them; else
    ColdFileError. rel: what errors call the bytes."""
    try:
        header, metadata, base = header_of_bytes(data)
    except (ValueError, RecursionError) as e:
        raise ColdFileError(f"{rel}: bad header: {e}", "header", rel) from None
    meta = checked_identity(metadata, rel, node)
    record = checked_record(rel, meta, header, metadata)
    placed = _placed_bytes(data, header, base, rel) if parallel_reads() else None
    if placed is not None:
        arrays, sums = placed
    else:
        spans = {
            name: (base + info["data_offsets"][0], base + info["data_offsets"][1]) for name, info in header.items()
        }
        sums = span_checksums(data, spans)
    for name in header:
        if sums[name] != meta.checksums[name]:
            raise ColdFileError(f"{rel}: array {name!r} fails its checksum", "checksum", rel)
    if placed is None:
        arrays = {name: _array_of(data, spans[name][0], info) for name, info in header.items()}
        mx.eval(list(arrays.values()))
        device.prefetch(arrays.values())
    return checked_snapshots(rel, arrays, record, (node.start, node.end))


def _placed_bytes(data: memoryview, header: dict, base: int, rel: str) -> tuple[dict, dict] | None:
    """The arrays of a node file's bytes in memory, placed by the reading threads
    (on CUDA: through pinned buffers to the device, at the bus's speed, where
    `mx.array` of the host bytes goes through managed memory at about 2.5 GB/s),
    and their digests, taken as the bytes went by; None where the device or MLX
    failed (the caller copies them itself), ColdFileError where the bytes end
    before an array does."""
    try:
        return reader.BytesRead(data, header, base).result()
    except OSError as e:  # ShortRead: the bytes, not the device
        raise ColdFileError(f"{rel}: unreadable: {e}", "unreadable", rel) from None
    except Exception as e:  # the device or MLX, not the bytes
        log.warning("%s: promptstore's reader failed (%s); the bytes are copied into MLX", rel, e)
        return None


def _array_of(data: memoryview, offset: int, info: dict) -> mx.array:
    """One tensor of checked bytes, copied into an MLX array."""
    shape, dtype = info["shape"], info["dtype"]
    flat = np.frombuffer(data, NUMPY_DTYPES[dtype], math.prod(shape), offset) if math.prod(shape) else None
    host = flat.reshape(shape) if flat is not None else np.zeros(shape, NUMPY_DTYPES[dtype])
    array = mx.array(host)
    return array.view(mx.bfloat16) if dtype == "BF16" else array
