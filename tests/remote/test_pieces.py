"""Blobs in pieces: a node larger than a piece is stored as several values, each
sealed to its key, index and count; it round-trips, and a piece deleted, swapped,
taken from another node or from another publish of the node is a reported miss,
never a partial restore."""

import pytest

import promptstore
from promptstore.snapshots.remote.keys import BLOB_PREFIX

from ..conftest import forward, prompt_tokens
from .helpers import assert_faithful

PIECE = 1 << 16  # the node of 280 tokens below is about 150 KB: three pieces


def publish_in_pieces(path, url, model, tokens, piece_bytes=PIECE) -> dict:
    with promptstore.PromptStore.open(path, remote_url=url) as store:
        store.remote.piece_bytes = piece_bytes
        space = store.bind(model, model_id="m")
        cache = space.new_cache()
        forward(model, cache, tokens)
        space.insert(tokens, cache)
        remote = store.remote
    return dict(remote.counts)


def blobs(client) -> dict[bytes, bytes]:
    return {key: client.get(key) for key in client.scan_iter(match=BLOB_PREFIX + "*", count=1000)}


def fetch(path, url, model, tokens):
    """B's hit, and the reasons of what B reported."""
    with promptstore.PromptStore.open(path, remote_url=url) as b:
        space = b.bind(model, model_id="m")
        hit = space.fetch(tokens)
        stored = list(b.index.iter_nodes(space.namespace))
        return hit, {r.reason for r in b.reports}, stored


def test_a_node_larger_than_a_piece_round_trips(tmp_path, redis_server, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=61)
    counts = publish_in_pieces(tmp_path / "a", redis_server.url, model, tokens[:280])
    assert counts["remote_published"] == 1
    values = blobs(redis_server.client())
    assert len(values) > 1 and all(len(v) <= PIECE + 64 for v in values.values())
    hit, reasons, _ = fetch(tmp_path / "b", redis_server.url, model, tokens)
    assert (hit.length, hit.remote_tokens) == (280, 280) and not reasons
    assert hit.nbytes == sum(len(v) for v in values.values())
    assert_faithful(model, hit, tokens)


def test_a_small_node_stays_one_value(tmp_path, redis_server, model_of):
    """Below the piece size a blob is one value at the blob's key, as before pieces."""
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=62)
    publish_in_pieces(tmp_path / "a", redis_server.url, model, tokens[:280], piece_bytes=32 << 20)
    assert len(blobs(redis_server.client())) == 1
    hit, _, _ = fetch(tmp_path / "b", redis_server.url, model, tokens)
    assert hit.remote_tokens == 280
    assert_faithful(model, hit, tokens)


@pytest.mark.parametrize("fault", ["delete", "swap", "truncate"])
def test_a_deleted_or_swapped_piece_is_a_reported_miss(tmp_path, redis_server, model_of, fault):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=63)
    publish_in_pieces(tmp_path / "a", redis_server.url, model, tokens[:280])
    client = redis_server.client()
    names = sorted(blobs(client), key=lambda k: client.strlen(k))  # the last piece is the shortest
    if fault == "delete":
        client.delete(names[-1])
    elif fault == "swap":  # two pieces of one blob, each at the other's key
        a, b = client.get(names[-1]), client.get(names[-2])
        client.set(names[-1], b)
        client.set(names[-2], a)
    else:  # a piece cut short
        client.set(names[-1], client.get(names[-1])[:-100])
    hit, reasons, stored = fetch(tmp_path / "b", redis_server.url, model, tokens)
    assert hit.length == 0
    assert reasons == {"remote_missing" if fault == "delete" else "remote_garbage"}
    assert not stored, "nothing of an incomplete blob is stored"
    if fault != "delete":
        return  # a bad value stays until evicted or overwritten, as a blob in one value does
    # A piece gone: the next publish of the node (from another store) sends the whole blob again.
    publish_in_pieces(tmp_path / "a2", redis_server.url, model, tokens[:280])
    hit, reasons, _ = fetch(tmp_path / "b2", redis_server.url, model, tokens)
    assert hit.remote_tokens == 280 and not reasons
    assert_faithful(model, hit, tokens)


def test_a_piece_of_another_node_or_publish_is_a_miss(tmp_path, redis_server, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=64)
    client = redis_server.client()
    publish_in_pieces(tmp_path / "first", redis_server.url, model, tokens[:280])
    first = blobs(client)
    piece = max(first, key=client.strlen)  # a full-size piece
    # Another node's piece of the same size, at this node's key.
    publish_in_pieces(tmp_path / "other", redis_server.url, model, prompt_tokens(300, seed=65)[:280])
    theirs = [k for k in blobs(client) if k not in first and client.strlen(k) == client.strlen(piece)]
    client.set(piece, client.get(theirs[0]))
    hit, reasons, _ = fetch(tmp_path / "b", redis_server.url, model, tokens)
    assert hit.length == 0 and reasons == {"remote_garbage"}
    # Another publish of the same node (another replica: another random set id): a piece
    # of the first publish among its pieces opens at its key, and still is a miss.
    client.flushall()
    publish_in_pieces(tmp_path / "second", redis_server.url, model, tokens[:280])
    assert set(blobs(client)) == set(first)
    client.set(piece, first[piece])
    hit, reasons, _ = fetch(tmp_path / "b2", redis_server.url, model, tokens)
    assert hit.length == 0 and reasons == {"remote_garbage"}
