"""promptstore's reading threads (snapshots/reader.py) on their own: the arrays
and digests of a file whatever its chunking and grouping, a file that ends
early, the descriptor closed once the reads end, and a device failure that
hands the file to MLX's loader instead of calling the file bad."""

from __future__ import annotations

import os
import time

import mlx.core as mx
import pytest
import xxhash

from promptstore.errors import ColdFileError
from promptstore.identity import NodeId
from promptstore.snapshots import cold, device, reader
from promptstore.snapshots.cold import ColdTier
from promptstore.snapshots.safetensors_header import header_of_fd, open_regular

from .test_cold import KEY, NS, _family_snapshots, put, same, span


def _arrays() -> dict[str, mx.array]:
    mx.random.seed(3)
    return {
        "bf16": mx.random.normal((3, 5, 7)).astype(mx.bfloat16),
        "f32": mx.random.normal((2, 1000)),
        "f16": mx.random.normal((33,)).astype(mx.float16),
        "u32": mx.random.randint(0, 2**31, (17, 3)).astype(mx.uint32),
        "i64": mx.arange(11, dtype=mx.int64),
        "bool": mx.array([True, False, True]),
        "empty": mx.zeros((0, 4)),
        "u8": mx.array(list(range(256)), dtype=mx.uint8),
    }


