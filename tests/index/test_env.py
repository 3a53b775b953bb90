"""The LMDB environment: schema version, sharing within a process, read-only use, map growth."""

from __future__ import annotations

import os
import stat
import threading

import lmdb
import pytest

from promptstore.errors import IndexStoreError, ReadOnlyIndexError, SchemaVersionError
from promptstore.index import Index, NodeRecord, env

from .conftest import SPECS, full


def test_directory_is_private(tmp_path):
    with Index.open(tmp_path / "store" / "index", sync=False):
        pass
    assert stat.S_IMODE(os.stat(tmp_path / "store" / "index").st_mode) == 0o700


def test_one_environment_per_path_per_process(tmp_path):
    a = Index.open(tmp_path / "index", sync=False)
    b = Index.open(tmp_path / "index", sync=False)
    assert a._env is b._env and a._env.refs == 2
    ns = a.register_namespace(SPECS[0])
    a.close()
    b.insert(ns, [1, 2], full(ns))  # still open for b
    b.close()
    assert os.path.realpath(tmp_path / "index") not in env._registry
    with pytest.raises(IndexStoreError):
        b.lookup(ns, [1])


def _write_meta(path, value: bytes) -> None:
    raw = lmdb.open(str(path), max_dbs=8)
    with raw.begin(write=True) as txn:
        txn.put(env.SCHEMA_KEY, value, db=raw.open_db(b"meta", txn=txn))
    raw.close()


@pytest.mark.parametrize("found", [b"4", b"999", b"x1"])
def test_unknown_schema_is_refused(tmp_path, found):
    path = tmp_path / "index"
    with Index.open(path, sync=False) as ix:
        ix.register_namespace(SPECS[0])
    _write_meta(path, found)
    for readonly in (False, True):
        with pytest.raises(SchemaVersionError) as err:
            Index.open(path, readonly=readonly)
        assert err.value.found == found.decode() and err.value.expected == env.SCHEMA_VERSION
        assert found.decode() in str(err.value)


def test_newer_store_is_not_touched(tmp_path):
    path = tmp_path / "index"
    _write_meta(path, b"4")
    with pytest.raises(SchemaVersionError):
        Index.open(path)
    raw = lmdb.open(str(path), max_dbs=8)
    with raw.begin() as txn:
        assert [bytes(k) for k in txn.cursor().iternext(values=False)] == [b"meta"]
    raw.close()


def test_readonly_reads_and_refuses_writes(tmp_path):
    path = tmp_path / "index"
    with Index.open(path, sync=False) as ix:
        kv = ix.register_namespace(SPECS[0])
        ix.insert(kv, [1, 2, 3], full(kv))
    with Index.open(path, readonly=True) as ro:
        assert ro.register_namespace(SPECS[0]) == kv
        assert ro.lookup(kv, [1, 2, 3]).matched == 3
        with pytest.raises(ReadOnlyIndexError):
            ro.insert(kv, [4], full(kv))
        with pytest.raises(ReadOnlyIndexError):
            ro.touch([b"x" * 16])
    with pytest.raises(IndexStoreError):
        Index.open(tmp_path / "nowhere", readonly=True)


def test_foreign_lmdb_is_refused(tmp_path):
    raw = lmdb.open(str(tmp_path / "other"))
    with raw.begin(write=True) as txn:
        txn.put(b"someone", b"else")
    raw.close()
    with pytest.raises(IndexStoreError):
        Index.open(tmp_path / "other")


def test_map_grows_when_full(tmp_path):
    path = tmp_path / "index"
    with Index.open(path, map_size=64 << 10, sync=False) as ix:
        kv = ix.register_namespace(SPECS[0])
        start = ix.stats()["map_size"]
        seqs = [[i] + list(range(1000, 1300)) for i in range(200)]
        for seq in seqs:
            ix.insert(kv, seq, NodeRecord.blank(kv, nbytes=1))
        grown = ix.stats()
        assert grown["map_size"] > start and grown["used_bytes"] > 64 << 10
    with Index.open(path, map_size=64 << 10, sync=False) as ix:
        assert all(ix.lookup(kv, seq).matched == 301 for seq in seqs)
        ix.insert(kv, [5000] * 2000, NodeRecord.blank(kv))  # grows again from the small map
        assert ix.counters(kv)["nodes"] == 201


def test_one_transaction_larger_than_the_map(tmp_path):
    """Early growth cannot help here: the write fails full, grows and retries."""
    with Index.open(tmp_path / "index", map_size=64 << 10, sync=False) as ix:
        kv = ix.register_namespace(SPECS[0])
        seq = list(range(100_000))  # 400 KB of edge tokens
        assert ix.insert(kv, seq, full(kv)).stored == 100_000
        assert ix.lookup(kv, seq).matched == 100_000
        assert ix.stats()["map_size"] >= 512 << 10


def test_threads_read_while_the_map_grows(tmp_path):
    """Growing the map invalidates open transactions; readers in other threads must
    wait for it rather than read through a stale mapping."""
    with Index.open(tmp_path / "index", map_size=64 << 10, sync=False) as ix:
        kv = ix.register_namespace(SPECS[0])
        ix.insert(kv, [7] * 50, full(kv))
        stop, errors = threading.Event(), []

        def read() -> None:
            try:
                while not stop.is_set():
                    assert ix.lookup(kv, [7] * 60).matched == 50
            except Exception as e:  # noqa: BLE001 - surfaced by the assert below
                errors.append(e)

        readers = [threading.Thread(target=read) for _ in range(3)]
        for t in readers:
            t.start()
        for i in range(150):
            ix.insert(kv, [i % 7, i] + list(range(300)), full(kv), (full(kv), full(kv)))
        stop.set()
        for t in readers:
            t.join()
        assert not errors and ix.stats()["map_size"] > 64 << 10
