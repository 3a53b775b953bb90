"""The node file writer: files MLX, the safetensors library and the strict
header reader all read back byte for byte, and writeback as they are written."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from promptstore.snapshots import safetensors_writer as W
from promptstore.snapshots.safetensors_header import read_header


def arrays_of_every_dtype() -> dict[str, mx.array]:
    out = {}
    for i, dtype in enumerate(W.DTYPE_NAMES):
        base = mx.arange(24, dtype=mx.float32).reshape(2, 3, 4) - 7
        out[f"t{i}"] = (base > 0) if dtype == mx.bool_ else base.astype(dtype)
    out["empty"] = mx.zeros((0, 4), dtype=mx.float32)
    out["strided"] = mx.arange(12, dtype=mx.int32).reshape(3, 4).T  # written row-major
    return out


def write(path, arrays, metadata, durable=True) -> int:
    named = []
    for name, a in arrays.items():
        flat = mx.contiguous(a)
        mx.eval(flat)
        named.append((name, a, memoryview(flat)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        return W.write_safetensors(fd, named, metadata, durable=durable)
    finally:
        os.close(fd)


def test_every_dtype_reads_back_through_mlx_and_the_strict_reader(tmp_path):
    arrays, path = arrays_of_every_dtype(), tmp_path / "a.safetensors"
    size = write(path, arrays, {"b": "2", "a": "1"})
    assert size == path.stat().st_size
    header, metadata = read_header(path)
    assert metadata == {"a": "1", "b": "2"} and set(header) == set(arrays)
    loaded = mx.load(str(path))
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype and loaded[name].shape == a.shape, name
        assert mx.array_equal(loaded[name], a).item(), name


def test_the_safetensors_library_reads_it(tmp_path):
    arrays = {"x": mx.random.normal((5, 7)), "n": mx.arange(9, dtype=mx.int64)}
    path = tmp_path / "b.safetensors"
    write(path, arrays, {"k": "v"})
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
        for name, a in arrays.items():
            np.testing.assert_array_equal(f.get_tensor(name), np.array(a))


def test_writeback_starts_while_the_file_is_written_and_never_queues_much(tmp_path, monkeypatch):
    """Each stretch is handed to the disk once written; before a stretch is
    handed over, all but the IN_FLIGHT newest ones have been waited for."""
    if W._sync_file_range is None:
        pytest.skip("no sync_file_range on this system")
    calls = []
    real = W._sync_file_range
    monkeypatch.setattr(W, "WRITEBACK_BYTES", 1 << 20)
    monkeypatch.setattr(W, "WRITE_CHUNK", 256 << 10)
    monkeypatch.setattr(
        W, "_sync_file_range", lambda fd, off, n, flags: calls.append((off, n, flags)) or real(fd, off, n, flags)
    )
    arrays = {f"a{i}": mx.random.normal((256, 1024)) for i in range(4)}  # 4 MiB
    size = write(tmp_path / "c.safetensors", arrays, {})
    started = [(off, n) for off, n, flags in calls if flags == W.SYNC_FILE_RANGE_WRITE]
    assert len(started) >= 3
    assert started[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(started, started[1:]))  # in order, no gaps
    assert started[-1][0] + started[-1][1] <= size
    waited = []
    for off, n, flags in calls:
        if flags == W.SYNC_FILE_RANGE_WRITE:
            assert len(waited) <= len(started) and started.index((off, n)) - len(waited) <= W.IN_FLIGHT
        else:
            assert flags == W.WAIT_FOR_RANGE and (off, n) == started[len(waited)]  # the oldest, in order
            waited.append((off, n))
    assert len(waited) == len(started) - W.IN_FLIGHT
    calls.clear()
    write(tmp_path / "d.safetensors", arrays, {}, durable=False)
    assert calls == []  # a write that is not fsynced leaves flushing to the kernel


def test_a_dtype_without_a_safetensors_name_is_refused():
    with pytest.raises(ValueError, match="complex64"):
        W.encode_header([("z", mx.complex64, (2,), 16)], {})


def named_of(arrays: dict[str, mx.array]) -> list:
    out = []
    for name, a in arrays.items():
        flat = mx.contiguous(a)
        mx.eval(flat)
        out.append((name, a, memoryview(flat)))
    return out


def test_a_header_written_last_gives_the_same_file(tmp_path):
    """With final_metadata the arrays go in first and the header last, in the
    room the placeholder left: the file is byte for byte the one written in order."""
    arrays = arrays_of_every_dtype()
    in_order = tmp_path / "in-order.safetensors"
    write(in_order, arrays, {"sums": "0123456789abcdef", "k": "v"})
    asked = []
    last = tmp_path / "last.safetensors"
    fd = os.open(last, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = W.write_safetensors(
            fd,
            named_of(arrays),
            {"sums": "0" * 16, "k": "v"},
            durable=True,
            final_metadata=lambda: asked.append(os.fstat(fd).st_size) or {"sums": "0123456789abcdef", "k": "v"},
        )
    finally:
        os.close(fd)
    assert last.read_bytes() == in_order.read_bytes() and size == last.stat().st_size
    assert asked == [size]  # asked for once, with every array already written


def test_a_final_header_of_another_length_is_refused(tmp_path):
    fd = os.open(tmp_path / "e.safetensors", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with pytest.raises(ValueError, match="final header"):
            W.write_safetensors(
                fd, named_of({"x": mx.ones((4,))}), {"s": "0"}, durable=False, final_metadata=lambda: {"s": "0" * 20}
            )
    finally:
        os.close(fd)