def _open_on(path) -> int:
    """This process's descriptors open on `path` (other tests' sockets and files,
    closed whenever the collector gets to them, are not counted)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:  # closed meanwhile
            pass
    return count


def _settled(path, seconds: float = 2.0) -> int:
    """The descriptors open on `path` once the reads' last callback ran (bounded wait)."""
    deadline = time.monotonic() + seconds
    while _open_on(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _open_on(path)


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "arrays.safetensors"
    arrays = _arrays()
    mx.save_safetensors(str(path), arrays)
    return path, arrays


@pytest.mark.parametrize("chunk", [7, 1000, 4 << 20])
@pytest.mark.parametrize("block", [1, 5000, 1 << 30])
@pytest.mark.parametrize("source", ["file", "bytes in memory"])
def test_every_array_and_digest_whatever_the_chunks_and_blocks(written, monkeypatch, chunk, block, source):
    """From an open file (FileRead) or from the file's bytes held in memory (BytesRead,
    a remote hit's blob)."""
    path, arrays = written
    monkeypatch.setattr(reader, "CHUNK", chunk)
    monkeypatch.setattr(reader, "BLOCK_BYTES", block)
    if source == "file":
        fd = open_regular(path)
        assert _open_on(path) == 1
        tensors, _, base = header_of_fd(fd)
        got, digests = reader.FileRead(fd, tensors, base, reader.HostWrites()).result()
    else:
        data, tensors, base = _raw(path)
        got, digests = reader.BytesRead(data, tensors, base, reader.HostWrites()).result()
    assert set(got) == set(arrays) == set(digests)
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        assert mx.array_equal(got[name], a).item(), name
        assert digests[name] == xxhash.xxh3_128_hexdigest(memoryview(mx.contiguous(a))), name
    assert _settled(path) == 0  # the file's descriptor is closed


def test_a_file_that_ends_early_raises_short_read_and_closes(written, monkeypatch):
    path, _ = written
    monkeypatch.setattr(reader, "CHUNK", 64)
    fd = open_regular(path)
    assert _open_on(path) == 1
    tensors, _, base = header_of_fd(fd)
    os.truncate(path, os.path.getsize(path) - 10)  # after the header was checked
    read = reader.FileRead(fd, tensors, base, reader.HostWrites())
    with pytest.raises(reader.ShortRead):
        read.result()
    assert _settled(path) == 0


class _DeviceFails(reader.HostWrites):
    """A placement whose copies the device refuses (as a CUDA runtime error would)."""

    def __init__(self, where: str):
        self.where = where

    def allocate(self, specs):
        if self.where == "allocate":
            raise device.CudaError("cudaHostAlloc failed (CUDA error 2)")
        return super().allocate(specs)

    def read(self, fd, offset, nbytes, view):
        if self.where == "read":
            raise device.CudaError("cudaMemcpyAsync failed (CUDA error 700)")
        return super().read(fd, offset, nbytes, view)


@pytest.mark.parametrize("where", ["allocate", "read"])
def test_a_device_failure_hands_the_file_to_mlx_s_loader(tmp_path, monkeypatch, caplog, where):
    """Not the file's fault: the same verified snapshots, nothing quarantined."""
    monkeypatch.setattr(cold, "PARALLEL_READS", True)
    monkeypatch.setattr(reader, "destination", lambda: _DeviceFails(where))
    tier = ColdTier(tmp_path / "cold")
    snaps = _family_snapshots("llama")
    ref = put(tier, snaps)
    start, end = span(snaps)
    got = tier.load(ref.path, NodeId(KEY, NS, start, end))
    assert same(got, snaps)
    assert "MLX's loader reads it" in caplog.text
    assert not list((tmp_path / "cold" / "quarantine").iterdir())


def test_a_damaged_array_read_by_the_threads_is_a_checksum_miss(tmp_path, monkeypatch):
    monkeypatch.setattr(cold, "PARALLEL_READS", True)
    monkeypatch.setattr(reader, "CHUNK", 1000)
    tier = ColdTier(tmp_path / "cold")
    snaps = _family_snapshots("llama")
    ref = put(tier, snaps)
    path = tier.root / ref.path
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40
    path.write_bytes(bytes(raw))
    start, end = span(snaps)
    with pytest.raises(ColdFileError) as info:
        tier.load(ref.path, NodeId(KEY, NS, start, end))
    assert info.value.reason == "checksum"


class _LandsElsewhere(reader.HostWrites):
    """Reads and hashes the file's bytes right, but they never reach the arrays
    (as copies to a wrong address would): the digests alone cannot tell."""

    def read(self, fd, offset, nbytes, view):
        return super().read(fd, offset, nbytes, memoryview(bytearray(nbytes)))


def test_copies_that_land_elsewhere_are_caught_and_mlx_s_loader_reads(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cold, "PARALLEL_READS", True)
    monkeypatch.setattr(reader, "failed", None)
    monkeypatch.setattr(reader, "destination", lambda: _LandsElsewhere())
    tier = ColdTier(tmp_path / "cold")
    snaps = _family_snapshots("llama")
    ref = put(tier, snaps)
    start, end = span(snaps)
    assert same(tier.load(ref.path, NodeId(KEY, NS, start, end)), snaps)
    assert reader.failed and "differ from the file's" in caplog.text
    assert not list((tmp_path / "cold" / "quarantine").iterdir())


def test_the_ends_read_back_match_for_every_chunking(written, monkeypatch):
    """The bytes an array's reads keep of its two ends are the array's own, however
    the chunks fall (a last chunk shorter than the ends included)."""
    path, arrays = written
    for chunk in (3, 16, 17, 1000):
        monkeypatch.setattr(reader, "CHUNK", chunk)
        fd = open_regular(path)
        tensors, _, base = header_of_fd(fd)
        got, _ = reader.FileRead(fd, tensors, base, reader.HostWrites()).result()  # checks the ends itself
        assert set(got) == set(arrays)


@pytest.mark.parametrize("chunk", [40, 1000, 4 << 20])
def test_staged_small_arrays_back_to_back_are_read_as_runs(written, monkeypatch, chunk):
    """On CUDA (the runtime's copies made by the host here): the arrays under a
    chunk that lie back to back are read in runs, one task and one wait each,
    and land as a read array by array lands; an array of a chunk or more is
    read alone, chunk by chunk."""
    from .test_cold import HostCopies

    path, arrays = written
    monkeypatch.setattr(reader, "CHUNK", chunk)
    monkeypatch.setattr(reader, "_staging", reader._Staging())  # this test's buffers, not the threads' kept ones
    monkeypatch.setattr(reader, "_address_kernel", lambda: None)  # blocks the host can address, on CUDA too
    rt, tasks = HostCopies(), []
    placing = reader.StagedCopies(rt)
    read, read_run = placing.read, placing.read_run
    monkeypatch.setattr(placing, "read", lambda *a: tasks.append([a[2]]) or read(*a))
    monkeypatch.setattr(placing, "read_run", lambda *a: tasks.append([n for _, n, _ in a[2]]) or read_run(*a))
    fd = open_regular(path)
    tensors, _, base = header_of_fd(fd)
    got, digests = reader.FileRead(fd, tensors, base, placing).result()
    for name, a in arrays.items():
        assert mx.array_equal(got[name], a).item(), name
        assert digests[name] == xxhash.xxh3_128_hexdigest(memoryview(mx.contiguous(a))), name
    sizes = sorted((t["data_offsets"][1] - t["data_offsets"][0]) for t in tensors.values())
    assert sorted(n for task in tasks for n in task) == [n for n in sizes if n]  # each array read once
    for task in tasks:
        assert len(task) == 1 or (sum(task) <= chunk and max(task) < chunk)  # a run: small arrays, a chunk at most
    if chunk == 4 << 20:
        assert len(tasks) == 1  # every array of this file in one run
    else:
        assert sorted(n for task in tasks if len(task) == 1 for n in task if n >= chunk) == [
            n for n in sizes if n >= chunk
        ]
    assert rt.copies >= len(tasks)
    assert _settled(path) == 0


# --- a node file's bytes already in memory (a remote hit's blob) ----------------------------


def _raw(path) -> tuple[memoryview, dict, int]:
    raw = path.read_bytes()
    fd = open_regular(path)
    try:
        tensors, _, base = header_of_fd(fd)
    finally:
        os.close(fd)
    return memoryview(raw), tensors, base


def test_bytes_that_end_before_an_array_raise_short_read(written, monkeypatch):
    path, _ = written
    monkeypatch.setattr(reader, "CHUNK", 64)
    data, tensors, base = _raw(path)
    with pytest.raises(reader.ShortRead):
        reader.BytesRead(data[:-10], tensors, base, reader.HostWrites()).result()
