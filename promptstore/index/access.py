"""Access order: which nodes were used least recently, for eviction.

Each node has one stamp from a persistent counter; the access db maps stamp -> key
(so oldest-first is a cursor scan) and key -> stamp (so a touch can drop the old one).
"""

from __future__ import annotations

import struct

import lmdb

from .env import Dbs

_STAMP = struct.Struct(">Q")  # big-endian so stamps sort numerically
_BY_STAMP = b"s"
_BY_KEY = b"k"
_COUNTER_KEY = b"access_stamp"  # in meta


def stamp(txn: lmdb.Transaction, dbs: Dbs, key: bytes) -> None:
    """Move `key` to the newest end of the access order."""
    forget(txn, dbs, key)
    last = txn.get(_COUNTER_KEY, db=dbs.meta)
    next_stamp = _STAMP.pack((_STAMP.unpack(last)[0] if last is not None else 0) + 1)
    txn.put(_COUNTER_KEY, next_stamp, db=dbs.meta)
    txn.put(_BY_STAMP + next_stamp, key, db=dbs.access)
    txn.put(_BY_KEY + key, next_stamp, db=dbs.access)


def forget(txn: lmdb.Transaction, dbs: Dbs, key: bytes) -> None:
    old = txn.pop(_BY_KEY + key, db=dbs.access)
    if old is not None:
        txn.delete(_BY_STAMP + bytes(old), db=dbs.access)


def oldest(txn: lmdb.Transaction, dbs: Dbs, after: bytes | None, limit: int) -> list[tuple[bytes, bytes]]:
    """Up to `limit` (stamp, key) pairs, oldest first, strictly after stamp `after`."""
    cursor = txn.cursor(db=dbs.access)
    start = _BY_STAMP + (after if after is not None else b"")
    if not cursor.set_range(start):
        return []
    out: list[tuple[bytes, bytes]] = []
    for k, v in cursor:
        k = bytes(k)
        if not k.startswith(_BY_STAMP) or len(out) >= limit:
            break
        if after is None or k[1:] != after:
            out.append((k[1:], bytes(v)))
    return out
