"""Streaming cold files into MLX (snapshots/stream.py): arrays read in one
checksummed pass, token arrays joined straight from their files into a new
buffer, and every damaged byte caught before the buffer is handed over,
including bytes of a stored array the join does not place."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from promptstore import caches as C
from promptstore.caches.join import join
from promptstore.caches.serialize import METADATA_KEY
from promptstore.errors import ColdFileError
from promptstore.identity import NodeId
from promptstore.snapshots import stream
from promptstore.snapshots.cold import ColdTier

KEY, NS = b"\x11" * 16, b"\x22" * 16


def kv_snapshot(start: int, end: int, dtype=mx.float32, seed: int = 0):
    """A KV snapshot of [start, end): batch 1, 3 heads, head dim 8."""
    k1, k2 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, 3, end - start, 8), key=k1).astype(dtype)
    values = mx.random.normal((1, 3, end - start, 8), key=k2).astype(dtype)
    return C.Snapshot("kv", start, end, False, {"keys": keys, "values": values}, {}).eval()


def stored(tier, snap, deferred=True):
    """The snapshot written to `tier`, read back with its token arrays left in the file."""
    node = NodeId(KEY, NS, snap.start, snap.end)
    ref = tier.write(node, [snap])
    (got,) = tier.start_load(ref.path, node, deferred).result()
    return got, tier.root / ref.path


@pytest.fixture
def tier(tmp_path):
    return ColdTier(tmp_path / "cold")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("unified", [True, False])
def test_a_join_of_memory_and_files_equals_concatenate(tier, monkeypatch, dtype, unified):
    monkeypatch.setattr(stream, "unified_memory", lambda: unified)  # False: the path CUDA takes
    live = kv_snapshot(0, 40, dtype, seed=1).arrays["keys"][..., :10, :]  # strided, as a live buffer is
    a, _ = stored(tier, kv_snapshot(10, 30, dtype, seed=2))
    b = kv_snapshot(30, 35, dtype, seed=3).arrays["keys"]
    c, _ = stored(tier, kv_snapshot(35, 60, dtype, seed=4))
    zeros = mx.zeros((1, 3, 7, 8), dtype)
    pieces = [live, a.arrays["keys"], b, c.arrays["keys"][..., 2:20, :], zeros]
    assert isinstance(pieces[1], stream.StoredArray) and pieces[3].shape == (1, 3, 18, 8)
    got = join(pieces, 2)
    want = mx.concatenate([live, *(stored_values(tier, p) for p in pieces[1:4]), zeros], axis=2)
    assert got.dtype == dtype and got.shape == want.shape
    assert mx.array_equal(got.view(mx.uint8), want.view(mx.uint8)).item()


def stored_values(tier, piece):
    """What a stored piece holds, read the plain way."""
    if isinstance(piece, mx.array):
        return piece
    arrays = mx.load(str(tier.absolute(piece.source.file.rel)))
    return arrays[piece.source.name][..., piece.rows[0] : piece.rows[1], :]


def test_a_restore_from_a_deferred_file_is_bit_exact(tier):
    snap = kv_snapshot(0, 30)
    got, _ = stored(tier, snap)
    cache = C.KVCache()
    assert C.restore_prompt_cache([cache], [[got]], 25)
    assert mx.array_equal(cache.keys[..., :25, :], snap.arrays["keys"][..., :25, :]).item()
    assert cache.offset == 25 and cache.keys.shape[2] > 25  # headroom for the next step


@pytest.mark.parametrize("where", ["placed rows", "rows left out"])
def test_a_damaged_byte_anywhere_in_a_stored_array_fails_the_join(tier, where):
    got, path = stored(tier, kv_snapshot(0, 30))
    piece = got.arrays["values"][..., :12, :]  # the join places rows 0-11 only
    row = 8 * 4
    offset = piece.source.offset + (2 * 30 + (5 if where == "placed rows" else 20)) * row  # head 2
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(ColdFileError) as info:
        join([piece, mx.zeros((1, 3, 4, 8))], 2)
    assert info.value.reason == "checksum" and info.value.path == got_path(tier, path)


def got_path(tier, path):
    return str(path.relative_to(tier.root))


def test_a_file_cut_short_before_the_join_is_unreadable(tier):
    got, path = stored(tier, kv_snapshot(0, 30))
    os.truncate(path, path.stat().st_size - 100)  # after the header check: the open file is read
    with pytest.raises(ColdFileError) as info:
        join([got.arrays["keys"], got.arrays["values"][..., :0, :]], 2)
    assert info.value.reason in {"unreadable", "checksum"}
    join([got.arrays["keys"]], 2)  # keys lie before the cut: still whole and verified


def test_arrays_read_whole_are_verified_and_independent_of_the_file(tier):
    snap = kv_snapshot(0, 20, mx.bfloat16)
    got, path = stored(tier, snap, deferred=False)
    assert all(isinstance(a, mx.array) for a in got.arrays.values())
    path.unlink()
    assert C.arrays_equal(got, snap)


def test_cold_files_are_plain_safetensors(tier):
    """Written by promptstore's own writer, read by MLX's loader: same arrays, same metadata."""
    snap = kv_snapshot(3, 21, mx.float16)
    ref = tier.write(NodeId(KEY, NS, 3, 21), [snap])
    arrays, metadata = mx.load(str(tier.root / ref.path), return_metadata=True)
    want, want_meta = C.to_flat([snap])
    assert sorted(arrays) == sorted(want) and all(mx.array_equal(arrays[n], want[n]).item() for n in want)
    assert metadata[METADATA_KEY] == want_meta[METADATA_KEY]


def test_a_stored_array_slices_only_along_positions(tier):
    got, _ = stored(tier, kv_snapshot(0, 30))
    keys = got.arrays["keys"]
    assert keys[..., 5:9, :].rows == (5, 9) and keys[..., 5:9, :][..., 1:3, :].rows == (6, 8)
    assert keys[..., 40:50, :].shape[2] == 0
    for bad in [(0,), (Ellipsis, slice(0, 4, 2), slice(None)), (Ellipsis, slice(0, 4), slice(0, 2))]:
        with pytest.raises(TypeError):
            keys[bad]


def test_a_feed_fill_that_fails_raises_its_own_error():
    def fill(view):
        raise ColdFileError("bad bytes", "checksum", "files/x")

    with pytest.raises(ColdFileError) as info:
        stream.Feed([stream.Tensor("a", mx.float32, (4,), fill)]).load()
    assert info.value.reason == "checksum"
