"""Upgrades of an index written by an older schema, run by its first writable open.

Schema 2 differs from 3 only in what 3 may write (records naming a file of a
wider span, NodeRecord.file_node): its index is 3's as it is. Schema 1 stored each namespace's spec with its tenant salt in clear. Those
namespaces are dropped, not kept: their keys derive from the salt by a fast hash
(so any of their nodes left behind keeps the salt guessable), and no bind under
schema 2 reaches them (it derives a namespace from a keyed, slow digest of the
salt). Their snapshot files become orphans that compact reclaims, and the LMDB
pages that held the salt are gone after compact's compacting copy.
"""

from __future__ import annotations

import json
import logging

import lmdb

from . import trie
from .env import SCHEMA_KEY, SCHEMA_VERSION, Dbs, Environment

log = logging.getLogger("promptstore.index")


def upgrade(environment: Environment) -> None:
    """Bring the index to SCHEMA_VERSION (a no-op, one read, when it is there)."""
    with environment.read() as txn:
        if bytes(txn.get(SCHEMA_KEY, db=environment.dbs.meta) or b"") == str(SCHEMA_VERSION).encode():
            return
    dropped = environment.write(lambda txn, _: _upgrade(txn, environment.dbs))
    if dropped:
        log.warning(
            "dropped %d namespaces that held a tenant salt in clear (schema 1); "
            "tools/compact reclaims their files and scrubs the freed index pages",
            dropped,
        )


def _upgrade(txn: lmdb.Transaction, dbs: Dbs) -> int:
    found = txn.get(SCHEMA_KEY, db=dbs.meta)
    if found is not None and bytes(found) == str(SCHEMA_VERSION).encode():
        return 0  # another process upgraded it meanwhile
    salted = [bytes(k) for k, v in txn.cursor(db=dbs.namespaces) if _clear_salt(bytes(v))]
    for key in salted:
        trie.drop_namespace(txn, dbs, key)
    txn.put(SCHEMA_KEY, str(SCHEMA_VERSION).encode(), db=dbs.meta)
    return len(salted)


def _clear_salt(stored: bytes) -> bool:
    try:
        spec = json.loads(stored)
    except ValueError:  # damaged: drop it if it may still hold a salt
        return b'"salt":' in stored and b'"salt":null' not in stored
    return isinstance(spec, dict) and spec.get("salt") is not None
