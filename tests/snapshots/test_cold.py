"""The cold tier on its own: bit-exact round trips for every cache kind, private
files, and every kind of damaged or crafted file refused as a ColdFileError
(never another exception, never a hang, never a different snapshot)."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import signal
import stat
import struct

import mlx.core as mx
import pytest
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from promptstore import caches as C
from promptstore.caches.serialize import METADATA_KEY as SNAPSHOTS_KEY
from promptstore.errors import ColdFileError
from promptstore.identity import NodeId
from promptstore.snapshots import cold
from promptstore.snapshots.cold import NODE_KEY, TEMP_MARK, ColdTier
from promptstore.testing import models

from ..caches import drivers as D
from ..conftest import _model, forward, fresh_cache, prompt_tokens

KEY = bytes.fromhex("a1b2c3d4" * 4)
OTHER_KEY = bytes.fromhex("0f1e2d3c" * 4)
NS = bytes.fromhex("5a" * 16)
OTHER_NS = bytes.fromhex("6b" * 16)


# --- helpers -------------------------------------------------------------------------


def span(snaps):
    s = next(s for s in snaps if s is not None)
    return s.start, s.end


def put(tier: ColdTier, snaps, key=KEY, ns=NS):
    start, end = span(snaps)
    return tier.write(NodeId(key, ns, start, end), snaps)


def load(tier: ColdTier, rel: str, snaps, key=KEY, ns=NS):
    start, end = span(snaps)
    return tier.load(rel, NodeId(key, ns, start, end))


def same(a, b) -> bool:
    return len(a) == len(b) and all(C.arrays_equal(x, y) for x, y in zip(a, b))


def outcome(tier, rel, snaps, key=KEY, ns=NS) -> str:
    """'equal', 'cold:<reason>', 'DIFFERENT' (loaded but not the original) or 'RAISED:<type>'."""
    try:
        got = load(tier, rel, snaps, key, ns)
    except ColdFileError as e:
        return f"cold:{e.reason}"
    except Exception as e:  # noqa: BLE001 - the point is to see what escapes
        return f"RAISED:{type(e).__name__}: {e}"
    return "equal" if same(got, snaps) else "DIFFERENT"


def split_file(raw: bytes):
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join_file(header: dict, data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + data


def header_end(raw: bytes) -> int:
    return 8 + struct.unpack("<Q", raw[:8])[0]


def record_span(raw: bytes) -> tuple[int, int]:
    """Where the snapshots record (a JSON string inside the header) starts and ends."""
    lo = raw.index(f'"{SNAPSHOTS_KEY}":"'.encode(), 0, header_end(raw)) + len(SNAPSHOTS_KEY) + 4
    hi = lo
    while raw[hi] != ord('"') or raw[hi - 1] == ord("\\"):
        hi += 1
    return lo, hi


class Deadline(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise Deadline in this (main) thread if the block runs longer than `seconds`."""

    def fire(signum, frame):
        raise Deadline(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


class BF16KV(D.KVDriver):
    kind = "kv"

    def update(self, cache, lo, hi):
        cache.update_and_fetch(*D.kv_rows(lo, hi, self.batch, dtype=mx.bfloat16))


class BF16Rotating(D.RotatingDriver):
    def update(self, cache, lo, hi):
        cache.update_and_fetch(*D.kv_rows(lo, hi, self.batch, dtype=mx.bfloat16))


DRIVERS = {
    "kv": D.KVDriver(),
    "kv-bf16": BF16KV(),
    "quantized": D.QuantizedDriver(),
    "chunked": D.ChunkedDriver(),
    "rotating": D.RotatingDriver(12, 0),
    "rotating-keep": D.RotatingDriver(12, 2),
    "rotating-bf16": BF16Rotating(12, 2),
    "arrays": D.ArraysDriver(),
    "cache_list-kv": D.CacheListDriver(D.KVDriver()),
    "cache_list-rotating": D.CacheListDriver(D.RotatingDriver(12, 2)),
    "batch_kv": D.BatchKVDriver(),
    "batch_rotating": D.BatchRotatingDriver(12),
}
CHUNKS = [5, 9, 7]  # 21 positions: wraps the windows, crosses chunk boundaries


def driver_snapshot(name: str, lo: int):
    cache, _ = DRIVERS[name].build(CHUNKS)
    return cache.snapshot(lo).eval()


@functools.cache
def _bf16_model(family: str):
    return models.tiny_model(family, dtype=mx.bfloat16)


def model_snapshots(model, lo: int, hi: int, kv_bits=None, tokens=None):
    """Per-layer snapshots over [lo, hi) of a real model's cache."""
    tokens = prompt_tokens(hi, seed=3) if tokens is None else tokens
    cache = fresh_cache(model, kv_bits)
    if lo:
        forward(model, cache, tokens[:lo])
    forward(model, cache, tokens[lo:hi])
    return [s.eval() for s in C.snapshot_prompt_cache(cache, lo)]


@functools.cache
def _family_snapshots(family: str, lo: int = 17, hi: int = 40):
    return model_snapshots(_model(family), lo, hi)


@pytest.fixture(params=["mlx loader", "reading threads"])
def tier(request, tmp_path, monkeypatch):
    """A cold tier, read by MLX's loader or by promptstore's reading threads
    (CUDA's reader, placing the bytes in host memory here): every check below
    holds for both."""
    monkeypatch.setattr(cold, "PARALLEL_READS", request.param == "reading threads")
    return ColdTier(tmp_path / "cold")


@pytest.fixture
def llama_file(tier):
    snaps = _family_snapshots("llama")
    ref = put(tier, snaps)
    return tier, ref.path, snaps


def path_of(tier, rel):
    return tier.root / rel


# --- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DRIVERS))
@pytest.mark.parametrize("lo", [0, 5, 14])
def test_driver_round_trip_is_bit_exact(tier, name, lo):
    snap = driver_snapshot(name, lo)
    ref = put(tier, [snap])
    got = load(tier, ref.path, [snap])
    assert same(got, [snap])
    assert ref.nbytes == path_of(tier, ref.path).stat().st_size


def test_every_kind_in_one_file(tier):
    """One node holding a layer of each kind (as a hybrid model would)."""
    snaps = [driver_snapshot(name, 5) for name in sorted(DRIVERS)]
    ref = put(tier, snaps)
    assert same(load(tier, ref.path, snaps), snaps)


def test_bfloat16_survives_bit_exact(tier):
    snap = driver_snapshot("kv-bf16", 5)
    assert snap.arrays["keys"].dtype == mx.bfloat16
    ref = put(tier, [snap])
    (got,) = load(tier, ref.path, [snap])
    assert got.arrays["keys"].dtype == mx.bfloat16
    assert C.arrays_equal(got, snap)


@pytest.mark.parametrize("family", models.FAMILIES)
def test_model_cache_round_trip_is_bit_exact(tier, family):
    snaps = _family_snapshots(family)
    ref = put(tier, snaps)
    assert same(load(tier, ref.path, snaps), snaps)


def test_quantized_model_cache_round_trip(tier, model_of):
    snaps = model_snapshots(model_of("llama", "hd32"), 9, 33, kv_bits=8)
    assert {s.kind for s in snaps} == {"quantized"}
    ref = put(tier, snaps)
    assert same(load(tier, ref.path, snaps), snaps)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma3_text"])
def test_bfloat16_model_cache_round_trip(tier, family):
    snaps = model_snapshots(_bf16_model(family), 11, 30)
    dtypes = {a.dtype for s in snaps for a in s.all_arrays()}
    assert mx.bfloat16 in dtypes
    ref = put(tier, snaps)
    assert same(load(tier, ref.path, snaps), snaps)


def test_restored_from_file_generates_like_a_full_prefill(tier, model_of):
    model = model_of("gemma3_text")
    tokens = prompt_tokens(60, seed=5)
    snaps = model_snapshots(model, 0, 40, tokens=tokens)
    ref = put(tier, snaps)
    cache = fresh_cache(model)
    assert C.restore_prompt_cache(cache, load(tier, ref.path, snaps), 40)
    got = forward(model, cache, tokens[40:])
    want = forward(model, fresh_cache(model), tokens)
    assert mx.abs(got - want).max().item() < 1e-4


# --- permissions ---------------------------------------------------------------------


def test_file_is_private(tier):
    with umask(0o022):
        ref = put(tier, [driver_snapshot("kv", 0)])
    assert stat.S_IMODE(path_of(tier, ref.path).stat().st_mode) == 0o600
    for d in (tier.root, tier.files, tier.quarantine_dir, path_of(tier, ref.path).parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


# Regression (was a defect): cold.py write(): final.parent.mkdir(mode, parents=True) creates the
# first fan-out level files/ab with pathlib's default mode (0o777 & ~umask = 0755)
def test_every_directory_is_private(tier):
    with umask(0o022):
        put(tier, [driver_snapshot("kv", 0)])
    modes = {
        str(p.relative_to(tier.root)): oct(stat.S_IMODE(p.stat().st_mode))
        for p in [tier.root, *tier.root.rglob("*")]
        if p.is_dir()
    }
    assert all(m == oct(0o700) for m in modes.values()), modes


# Regression (was a defect): cold.py write(): mx.save_safetensors created the temp file 0644 and
# wrote the whole snapshot before os.chmod made it 0600
def test_snapshot_bytes_are_never_in_a_readable_file(tier, monkeypatch):
    from promptstore.snapshots import cold

    seen = []
    real = cold.write_safetensors

    def spy(fd, named, metadata, **options):
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))  # before a byte is written
        return real(fd, named, metadata, **options)

    monkeypatch.setattr(cold, "write_safetensors", spy)
    with umask(0o022):
        put(tier, [driver_snapshot("kv", 0)])
    assert seen and all(m & 0o077 == 0 for m in seen), [oct(m) for m in seen]


