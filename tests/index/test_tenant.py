"""Tenant salts on disk (issue 16, defect 3). Before the fix a namespace's spec was
stored with its salt in clear, so anyone who could read data.mdb had every tenant's
secret. Now a namespace holds only tenant_digest(salt): scrypt keyed by a random key
of the store. Stores of schema 1 still open: their salted namespaces are dropped at
the first writable open (unsalted ones keep their keys and nodes)."""

from __future__ import annotations

import json

import lmdb
import pytest

from promptstore.errors import ReadOnlyIndexError
from promptstore.index import Index, NamespaceSpec, env

from .conftest import SPECS, full

SALT = "s3cret-tenant-salt-4711"


def salted(index: Index, salt: str = SALT) -> NamespaceSpec:
    return SPECS[0].model_copy(update={"tenant": index.tenant_digest(salt)})


def every_value(path) -> list[bytes]:
    """Every key and value of every database in the index at `path`."""
    raw = lmdb.open(str(path), max_dbs=16, readonly=True, lock=False)
    try:
        out = []
        with raw.begin() as txn:
            names = [bytes(k) for k in txn.cursor().iternext(values=False)]
        for name in names:
            db = raw.open_db(name, create=False)
            with raw.begin() as txn:
                out += [bytes(x) for kv in txn.cursor(db=db) for x in kv]
        return out
    finally:
        raw.close()


def test_no_salt_is_written(tmp_path):
    path = tmp_path / "index"
    with Index.open(path, sync=False) as ix:
        ns = ix.register_namespace(salted(ix))
        ix.insert(ns, [1, 2, 3], full(ns))
        assert ix.namespace(ns.key).spec.tenant == ix.tenant_digest(SALT)
    assert SALT.encode() not in (path / "data.mdb").read_bytes()
    assert not any(SALT.encode() in value for value in every_value(path))


def test_the_digest_is_keyed_per_store_and_stable(tmp_path):
    with Index.open(tmp_path / "a", sync=False) as a, Index.open(tmp_path / "b", sync=False) as b:
        first = a.tenant_digest(SALT)
        assert first != b.tenant_digest(SALT)  # one guess tests one store
        assert first != a.tenant_digest(SALT + "x")
        ns = a.register_namespace(salted(a))
        a.insert(ns, [4, 5], full(ns))
    with Index.open(tmp_path / "a", sync=False) as a:
        assert a.tenant_digest(SALT) == first
        assert a.lookup(a.register_namespace(salted(a)), [4, 5]).matched == 2
    with Index.open(tmp_path / "a", readonly=True) as ro:
        assert ro.tenant_digest(SALT) == first


def test_a_readonly_index_without_a_tenant_key_cannot_make_one(tmp_path):
    with Index.open(tmp_path / "index", sync=False):
        pass
    with Index.open(tmp_path / "index", readonly=True) as ro, pytest.raises(ReadOnlyIndexError):
        ro.tenant_digest(SALT)


def test_spec_refuses_a_clear_salt():
    with pytest.raises(ValueError):
        NamespaceSpec.model_validate({"model_id": "m", "layers": [{"kind": "kv"}], "salt": SALT})
    with pytest.raises(ValueError):
        NamespaceSpec(model_id="m", layers=[{"kind": "kv"}], tenant=SALT)  # not a digest
    old = NamespaceSpec.model_validate({"model_id": "m", "layers": [{"kind": "kv"}], "salt": None})
    assert old == NamespaceSpec(model_id="m", layers=[{"kind": "kv"}])


def test_unsalted_fingerprints_are_those_schema_1_wrote():
    # Written by the schema-1 code (dd4fc98) for these specs: nodes of unsalted
    # namespaces in older stores stay reachable.
    assert [s.fingerprint_hex() for s in SPECS[:2]] == [
        "6c670ae6e10a0bef1d70738f6ea9c4d0",
        "c7cf1f49eba3733546a0b5910684a23f",
    ]


def as_schema_1(path, salts: dict[bytes, str | None]) -> None:
    """Rewrite the index at `path` as schema-1 code left it: version 1, no tenant key,
    and each namespace's spec as it was stored then ({"salt": <clear or null>})."""
    raw = lmdb.open(str(path), max_dbs=16)
    try:
        with raw.begin(write=True) as txn:
            meta, spaces = raw.open_db(b"meta", txn=txn), raw.open_db(b"namespaces", txn=txn)
            txn.put(env.SCHEMA_KEY, b"1", db=meta)
            txn.delete(b"tenant_key", db=meta)
            for key, salt in salts.items():
                spec = json.loads(txn.get(key, db=spaces))
                spec.pop("tenant")
                spec["salt"] = salt
                txn.put(key, json.dumps(spec, separators=(",", ":")).encode(), db=spaces)
    finally:
        raw.close()


def test_a_schema_1_index_opens_and_drops_its_salted_namespaces(tmp_path, caplog):
    path = tmp_path / "index"
    with Index.open(path, sync=False) as ix:
        plain = ix.register_namespace(SPECS[0])
        secret = ix.register_namespace(salted(ix))
        for ns in (plain, secret):
            for tokens in ([1, 2, 3], [1, 2, 9, 9], [7]):  # the second splits the first
                ix.insert(ns, tokens, full(ns, nbytes=5), split_records=(full(ns), full(ns)))
            ix.touch([n.key for n in ix.iter_nodes(ns)])
    as_schema_1(path, {plain.key: None, secret.key: SALT})
    assert SALT.encode() in (path / "data.mdb").read_bytes()
    # Read-only, nothing changes: the salted spec is skipped, the unsalted one served.
    with Index.open(path, readonly=True) as ro:
        assert [ns.key for ns in ro.namespaces()] == [plain.key]
        assert ro.lookup(plain, [1, 2, 3]).matched == 3
    with Index.open(path, sync=False) as ix:
        assert "dropped 1 namespaces" in caplog.text
        assert [ns.key for ns in ix.namespaces()] == [plain.key]
        assert ix.lookup(ix.register_namespace(SPECS[0]), [1, 2, 9, 9]).matched == 4
        assert ix.counters(plain)["nodes"] == 4 and ix.stats()["node_entries"] == 4
        assert ix.counters(secret) == dict.fromkeys(ix.counters(secret), 0)
        assert {n.namespace for n in ix.iter_by_access()} == {plain.key}
        # Binding the same salt now is a new, empty namespace.
        again = ix.register_namespace(salted(ix))
        assert again.key != secret.key and ix.lookup(again, [1, 2, 3]).matched == 0
    assert not any(SALT.encode() in value for value in every_value(path))
    with Index.open(path, readonly=True) as ro, ro._env.read() as txn:
        assert bytes(txn.get(env.SCHEMA_KEY, db=ro._env.dbs.meta)) == str(env.SCHEMA_VERSION).encode()
    # The bytes may linger on freed pages until a compacting copy rewrites the file.
    Index.compact_in_place(path)
    assert SALT.encode() not in (path / "data.mdb").read_bytes()
