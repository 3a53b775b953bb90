"""The fetch path of a remote hit: only the nodes the local tiers lack are
downloaded, every piece is opened into place in memory as it arrives and
verified there as the cold loader verifies a file (no file is staged), and a
piece gone or bad is still a reported miss that changes nothing."""

from __future__ import annotations

import os
import random

import mlx.core as mx
import pytest

import promptstore
from promptstore.caches import snapshot_prompt_cache
from promptstore.errors import ColdFileError, RemoteError
from promptstore.identity import NodeId
from promptstore.snapshots import ColdTier, reader
from promptstore.snapshots import cold as cold_module
from promptstore.snapshots.blob import load_bytes
from promptstore.snapshots.remote.keys import BLOB_PREFIX
from promptstore.snapshots.remote.seal import Assembly, seal_pieces
from promptstore.testing.models import tiny_model

from ..conftest import forward, fresh_cache, prompt_tokens
from .helpers import assert_faithful

PIECE = 1 << 15  # the nodes below are 50-200 KB: several pieces each
FIRST, SECOND = 300, 560  # A's chain: [0, 300), [300, 560)


# --- opening pieces in memory ------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 5])
@pytest.mark.parametrize("order", ["forward", "backward", "shuffled"])
def test_pieces_open_into_place_in_any_order(count, order):
    key, data = os.urandom(32), os.urandom(100_003)
    names = [f"ps:b:{i}" for i in range(count)]
    values = seal_pieces(key, data, names)
    indices = list(range(count))
    if order == "backward":
        indices.reverse()
    elif order == "shuffled":
        random.Random(count).shuffle(indices)
    blob = Assembly(key, names, len(data))
    for i in indices:
        blob.add(i, values[i])
    assert bytes(blob.data()) == data
    assert blob.nbytes == sum(len(v) for v in values)


@pytest.mark.parametrize(
    "fault", ["gone", "flipped", "short", "long", "moved", "other publish", "not bytes", "past the record"]
)
def test_a_bad_piece_makes_the_blob_an_error(fault):
    key, data = os.urandom(32), os.urandom(50_000)
    names = [f"ps:b:{i}" for i in range(4)]
    values = seal_pieces(key, data, names)
    limit = len(data) // 2 if fault == "past the record" else len(data)
    if fault == "gone":
        values[1] = None
    elif fault == "flipped":
        values[2] = values[2][:40] + bytes([values[2][40] ^ 1]) + values[2][41:]
    elif fault == "short":
        values[0] = values[0][:-1]
    elif fault == "long":
        values[3] = values[3] + b"x"
    elif fault == "moved":
        values[1], values[2] = values[2], values[1]
    elif fault == "other publish":
        values[2] = seal_pieces(key, data, names)[2]
    elif fault == "not bytes":
        values[0] = ["a list"]
    blob = Assembly(key, names, limit)
    for i, value in enumerate(values):
        blob.add(i, value)
    with pytest.raises(RemoteError) as raised:
        blob.data()
    assert raised.value.reason == ("missing" if fault == "gone" else "garbage")


@pytest.fixture(params=["copied into MLX", "reading threads"])
def placed(request, monkeypatch):
    """load_bytes copying the bytes into MLX arrays itself, or placing them through
    the reading threads (CUDA's way, writing host memory here): the same checks."""
    monkeypatch.setattr(cold_module, "PARALLEL_READS", request.param == "reading threads")
    return request.param