# --- damaged files -------------------------------------------------------------------


def _flip(raw: bytes, i: int, mask: int = 0x01) -> bytes:
    return raw[:i] + bytes([raw[i] ^ mask]) + raw[i + 1 :]


def _flip_at(needle: bytes, offset: int = 0, mask: int = 0x01):
    """Flip a byte `offset` bytes into the first `needle` of the header."""

    def change(raw):
        i = raw.index(needle, 0, header_end(raw)) + offset
        return _flip(raw, i, mask)

    return change


DAMAGE = {
    # name: (change(raw) -> raw, the reasons that are right)
    "data byte": (lambda raw: _flip(raw, (header_end(raw) + len(raw)) // 2), {"checksum"}),
    "last data byte": (lambda raw: _flip(raw, len(raw) - 1, 0x80), {"checksum"}),
    "header length": (lambda raw: _flip(raw, 0), {"header"}),
    "header brace": (lambda raw: _flip(raw, 8, 0x04), {"header"}),
    "tensor dtype": (_flip_at(b'"F32"', 1), {"header"}),
    "tensor offsets": (_flip_at(b'"data_offsets":[', 16), {"header"}),
    "node key": (_flip_at(KEY.hex().encode(), 0), {"identity"}),
    "node namespace": (_flip_at(NS.hex().encode(), 3), {"identity"}),
    "node version": (_flip_at(b'format_version\\":3', 17, 0x04), {"version", "header"}),
    "array checksum": (_flip_at(b'checksums\\":{\\"', 30), {"checksum", "header"}),
    "snapshot kind": (_flip_at(b'kind\\":\\"kv', 10), {"format", "checksum"}),
    "snapshot quote": (_flip_at(b'kind\\":\\"kv', 6, 0x40), {"header", "format", "checksum"}),
    "truncated to 0": (lambda raw: b"", {"header"}),
    "truncated to 7": (lambda raw: raw[:7], {"header"}),
    "truncated in header": (lambda raw: raw[: header_end(raw) // 2], {"header"}),
    "truncated at data": (lambda raw: raw[: header_end(raw)], {"header"}),
    "truncated by one": (lambda raw: raw[:-1], {"header"}),
    "extended by one": (lambda raw: raw + b"\0", {"header"}),
    "zeroed": (lambda raw: bytes(len(raw)), {"header"}),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_file_is_a_cold_file_error(llama_file, how):
    tier, rel, snaps = llama_file
    change, reasons = DAMAGE[how]
    path = path_of(tier, rel)
    raw = path.read_bytes()
    bad = change(raw)
    assert bad != raw
    path.write_bytes(bad)
    with pytest.raises(ColdFileError) as info:
        load(tier, rel, snaps)
    assert info.value.reason in reasons, str(info.value)
    assert info.value.path == rel


def test_file_of_another_node_is_an_identity_error(tier):
    a, b = driver_snapshot("kv", 5), driver_snapshot("kv", 5)
    ra, rb = put(tier, [a], KEY), put(tier, [b], OTHER_KEY)
    os.replace(path_of(tier, rb.path), path_of(tier, ra.path))
    with pytest.raises(ColdFileError) as info:
        load(tier, ra.path, [a])
    assert info.value.reason == "identity"


def test_file_of_another_span_is_an_identity_error(tier):
    early, late = driver_snapshot("kv", 0), driver_snapshot("kv", 5)
    r_early, r_late = put(tier, [early]), put(tier, [late])
    assert r_early.path != r_late.path  # same key, new span: a new name
    os.replace(path_of(tier, r_early.path), path_of(tier, r_late.path))
    with pytest.raises(ColdFileError) as info:
        load(tier, r_late.path, [late])
    assert info.value.reason == "identity"


def test_file_of_another_namespace_is_an_identity_error(tmp_path):
    mine, theirs = ColdTier(tmp_path / "mine"), ColdTier(tmp_path / "theirs")
    snap = driver_snapshot("rotating", 5)
    ref = put(mine, [snap], KEY, NS)
    other = put(theirs, [snap], KEY, OTHER_NS)
    # Same key and span: each write names its file with a tag of its own, both this node's.
    assert other.path != ref.path and mine.owns(other.path, NodeId(KEY, NS, *span([snap])))
    os.replace(path_of(theirs, other.path), path_of(mine, ref.path))
    with pytest.raises(ColdFileError) as info:
        load(mine, ref.path, [snap], KEY, NS)
    assert info.value.reason == "identity"


def test_missing_file(tier):
    snap = driver_snapshot("kv", 5)
    rel = tier.relative_path(NodeId(KEY, NS, 5, 21))
    with pytest.raises(ColdFileError) as info:
        load(tier, rel, [snap])
    assert info.value.reason == "missing"
    assert tier.quarantine(rel) is None


def test_file_left_under_its_temporary_name_is_missing(tier):
    """A writer killed between write and rename leaves only the temp file."""
    snap = driver_snapshot("kv", 5)
    ref = put(tier, [snap])
    final = path_of(tier, ref.path)
    temp = final.with_name(f"{final.stem}{TEMP_MARK}4242-deadbeef{final.suffix}")
    os.replace(final, temp)
    with pytest.raises(ColdFileError) as info:
        load(tier, ref.path, [snap])
    assert info.value.reason == "missing"
    assert list(tier.iter_files()) == []
    assert list(tier.iter_temp_files()) == [temp]


def test_quarantine_moves_the_file_aside(llama_file):
    tier, rel, snaps = llama_file
    path = path_of(tier, rel)
    path.write_bytes(_flip(path.read_bytes(), len(path.read_bytes()) - 3))
    with pytest.raises(ColdFileError):
        load(tier, rel, snaps)
    moved = tier.quarantine(rel)
    assert moved is not None and moved.parent == tier.quarantine_dir and moved.exists()
    assert not path.exists()
    assert list(tier.iter_files()) == []
    with pytest.raises(ColdFileError) as info:
        load(tier, rel, snaps)
    assert info.value.reason == "missing"


@pytest.mark.parametrize("target", ["valid file elsewhere", "other node's file", "/dev/zero", "dangling"])
def test_symlink_in_place_of_a_file(tmp_path, tier, target):
    """Refused, or (a verified file of this very node) served bit-exact: never anything else."""
    snap = driver_snapshot("kv", 5)
    elsewhere = ColdTier(tmp_path / "elsewhere")
    targets = {
        "valid file elsewhere": path_of(elsewhere, put(elsewhere, [snap]).path),
        "other node's file": path_of(tier, put(tier, [snap], OTHER_KEY).path),
        "/dev/zero": "/dev/zero",
        "dangling": tmp_path / "nothing-here",
    }
    rel = tier.relative_path(NodeId(KEY, NS, 5, 21))
    path_of(tier, rel).parent.mkdir(parents=True, exist_ok=True)
    path_of(tier, rel).symlink_to(targets[target])
    with deadline(5.0):
        got = outcome(tier, rel, [snap])
    assert got.startswith("cold:") or (got == "equal" and target == "valid file elsewhere"), got


def test_directory_in_place_of_a_file(tier):
    snap = driver_snapshot("kv", 5)
    rel = tier.relative_path(NodeId(KEY, NS, 5, 21))
    path_of(tier, rel).mkdir(parents=True)
    with pytest.raises(ColdFileError) as info:
        load(tier, rel, [snap])
    assert info.value.reason == "not a file"
    assert tier.quarantine(rel).is_dir() and not path_of(tier, rel).exists()


# Regression (was a defect): safetensors_header.read_header opens the path with a blocking open()
# and never checks S_ISREG: a FIFO in place of a file blocks load() forever
def test_fifo_in_place_of_a_file_does_not_block(tier):
    snap = driver_snapshot("kv", 5)
    rel = tier.relative_path(NodeId(KEY, NS, 5, 21))
    path_of(tier, rel).parent.mkdir(parents=True)
    os.mkfifo(path_of(tier, rel))
    with deadline(2.0):
        assert outcome(tier, rel, [snap]).startswith("cold:")


@pytest.mark.parametrize("rel", ["../outside.safetensors", "/etc/passwd", "files/../../outside.safetensors"])
def test_path_outside_the_tier_is_refused(tmp_path, tier, rel):
    (tmp_path / "outside.safetensors").write_bytes(b"precious")
    snap = driver_snapshot("kv", 5)
    with pytest.raises(ColdFileError):
        load(tier, rel, [snap])
    assert (tmp_path / "outside.safetensors").read_bytes() == b"precious"


# --- specific header flips that escape verification ----------------------------------


def _outcome_after(tier, rel, snaps, change):
    path = path_of(tier, rel)
    raw = path.read_bytes()
    path.write_bytes(change(raw))
    return outcome(tier, rel, snaps)


# Regression (was a defect): serialize._unflatten: `DTYPES.get(spec.dtype) != a.dtype` compares
# None with an mx.Dtype, which raises TypeError for an unknown dtype name; cold.load does not
# catch it
def test_flipped_snapshot_dtype_name_is_a_format_error(llama_file):
    tier, rel, snaps = llama_file
    got = _outcome_after(tier, rel, snaps, _flip_at(b'dtype\\":\\"float32', 10))  # float32 -> glo...
    assert got.startswith("cold:"), got


# Regression (was a defect): cold.load catches only SnapshotFormatError/UnknownKindError from
# from_flat; validate_snapshot raises CacheShapeError / SnapshotRangeError (CacheError) for a bad
# span
def test_flipped_snapshot_span_is_a_format_error(llama_file):
    tier, rel, snaps = llama_file
    got = _outcome_after(tier, rel, snaps, _flip_at(b'end\\":40,\\"whole', 7))  # end 40 -> 41
    assert got.startswith("cold:"), got


SCALAR_FLIPS = {
    # family, needle in the snapshots record, offset of the digit, mask
    "rotating keep": ("gemma3_text", b'keep\\":0', 7, 0x01),  # keep 0 -> 1
    "rotating max_size": ("gemma3_text", b'max_size\\":16', 12, 0x01),  # 16 -> 17
    "arrays size": ("qwen3_next", b'size\\":2', 7, 0x01),  # 2 -> 3
    "chunked chunk_size": ("llama4", b'chunk_size\\":16', 14, 0x02),  # 16 -> 14
}


# Regression (was a defect): cold.py: the per-array xxh3 checksums cover the arrays only; the
# snapshot metadata record (kinds, scalars, spans) is unverified, so a flipped digit in a scalar
# loads as a different snapshot
@pytest.mark.parametrize("what", sorted(SCALAR_FLIPS))
def test_flipped_snapshot_scalar_is_detected(tier, what):
    family, needle, offset, mask = SCALAR_FLIPS[what]
    snaps = _family_snapshots(family)
    rel = put(tier, snaps).path
    raw = path_of(tier, rel).read_bytes()
    i = raw.index(needle, 0, header_end(raw)) + offset
    assert chr(raw[i]).isdigit() and chr(raw[i] ^ mask).isdigit()  # a valid number stays valid
    got = _outcome_after(tier, rel, snaps, _flip_at(needle, offset, mask))
    assert got.startswith("cold:"), got


# --- crafted files -------------------------------------------------------------------


def write_raw(tier, raw: bytes) -> str:
    rel = tier.relative_path(NodeId(KEY, NS, 5, 21))
    path = path_of(tier, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return rel


def header_file(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def table(**tensors) -> bytes:
    return json.dumps(tensors).encode()


F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}

CRAFTED = {
    "header length 2**64-1": header_file(b"{}", length=2**64 - 1),
    "header length 2**63": header_file(b"{}", length=2**63),
    "header length past EOF": header_file(b"{}", length=3),
    "header length zero": header_file(b"", length=0),
    "not JSON": header_file(b"this is not json"),
    "not UTF-8": header_file(b'{"\xff\xfe":1}'),
    "JSON list": header_file(b"[1, 2, 3]"),
    "JSON null": header_file(b"null"),
    "JSON string": header_file(b'"{}"'),
    "NaN shape": header_file(b'{"x":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', bytes(4)),
    "huge int": header_file(b'{"x":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}', bytes(4)),
    "overlapping offsets": header_file(
        table(
            a={"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            b={"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
        ),
        bytes(24),
    ),
    "gap between tensors": header_file(
        table(
            a={"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            b={"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
        ),
        bytes(24),
    ),
    "same offsets twice": header_file(table(a=F32x4, b=F32x4), bytes(16)),
    "offsets past EOF": header_file(table(a={"dtype": "F32", "shape": [256], "data_offsets": [0, 1024]}), bytes(16)),
    "reversed offsets": header_file(table(a={"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}), bytes(16)),
    "negative offsets": header_file(table(a={"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}), bytes(16)),
    "float offsets": header_file(table(a={"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16.0]}), bytes(16)),
    "string offsets": header_file(table(a={"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}), bytes(16)),
    "three offsets": header_file(table(a={"dtype": "F32", "shape": [4], "data_offsets": [0, 8, 16]}), bytes(16)),
    "unknown dtype F64": header_file(table(a={"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}), bytes(16)),
    "unknown dtype F8": header_file(table(a={"dtype": "F8_E4M3", "shape": [16], "data_offsets": [0, 16]}), bytes(16)),
    "dtype not a string": header_file(table(a={"dtype": 7, "shape": [4], "data_offsets": [0, 16]}), bytes(16)),
    "size/shape mismatch": header_file(table(a={"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}), bytes(16)),
    "negative dim": header_file(table(a={"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}), bytes(16)),
    "huge dims": header_file(table(a={"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}), bytes(16)),
    "shape not a list": header_file(table(a={"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}), bytes(16)),
    "extra field": header_file(table(a={**F32x4, "extra": 1}), bytes(16)),
    "entry not an object": header_file(table(a=[1, 2]), bytes(16)),
    "metadata not an object": header_file(json.dumps({"__metadata__": [1], "a": F32x4}).encode(), bytes(16)),
    "metadata values not strings": header_file(
        json.dumps({"__metadata__": {NODE_KEY: {}}, "a": F32x4}).encode(), bytes(16)
    ),
    "no metadata": header_file(table(a=F32x4), bytes(16)),
    "path-like tensor name": header_file(table(**{"../../../etc/passwd": F32x4}), bytes(16)),
    "data after tensors": header_file(table(a=F32x4), bytes(32)),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_header_is_a_cold_file_error(tier, name):
    rel = write_raw(tier, CRAFTED[name])
    snap = driver_snapshot("kv", 5)
    got = outcome(tier, rel, [snap])
    assert got == "cold:header", got


def test_header_over_the_size_limit(tier):
    """A header length over the limit, in a file big enough to hold it (sparse)."""
    from promptstore.snapshots.safetensors_header import MAX_HEADER

    rel = write_raw(tier, header_file(b"{}", length=MAX_HEADER + 1))
    with open(path_of(tier, rel), "r+b") as f:
        f.truncate(MAX_HEADER + 64)
    assert outcome(tier, rel, [driver_snapshot("kv", 5)]) == "cold:header"


# Regression (was a defect): safetensors_header.read_header: json.loads of a deeply nested header
# raises RecursionError, which is not a ValueError and escapes cold.load
def test_deeply_nested_header_is_a_cold_file_error(tier):
    rel = write_raw(tier, header_file(b"[" * 100_000 + b"]" * 100_000))
    got = outcome(tier, rel, [driver_snapshot("kv", 5)])
    assert got.startswith("cold:"), got


def craft(tier, snaps, edit) -> str:
    """Rewrite a valid file's header with `edit(tensors, node_record, snapshots_record)`;
    the data and (unless edit changes them) the checksums stay valid, as an adversary
    who can compute xxh3 would make them."""
    ref = put(tier, snaps)
    path = path_of(tier, ref.path)
    header, data = split_file(path.read_bytes())
    meta = header.pop("__metadata__")
    node, record = json.loads(meta[NODE_KEY]), json.loads(meta[SNAPSHOTS_KEY])
    edit(header, node, record)
    meta[SNAPSHOTS_KEY] = json.dumps(record) if not isinstance(record, str) else record
    seal(node, meta[SNAPSHOTS_KEY])
    meta[NODE_KEY] = json.dumps(node)
    header["__metadata__"] = meta
    path.write_bytes(join_file(header, data))
    return ref.path


def seal(node: dict, record_text: str) -> None:
    """Recompute the node record's digest of the snapshots record, where it has one."""
    if "record" in node:
        node["record"] = xxhash.xxh3_128_hexdigest(record_text.encode())


def rename_tensor(old: str, new: str):
    def edit(tensors, node, record):
        tensors[new] = tensors.pop(old)
        node["checksums"][new] = node["checksums"].pop(old)

    return edit


def set_kind(kind):
    def edit(tensors, node, record):
        record["layers"][0]["kind"] = kind

    return edit


def same_bytes_other_dtype(tensors, node, record):
    tensors["L0/keys"]["dtype"] = "I32"  # same size, so the same bytes and checksum


def version(n):
    def edit(tensors, node, record):
        node["format_version"] = n

    return edit


def record_version(n):
    def edit(tensors, node, record):
        record["format_version"] = n

    return edit


def spec_name(name):
    def edit(tensors, node, record):
        record["layers"][0]["arrays"][0]["name"] = name

    return edit


def drop_layer(tensors, node, record):
    record["layers"] = []


EDITS = {
    "kind os.system": set_kind("os.system"),
    "kind subprocess.Popen": set_kind("subprocess.Popen"),
    "kind builtins.eval": set_kind("builtins.eval"),
    "kind mlx_lm class path": set_kind("mlx_lm.models.cache.KVCache"),
    "kind __class__": set_kind("__class__"),
    "kind not a string": set_kind(["kv"]),
    "tensor named ../../etc/passwd": rename_tensor("L0/keys", "../../etc/passwd"),
    "tensor named /abs/path": rename_tensor("L0/keys", "/abs/path"),
    "tensor named L0/../L0/keys": rename_tensor("L0/keys", "L0/../L0/keys"),
    "tensor named with NUL": rename_tensor("L0/keys", "L0/keys\x00"),
    "array spec named ../x": spec_name("../x"),
    "same bytes, other dtype": same_bytes_other_dtype,
    "node format version 4": version(4),
    "snapshots format version 99": record_version(99),
    "no layers": drop_layer,
    "node record missing": lambda t, n, r: n.clear(),
}


EDIT_REASONS = {"node format version 4": "version", "node record missing": "header"}  # else "format"


@pytest.mark.parametrize("name", sorted(EDITS))
def test_crafted_metadata_is_a_cold_file_error(tier, name):
    """Crafted with every checksum right: refused by the closed registry and the schema."""
    snap = driver_snapshot("kv", 5)
    rel = craft(tier, [snap], EDITS[name])
    got = outcome(tier, rel, [snap])
    assert got == f"cold:{EDIT_REASONS.get(name, 'format')}", got


# Regression (was a defect): serialize.parse_record (then _parse): json.loads of a deeply nested snapshots record
# raises RecursionError (only ValueError is caught); it escapes cold.load
def test_deeply_nested_snapshot_metadata_is_a_cold_file_error(tier):
    snap = driver_snapshot("kv", 5)

    def edit(tensors, node, record):
        return None

    rel = craft(tier, [snap], edit)
    path = path_of(tier, rel)
    header, data = split_file(path.read_bytes())
    header["__metadata__"][SNAPSHOTS_KEY] = "[" * 100_000
    node = json.loads(header["__metadata__"][NODE_KEY])
    seal(node, header["__metadata__"][SNAPSHOTS_KEY])
    header["__metadata__"][NODE_KEY] = json.dumps(node)
    path.write_bytes(join_file(header, data))
    got = outcome(tier, rel, [snap])
    assert got.startswith("cold:"), got


# Regression (was a defect): arrays.ArraysCache.validate_snapshot builds {f's{i}' for i in
# range(size)} from an unbounded `size` scalar: a crafted size of 2**40 runs until memory is gone
def test_crafted_huge_state_size_is_refused_promptly(tier):
    snap = driver_snapshot("arrays", 5)

    def edit(tensors, node, record):
        record["layers"][0]["scalars"]["size"] = 2**40

    rel = craft(tier, [snap], edit)
    with deadline(2.0):
        got = outcome(tier, rel, [snap])
    assert got.startswith("cold:"), got


# --- random corruption ---------------------------------------------------------------


FUZZ_KINDS = ["kv", "kv-bf16", "quantized", "chunked", "rotating-keep", "arrays", "cache_list-kv", "batch_rotating"]


@pytest.fixture
def fuzz_file(tier):
    snaps = [driver_snapshot(name, 5) for name in FUZZ_KINDS]
    ref = put(tier, snaps)
    raw = path_of(tier, ref.path).read_bytes()
    return tier, ref.path, snaps, raw


def _fuzz(body, **kw):
    return settings(
        max_examples=kw.pop("max_examples", 150),
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
        **kw,
    )(body)


def test_fuzz_data_bit_flips_are_always_detected(fuzz_file):
    tier, rel, snaps, raw = fuzz_file
    path, first = path_of(tier, rel), header_end(raw)
    counts = collections.Counter()

    @_fuzz
    @given(st.sets(st.tuples(st.integers(first, len(raw) - 1), st.integers(0, 7)), min_size=1, max_size=4))
    def run(flips):
        bad = bytearray(raw)
        for i, bit in flips:
            bad[i] ^= 1 << bit
        path.write_bytes(bytes(bad))
        got = outcome(tier, rel, snaps)
        counts[got] += 1
        assert got == "cold:checksum", (sorted(flips), got)

    run()
    print(f"data flips: {dict(counts)}")
    assert counts["cold:checksum"] == sum(counts.values()) >= 100


def test_fuzz_truncation_and_extension_are_always_detected(fuzz_file):
    tier, rel, snaps, raw = fuzz_file
    path = path_of(tier, rel)
    counts = collections.Counter()

    @_fuzz
    @given(
        st.one_of(
            st.integers(0, len(raw) - 1).map(lambda n: raw[:n]),
            st.binary(min_size=1, max_size=64).map(lambda tail: raw + tail),
        )
    )
    def run(bad):
        path.write_bytes(bad)
        got = outcome(tier, rel, snaps)
        counts[got] += 1
        assert got.startswith("cold:"), (len(bad), got)

    run()
    print(f"truncations/extensions: {dict(counts)}")


# Regression (was a defect): header flips escape verification: unchecked snapshot metadata
# (silently different snapshots), TypeError and CacheShapeError from from_flat; see the specific
# tests above
def test_fuzz_random_corruption_is_detected_or_harmless(fuzz_file):
    """Bit flips anywhere (a third in the snapshot metadata, a third in the rest of the
    header) and truncations: every load returns the original snapshots or raises
    ColdFileError."""
    tier, rel, snaps, raw = fuzz_file
    path, head = path_of(tier, rel), header_end(raw)
    meta_lo, meta_hi = record_span(raw)
    counts = collections.Counter()
    offset = st.one_of(st.integers(meta_lo, meta_hi), st.integers(0, head - 1), st.integers(0, len(raw) - 1))
    keep = raw.index(b'keep\\":2', meta_lo) + 7  # rotating keep 2 -> 3: escaped before the record checksum

    @_fuzz
    @example([(keep, 0)], None)
    @given(
        st.lists(st.tuples(offset, st.integers(0, 7)), min_size=1, max_size=3),
        st.one_of(st.none(), st.integers(0, len(raw) - 1)),
    )
    def run(flips, cut):
        bad = bytearray(raw)
        for i, bit in flips:
            bad[i] ^= 1 << bit
        if cut is not None:
            bad = bad[:cut]
        path.write_bytes(bytes(bad))
        got = outcome(tier, rel, snaps)
        counts[got.split(":")[0] if got.startswith("RAISED") else got] += 1
        assert got == "equal" or got.startswith("cold:"), (flips, cut, got)

    try:
        run()
    finally:
        print(f"random corruption: {dict(counts)}")


def test_two_writes_of_one_node_never_share_a_file(tier):
    """Two processes spilling one node, or two compacts joining one chain, each
    publish (or delete, when refused) only a file of their own."""
    snap = driver_snapshot("kv", 5)
    first, second = put(tier, [snap]), put(tier, [snap])
    assert first.path != second.path
    assert all(tier.owns(r.path, NodeId(KEY, NS, *span([snap]))) for r in (first, second))
    tier.delete(second.path)
    assert outcome(tier, first.path, [snap]) == "equal"


@pytest.mark.parametrize(
    "rel",
    [
        "files/00/00/other-5-21.safetensors",
        "{own}-5-21-deadbeef/../x.safetensors",
        "{own}-5-21-notatag.safetensors",
        "{own}-5-22-deadbeef.safetensors",
        "{own}-5-21-deadbeef.tmp-1-2.safetensors",
    ],
)
def test_owns_only_names_write_gives(tier, rel):
    own = tier.relative_path(NodeId(KEY, NS, 5, 21))[: -len(".safetensors")]
    base = own.rsplit("-", 2)[0]
    assert not tier.owns(rel.replace("{own}-5-21", own).replace("{own}-5-22", base + "-5-22"), NodeId(KEY, NS, 5, 21))
    assert tier.owns(own + ".safetensors", NodeId(KEY, NS, 5, 21)) and tier.owns(
        own + "-0123abcd.safetensors", NodeId(KEY, NS, 5, 21)
    )


def _big_snapshots(layers=3, tokens=1024):
    """Enough bytes (float32 KV, 2 MiB an array) that checksums run on the hashing threads."""
    out = []
    for i in range(layers):
        c = C.KVCache()
        k = mx.random.normal((1, 8, tokens, 64), key=mx.random.key(i))
        c.update_and_fetch(k, k.transpose(0, 1, 3, 2).reshape(1, 8, tokens, 64))  # values from a strided view
        out.append(c.snapshot(0).eval())
    return out


def test_checksums_on_threads_equal_checksums_in_turn():
    from promptstore.snapshots.cold import PARALLEL_HASH_BYTES, checksum, checksums

    arrays, _ = C.to_flat(_big_snapshots())
    mx.eval(list(arrays.values()))
    strided = arrays["L0/keys"].transpose(0, 2, 1, 3)  # not row-major: hashed from a contiguous copy
    arrays["strided"] = strided
    assert sum(a.nbytes for a in arrays.values()) >= 2 * PARALLEL_HASH_BYTES
    assert checksums(arrays) == {n: checksum(a) for n, a in arrays.items()}
    fresh = strided + 0  # a new, row-major array of the same values
    mx.eval(fresh)
    assert checksum(strided) == checksum(fresh)


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_damaged_array_of_a_large_file_is_caught(tier, which):
    snaps = _big_snapshots()
    ref = put(tier, snaps)
    assert outcome(tier, ref.path, snaps) == "equal"
    path = path_of(tier, ref.path)
    raw = path.read_bytes()
    at = header_end(raw) + 5 if which == "first" else len(raw) - 5
    path.write_bytes(_flip(raw, at))
    assert outcome(tier, ref.path, snaps) == "cold:checksum"


@pytest.mark.parametrize("cut", [0.3, 0.99])
def test_a_file_truncated_after_its_header_check_is_unreadable(tier, monkeypatch, cut):
    """Another process truncated the file between the header check and the
    read: a miss, never an exception from a reading thread."""
    snaps = _big_snapshots(layers=2)
    ref = put(tier, snaps)
    real_header = cold.header_of_fd

    def then_truncated(fd):
        checked = real_header(fd)
        os.truncate(path_of(tier, ref.path), int(os.fstat(fd).st_size * cut))
        return checked

    monkeypatch.setattr(cold, "header_of_fd", then_truncated)
    assert outcome(tier, ref.path, snaps) in {"cold:unreadable", "cold:checksum"}


def test_a_file_truncated_while_mlx_reads_it_is_a_miss_or_served_whole(tier):
    """Racing MLX's read: whatever it read before the cut is verified like the rest."""
    snaps = _big_snapshots(layers=2)
    ref = put(tier, snaps)
    start, end = span(snaps)
    pending = tier.start_load(ref.path, NodeId(KEY, NS, start, end))
    path = path_of(tier, ref.path)
    os.truncate(path, path.stat().st_size // 2)
    try:
        got = pending.result()
    except ColdFileError as e:
        assert e.reason in {"unreadable", "checksum"}
    else:
        assert same(got, snaps)


def test_dropped_host_copies_empty_mlx_s_buffer_cache_past_a_threshold(monkeypatch):
    """On CUDA a spill's host-read copies must not go back to MLX's buffer cache
    (a kernel given one would fault its pages back): release_host_copies drops
    them and, once CLEAR_BYTES of them have been dropped, empties that cache. The
    CUDA branch runs here on the CPU backend, whose buffer cache is real too."""
    from promptstore.snapshots import device

    monkeypatch.setattr(device, "CUDA", True)
    monkeypatch.setattr(device, "CLEAR_BYTES", 3 << 20)
    monkeypatch.setattr(device, "_dropped", 0)
    mx.clear_cache()

    def copies() -> dict[str, mx.array]:
        made = {"k": mx.ones((1 << 18,), dtype=mx.float32) * 2}  # 1 MiB
        mx.eval(made)
        mx.clear_cache()  # what MLX keeps from here on is what the release left
        return made

    first = copies()
    device.release_host_copies(first)
    assert first == {}  # the caller's dict holds nothing any more
    assert mx.get_cache_memory() >= 1 << 20  # under the threshold: kept for reuse
    second = copies()
    device.release_host_copies(second)
    assert mx.get_cache_memory() >= 1 << 20
    third = copies()
    device.release_host_copies(third)  # 3 MiB dropped in all
    assert mx.get_cache_memory() == 0
    assert device._dropped == 0
    fourth = copies()
    device.release_host_copies(fourth, flush=True)  # under the threshold, emptied at once
    assert mx.get_cache_memory() == 0
    monkeypatch.setattr(device, "CUDA", False)
    kept = copies()
    device.release_host_copies(kept)  # elsewhere the "copies" are the originals
    assert set(kept) == {"k"}


def test_a_write_releases_the_copies_it_read_whether_it_lands_or_fails(tmp_path, monkeypatch):
    """ColdTier.write hands the arrays it read to release_host_copies once, both
    when the file lands and when the disk refuses it."""
    import errno

    from promptstore.errors import DiskWriteError
    from promptstore.snapshots import device

    released = []
    monkeypatch.setattr(device, "staged_sources", lambda arrays: None)  # spills through host reads (CUDA stages)
    monkeypatch.setattr(device, "release_host_copies", lambda copies: released.append(len(copies)))
    tier = ColdTier(tmp_path / "cold")
    snaps = _family_snapshots("llama")
    put(tier, snaps)
    assert len(released) == 1 and released[0] > 0

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cold, "write_safetensors", full)
    with pytest.raises(DiskWriteError):
        put(tier, snaps, key=OTHER_KEY)
    assert released == [released[0], released[0]]


def test_a_failed_write_waits_for_its_checksums_and_leaves_no_file(tmp_path, monkeypatch):
    """The arrays are hashed while they are written: when the write fails (the
    disk refuses it, or a header would not fit the room left for it), the
    hashing threads are done with the arrays before write() hands them back,
    and no file, temporary or final, stays."""
    import errno

    from promptstore.errors import DiskWriteError
    from promptstore.snapshots import device

    events = []
    real_start = cold.start_checksums

    def start(arrays, then=None):
        wait = real_start(arrays, then)
        return lambda: events.append("hashed") or wait()

    monkeypatch.setattr(device, "staged_sources", lambda arrays: None)
    monkeypatch.setattr(device, "release_host_copies", lambda copies: events.append("released"))
    monkeypatch.setattr(cold, "start_checksums", start)
    tier = ColdTier(tmp_path / "cold")
    snaps = _family_snapshots("llama")
    real_write = cold.write_safetensors

    def full(fd, named, metadata, **options):
        os.write(fd, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cold, "write_safetensors", full)
    with pytest.raises(DiskWriteError):
        put(tier, snaps)
    assert events == ["hashed", "released"]
    monkeypatch.setattr(cold, "write_safetensors", real_write)
    monkeypatch.setattr(cold, "CHECKSUM_HEX", 24)  # placeholders 8 characters short of a digest
    events.clear()
    with pytest.raises(ValueError, match="final header"):
        put(tier, snaps)
    assert events[-1] == "released" and "hashed" in events[:-1]
    assert [p for p in tier.root.rglob("*") if p.is_file()] == []
    monkeypatch.setattr(cold, "CHECKSUM_HEX", 32)
    put(tier, snaps)  # and the tier writes on
    assert len([p for p in tier.root.rglob("*.safetensors")]) == 1


class HostCopies:
    """The CUDA runtime calls a staged spill makes, carried out by the host:
    pinned() is plain memory, copy_async a memmove (done when it returns)."""

    def __init__(self):
        self.copies, self._buffers = 0, []

    def pinned(self, nbytes):
        import ctypes

        buf = (ctypes.c_char * nbytes)()
        self._buffers.append(buf)
        return ctypes.addressof(buf), memoryview(buf).cast("B")

    def event(self):
        return object()

    def copy_async(self, dst, src, nbytes, done):
        import ctypes

        ctypes.memmove(dst, src, nbytes)
        self.copies += 1

    def wait(self, event):
        pass

    def sync(self):
        pass


@pytest.fixture
def staging(monkeypatch):
    """Staged spills on this machine: the runtime's copies made by the host, each
    array's address its host address, chunks of an odd size."""
    from promptstore.snapshots import device

    rt = HostCopies()
    monkeypatch.setattr(device, "runtime", lambda: rt)
    monkeypatch.setattr(device, "device_addresses", lambda arrays: [device.address(a) for a in arrays])
    monkeypatch.setattr(device, "STAGE_BYTES", 512 + 40)
    monkeypatch.setattr(device._stage, "buffers", None)
    monkeypatch.setattr(device, "staging_failed", None)
    monkeypatch.setattr(cold, "_staged_checked", False)
    return rt


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_staged_spill_writes_the_bytes_a_host_read_spill_writes(tmp_path, staging, monkeypatch, family):
    """Through the copy engine's chunks (two buffers in turn, an odd tail) a spill
    writes the very file a spill through host reads writes, and it loads back
    verified into the same snapshots."""
    from promptstore.snapshots import device

    snaps = _family_snapshots(family)
    nbytes = sum(a.nbytes for s in snaps if s is not None for a in s.all_arrays())
    ref = put(ColdTier(tmp_path / "staged"), snaps)
    arrays = len([a for s in snaps if s is not None for a in s.all_arrays()])
    # Every chunk crosses once, hashed as it is written (not once for the checksums, then for the file).
    assert nbytes // device.STAGE_BYTES <= staging.copies <= nbytes // device.STAGE_BYTES + arrays
    assert device.staging_failed is None  # the check of both ends found the bytes right
    monkeypatch.setattr(device, "runtime", lambda: None)
    plain = put(ColdTier(tmp_path / "plain"), snaps)
    data = [(tmp_path / root / r.path).read_bytes() for root, r in (("staged", ref), ("plain", plain))]
    assert data[0] == data[1] and ref.checksum == plain.checksum
    assert same(load(ColdTier(tmp_path / "staged"), ref.path, snaps), snaps)


def test_staged_bytes_that_differ_from_the_arrays_turn_staging_off(tmp_path, staging, monkeypatch, caplog):
    """Addresses that are not the arrays' (the kernel's pointer was not where MLX
    keeps them): the first staged spill compares both ends of every array with
    the array itself, finds the difference, and spills through host reads, as
    every later spill of the process does. The file holds the arrays' bytes."""
    from promptstore.snapshots import device

    other = mx.arange(1 << 16, dtype=mx.float32)
    mx.eval(other)
    monkeypatch.setattr(device, "device_addresses", lambda arrays: [device.address(other) for _ in arrays])
    snaps = _family_snapshots("llama")
    tier = ColdTier(tmp_path / "cold")
    with caplog.at_level("WARNING", logger="promptstore.snapshots"):
        ref = put(tier, snaps)
    assert device.staging_failed and "differ" in caplog.text
    copies = staging.copies
    put(tier, snaps, key=OTHER_KEY)
    assert staging.copies == copies  # no staging any more
    monkeypatch.setattr(device, "runtime", lambda: None)  # read back as this machine reads
    assert same(load(tier, ref.path, snaps), snaps)


def test_a_chunk_source_short_of_its_array_is_refused(tmp_path):
    """write_safetensors refuses a chunk source that gives fewer bytes than its
    array holds (OSError, which the tier reports as a DiskWriteError)."""
    from promptstore.snapshots.safetensors_writer import write_safetensors

    a = mx.arange(1000, dtype=mx.float32)
    mx.eval(a)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="header describes"):
            write_safetensors(fd, [("a", a, lambda: iter([memoryview(a).cast("B")[:100]]))], {}, durable=False)
    finally:
        os.close(fd)


def test_a_runtime_error_mid_spill_leaves_no_file_and_turns_staging_off(tmp_path, staging, monkeypatch):
    """The copy engine refuses a copy while the file is being written: the
    temporary file goes, the spill is made through host reads (the file holds
    the arrays' bytes), and this process stages no more."""
    from promptstore.snapshots import device

    snaps = _family_snapshots("llama")
    nbytes = sum(a.nbytes for s in snaps if s is not None for a in s.all_arrays())
    real = staging.copy_async
    calls = [0]

    def copy_async(dst, src, n, done):
        calls[0] += 1
        if calls[0] > nbytes // device.STAGE_BYTES // 2:  # halfway through the file's writing
            raise device.CudaError("cudaMemcpyAsync failed (CUDA error 700)")
        real(dst, src, n, done)

    monkeypatch.setattr(staging, "copy_async", copy_async)
    tier = ColdTier(tmp_path / "cold")
    ref = put(tier, snaps)
    assert device.staging_failed and "CUDA error" in device.staging_failed
    assert [p.name for p in tier.iter_temp_files()] == []
    monkeypatch.setattr(device, "runtime", lambda: None)  # read back as this machine reads
    assert same(load(tier, ref.path, snaps), snaps)
