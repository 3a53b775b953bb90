"""Bad tokens and damaged records: each a typed error, or a logged miss, never a crash."""

from __future__ import annotations

import logging
import struct

import lmdb
import numpy as np
import pytest

from promptstore.errors import CorruptRecordError, InvalidTokensError
from promptstore.index import Index, records

from .conftest import SPECS, full

BAD_TOKENS = [
    [],
    [-1],
    [1, 2, -5],
    [2**32],
    [1, 2**40],
    [1.5],
    [1, 2.0],
    [[1, 2], [3, 4]],
    [[1, 2], [3]],
    np.zeros((2, 2), dtype=np.int64),
    np.array([1.0, 2.0]),
    np.array([], dtype=np.uint32),
    np.array([-1], dtype=np.int32),
    "abc",
    b"abc",
    None,
    [None],
    ["1"],
    # Regression (issue 16): bools passed as the tokens 1 and 0.
    [True, False],
    [5, True],
    (False,),
    np.array([True, False]),
]


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=repr)
def test_bad_tokens_are_refused(index, spaces, tokens):
    kv = spaces[0]
    with pytest.raises(InvalidTokensError):
        index.lookup(kv, tokens)
    with pytest.raises(InvalidTokensError):
        index.plan_insert(kv, tokens)
    with pytest.raises(InvalidTokensError):
        index.insert(kv, tokens, full(kv))
    assert issubclass(InvalidTokensError, ValueError)


def test_largest_token_is_fine(index, spaces):
    kv = spaces[0]
    index.insert(kv, [0, 2**32 - 1], full(kv))
    assert index.lookup(kv, np.array([0, 2**32 - 1], dtype=np.uint64)).matched == 2


def _store(tmp_path):
    """Three nodes in a chain: [0, 3), [3, 6), [6, 9)."""
    path = tmp_path / "index"
    with Index.open(path, sync=False) as ix:
        kv = ix.register_namespace(SPECS[0])
        keys = [ix.insert(kv, list(range(end)), full(kv)).key for end in (3, 6, 9)]
    return path, kv, keys


def _damage(path, db: bytes, key: bytes, change) -> None:
    raw = lmdb.open(str(path), max_dbs=8)
    with raw.begin(write=True) as txn:
        handle = raw.open_db(db, txn=txn)
        value = txn.get(key, db=handle)
        if change is None:
            txn.delete(key, db=handle)
        else:
            txn.put(key, change(value), db=handle)
    raw.close()


def _flip(value: bytes) -> bytes:
    i = len(value) // 2
    return value[:i] + bytes([value[i] ^ 0x01]) + value[i + 1 :]


DAMAGE = {
    "garbage": (b"nodes", lambda v: b"\xde\xad\xbe\xef" * 7),
    "truncated": (b"nodes", lambda v: v[:20]),
    "one bit": (b"nodes", _flip),
    "record json": (b"nodes", lambda v: v[:-10] + b"!" * 10),
    "edge bit": (b"edges", _flip),
    "edge missing": (b"edges", None),
    "node missing": (b"nodes", None),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_node_is_a_reported_miss(tmp_path, caplog, how):
    path, kv, keys = _store(tmp_path)
    db, change = DAMAGE[how]
    _damage(path, db, keys[1], change)
    with (
        Index.open(path, sync=False) as ix,
        caplog.at_level(logging.WARNING, "promptstore.index"),
    ):
        match = ix.lookup(kv, list(range(9)))
        assert (match.matched, len(match.path), match.corrupt) == (3, 1, [keys[1]])
        assert keys[1].hex() in caplog.text
        assert ix.lookup(kv, [0, 1]).matched == 2  # the intact part still serves
        with pytest.raises(CorruptRecordError):
            ix.plan_insert(kv, list(range(12)))  # never writes around a damaged node
        if how != "node missing":
            with pytest.raises(CorruptRecordError):
                ix.get(keys[1])
        assert [n.key for n in ix.iter_nodes(kv)] == [keys[0]]
        assert keys[1] not in [n.key for n in ix.iter_by_access(kv)]


def test_mislinked_child_is_a_miss(tmp_path, caplog):
    """A children entry pointing at another node (say, a key collision that slipped in
    from elsewhere) costs a miss, never a match on the wrong tokens."""
    path = tmp_path / "index"
    with Index.open(path, sync=False) as ix:
        kv = ix.register_namespace(SPECS[0])
        ix.insert(kv, [1, 2, 3], full(kv))
        other = ix.insert(kv, [4, 2, 3], full(kv)).key
    _damage(path, b"children", kv.key + (1).to_bytes(4, "big"), lambda v: other)
    with (
        Index.open(path, sync=False) as ix,
        caplog.at_level(logging.WARNING, "promptstore.index"),
    ):
        match = ix.lookup(kv, [1, 2, 3])
        assert (match.matched, match.path, match.corrupt) == (0, [], [other])
        assert ix.lookup(kv, [4, 2, 3]).matched == 3


def test_record_that_verifies_but_does_not_validate(tmp_path):
    """Bytes that pass the checksum but not the schema (a buggy or foreign writer):
    the lookup still answers; reading the record is a typed error."""
    path, kv, keys = _store(tmp_path)
    edge = np.arange(3, 6, dtype="<u4").tobytes()

    def rewrite(value: bytes) -> bytes:
        body = value[records._HEADER.size + 1 :]
        bad = body.replace(b'"tier":"hot"', b'"tier":"odd"')
        unsummed = value[8 : records._HEADER.size + 1] + bad
        return struct.pack("<Q", records._checksum(unsummed, edge)) + unsummed

    _damage(path, b"nodes", keys[1], rewrite)
    with Index.open(path, sync=False) as ix:
        match = ix.lookup(kv, list(range(9)))
        assert match.matched == 9 and not match.corrupt
        with pytest.raises(CorruptRecordError):
            _ = match.path[1].record
        assert match.path[0].record.tier == "hot"


def test_damaged_namespace_spec_is_skipped(tmp_path, caplog):
    path, kv, _ = _store(tmp_path)
    _damage(path, b"namespaces", kv.key, lambda v: b"{not json")
    with Index.open(path, sync=False) as ix, caplog.at_level(logging.WARNING):
        assert ix.namespaces() == []
        assert kv.hex in caplog.text
        with pytest.raises(CorruptRecordError):
            ix.namespace(kv.key)


@pytest.mark.parametrize("how", ["entry deleted", "entry names a missing node", "entry names another node"])
def test_repair_children_rebuilds_entries_from_the_nodes(tmp_path, caplog, how):
    """A children entry that leads nowhere or to the wrong node stops every lookup there
    and refuses every insert through it; repair_children (compact) rebuilds it."""
    path, kv, keys = _store(tmp_path)
    entry = keys[0] + (3).to_bytes(4, "big")  # [0, 3) -> [3, 6)
    change = {
        "entry deleted": None,
        "entry names a missing node": lambda v: b"\x07" * 16,
        "entry names another node": lambda v: keys[2],
    }[how]
    _damage(path, b"children", entry, change)
    with Index.open(path, sync=False) as ix, caplog.at_level(logging.CRITICAL):
        assert ix.lookup(kv, list(range(9))).matched == 3
        assert ix.repair_children(dry_run=True) == 1
        assert ix.lookup(kv, list(range(9))).matched == 3  # a dry run changes nothing
        assert ix.repair_children() == 1
        match = ix.lookup(kv, list(range(9)))
        assert (match.matched, [n.key for n in match.path], match.corrupt) == (9, keys, [])
        assert ix.repair_children() == 0
        ix.insert(kv, list(range(12)), full(kv))  # inserts through it again