@pytest.mark.parametrize("dtype,kv_bits", [("float32", None), ("bfloat16", None), ("float16", None), ("float32", 4)])
def test_a_node_file_in_memory_is_verified_as_the_file_is(tmp_path, placed, dtype, kv_bits):
    """load_bytes serves what ColdTier.load serves from the same bytes (every dtype a
    snapshot holds), and refuses them where one byte differs, or where they name
    another node."""
    model = tiny_model("llama", dtype=getattr(mx, dtype), num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    cache = fresh_cache(model, kv_bits=kv_bits)
    forward(model, cache, prompt_tokens(40, seed=70))
    snaps = snapshot_prompt_cache(cache, 0)
    cold = ColdTier(tmp_path / "cold")
    node = NodeId(os.urandom(16), os.urandom(16), 0, 40)
    ref = cold.write(node, snaps)
    raw = cold.absolute(ref.path).read_bytes()
    from_file = cold.load(ref.path, node)
    from_memory = load_bytes(memoryview(raw), node, "fetched")
    for a, b in zip(from_file, from_memory):
        assert a.kind == b.kind and (a.start, a.end) == (b.start, b.end) and a.scalars == b.scalars
        assert {k: v.dtype for k, v in a.arrays.items()} == {k: v.dtype for k, v in b.arrays.items()}
        assert all(mx.array_equal(a.arrays[k], b.arrays[k]).item() for k in a.arrays)
    for at in (3, len(raw) // 2, len(raw) - 1):  # the header, then array bytes
        bad = bytearray(raw)
        bad[at] ^= 0x10
        with pytest.raises(ColdFileError):
            load_bytes(memoryview(bytes(bad)), node, "fetched")
    with pytest.raises(ColdFileError) as raised:
        load_bytes(memoryview(raw), NodeId(os.urandom(16), node.namespace, 0, 40), "fetched")
    assert raised.value.reason == "identity"


@pytest.mark.parametrize("damaged", [None, "middle", "last"])
def test_a_large_node_in_memory_is_checked_on_the_hashing_threads(tmp_path, placed, damaged):
    """Arrays enough to share (past PARALLEL_HASH_BYTES) are hashed a span each on the
    hashing threads, or as the reading threads place them: what they find equals
    the file's own load, and a byte flipped in a middle array or the last one is
    caught either way."""
    from promptstore.caches import KVCache
    from promptstore.snapshots.cold import PARALLEL_HASH_BYTES

    snaps = []
    for i in range(3):
        c = KVCache()
        k = mx.random.normal((1, 8, 1024, 64), key=mx.random.key(90 + i))  # 2 MiB an array
        c.update_and_fetch(k, k * 2)
        snaps.append(c.snapshot(0).eval())
    cold = ColdTier(tmp_path / "cold")
    node = NodeId(os.urandom(16), os.urandom(16), 0, 1024)
    ref = cold.write(node, snaps)
    raw = bytearray(cold.absolute(ref.path).read_bytes())
    assert len(raw) >= 2 * PARALLEL_HASH_BYTES
    if damaged is None:
        got = load_bytes(memoryview(bytes(raw)), node, "fetched")
        for a, b in zip(cold.load(ref.path, node), got):
            assert all(mx.array_equal(a.arrays[k], b.arrays[k]).item() for k in a.arrays)
        return
    raw[len(raw) // 2 if damaged == "middle" else len(raw) - 5] ^= 0x01  # inside an array's bytes
    with pytest.raises(ColdFileError) as raised:
        load_bytes(memoryview(bytes(raw)), node, "fetched")
    assert raised.value.reason == "checksum"


class _Refuses(reader.HostWrites):
    """A placement the device refuses (as a CUDA runtime error would)."""

    def read(self, fill, offset, nbytes, view):
        raise reader.device.CudaError("cudaMemcpyAsync failed (CUDA error 700)")


class _Elsewhere(reader.HostWrites):
    """Hashes the right bytes, which never reach the arrays (copies to a wrong address)."""

    def read(self, fill, offset, nbytes, view):
        return super().read(fill, offset, nbytes, memoryview(bytearray(nbytes)))


@pytest.mark.parametrize("placement", [_Refuses, _Elsewhere])
def test_bytes_the_reading_threads_fail_to_place_are_copied_instead(tmp_path, monkeypatch, caplog, placement):
    """Not the bytes' fault: the same verified snapshots, through MLX's copy."""
    monkeypatch.setattr(cold_module, "PARALLEL_READS", True)
    monkeypatch.setattr(reader, "failed", None)
    monkeypatch.setattr(reader, "destination", placement)
    model = tiny_model("llama", num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    cache = fresh_cache(model)
    forward(model, cache, prompt_tokens(40, seed=71))
    snaps = snapshot_prompt_cache(cache, 0)
    tier = ColdTier(tmp_path / "cold")
    node = NodeId(os.urandom(16), os.urandom(16), 0, 40)
    ref = tier.write(node, snaps)
    got = load_bytes(memoryview(tier.absolute(ref.path).read_bytes()), node, "fetched")
    for a, b in zip(snaps, got):
        assert all(mx.array_equal(a.arrays[k], b.arrays[k]).item() for k in a.arrays)
    assert "the bytes are copied into MLX" in caplog.text


# --- a chain held in part ------------------------------------------------------------------


def publish_chain(path, url, model, tokens, ends, piece_bytes=PIECE):
    """Store A: a node per end (each inserted as the prefill reaches it), published in pieces."""
    with promptstore.PromptStore.open(path, remote_url=url) as store:
        store.remote.piece_bytes = piece_bytes
        space = store.bind(model, model_id="m")
        cache, at = space.new_cache(), 0
        for end in ends:
            forward(model, cache, tokens[at:end])
            space.insert(tokens[:end], cache)
            at = end


def fetched(store) -> tuple[int, int]:
    counts = store.remote.counts
    return counts["remote_fetched_values"], counts["remote_fetched_bytes"]


def blob_sizes(clients) -> dict[bytes, int]:
    return {k: c.strlen(k) for c in clients for k in c.scan_iter(match=BLOB_PREFIX + "*", count=1000)}


def _server(request, kind):
    if kind == "single":
        server = request.getfixturevalue("redis_server")
        return server.url, [server.client()]
    cluster = request.getfixturevalue("redis_cluster")
    return cluster.url, [s.client() for s in cluster.primaries()]


@pytest.mark.parametrize(
    "family,kind", [("llama", "single"), ("qwen3_next", "single"), ("gemma3_text", "single"), ("llama", "cluster")]
)
def test_a_chain_held_in_part_fetches_only_the_rest(tmp_path, request, model_of, family, kind):
    url, clients = _server(request, kind)
    model = model_of(family)
    tokens = prompt_tokens(SECOND + 20, seed=71)
    publish_chain(tmp_path / "a", url, model, tokens, [FIRST, SECOND])
    sizes = blob_sizes(clients)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=url) as b:
        space = b.bind(model, model_id="m")
        # An earlier, shorter prompt brought the first node here.
        first = space.fetch(tokens[: FIRST + 20])
        assert (first.length, first.remote_tokens) == (FIRST, FIRST)
        values, nbytes = fetched(b)
        assert 0 < values < len(sizes) and 0 < nbytes < sum(sizes.values())
        hit = space.fetch(tokens)
        assert (hit.length, hit.remote_tokens) == (SECOND, SECOND - FIRST), "the hit covers the whole prefix"
        # Only the second node's pieces came: every byte on the server, less the first's.
        assert fetched(b) == (len(sizes), sum(sizes.values()))
        assert hit.nbytes == sum(sizes.values()) - nbytes
        assert b.remote.counts["remote_links_local"] == 1
        assert not b.reports
        assert_faithful(model, hit, tokens)
        # Kept here as A cut it: a node per link, so the next hit is local.
        spans = sorted((n.start, n.end) for n in b.index.iter_nodes(space.namespace))
        assert spans == [(0, FIRST), (FIRST, SECOND)]
        again = space.fetch(tokens)
        assert (again.length, again.remote_tokens) == (SECOND, 0)
        assert fetched(b) == (len(sizes), sum(sizes.values()))


def test_a_remote_fetch_stages_no_file(tmp_path, redis_server, model_of, monkeypatch):
    """Nothing is created on disk while a remote hit is fetched, verified and kept
    (the node goes to disk later, by the normal spill path), and what is kept
    restores after a restart."""
    model = model_of("llama")
    tokens = prompt_tokens(SECOND + 20, seed=72)
    publish_chain(tmp_path / "a", redis_server.url, model, tokens, [SECOND])
    created = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            created.append(str(path))
        return real_open(path, flags, *args, **kwargs)

    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        space = b.bind(model, model_id="m")
        monkeypatch.setattr(os, "open", recording_open)
        hit = space.fetch(tokens)
        monkeypatch.undo()
        assert hit.remote_tokens == SECOND and not b.reports
        assert not [p for p in created if str(tmp_path / "b") in p], created
        assert not list(b.tiers.cold.iter_temp_files()) and not list(b.tiers.cold.iter_files())
        assert_faithful(model, hit, tokens)
    with promptstore.PromptStore.open(tmp_path / "b") as b:
        assert not list(b.tiers.cold.iter_temp_files())
        hit = b.bind(model, model_id="m").fetch(tokens)
        assert (hit.length, hit.remote_tokens, hit.cold_nodes) == (SECOND, 0, 1)
        assert_faithful(model, hit, tokens)


@pytest.mark.parametrize("fault", ["flipped", "deleted", "truncated", "swapped"])
def test_a_bad_piece_of_the_rest_is_a_miss_that_changes_nothing(tmp_path, redis_server, model_of, fault):
    """B holds the first node; a piece of the second is bad: B's hit is its own first
    node, a reported miss is all the remote tier adds, and B's store is as it was."""
    model = model_of("llama")
    tokens = prompt_tokens(SECOND + 20, seed=73)
    client = redis_server.client()
    publish_chain(tmp_path / "a", redis_server.url, model, tokens[:FIRST], [FIRST])
    first_pieces = set(blob_sizes([client]))
    publish_chain(tmp_path / "a", redis_server.url, model, tokens, [FIRST, SECOND])
    rest = sorted(set(blob_sizes([client])) - first_pieces)
    assert len(rest) > 2
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        space = b.bind(model, model_id="m")
        assert space.fetch(tokens[: FIRST + 20]).remote_tokens == FIRST
        b.flush()
        before = _state(b, space)
        victim = rest[len(rest) // 2]
        if fault == "flipped":
            value = bytearray(client.get(victim))
            value[len(value) // 2] ^= 0x01
            client.set(victim, bytes(value))
        elif fault == "deleted":
            client.delete(victim)
        elif fault == "truncated":
            client.set(victim, client.get(victim)[:-10])
        else:
            other = rest[0] if victim != rest[0] else rest[1]
            a, c = client.get(victim), client.get(other)
            client.set(victim, c)
            client.set(other, a)
        hit = space.fetch(tokens)
        assert (hit.length, hit.remote_tokens) == (FIRST, 0), "the local first node, nothing of the bad one"
        assert {r.reason for r in b.reports} == {"remote_missing" if fault == "deleted" else "remote_garbage"}
        b.flush()
        assert _state(b, space) == before
        assert_faithful(model, hit, tokens)


def _state(store, space) -> tuple:
    """What the store holds: nodes and their spans, hot keys, files on disk."""
    nodes = sorted((n.key, n.start, n.end) for n in store.index.iter_nodes(space.namespace))
    return nodes, sorted(store.tiers.hot.entries), sorted(store.tiers.cold.iter_files())
