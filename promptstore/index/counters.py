"""Per-namespace counters that persist: hits, misses, tokens served and stored, totals.

Insert, remove and update_record keep nodes, nbytes and tokens_stored; callers
bump hits, misses and tokens_served.
"""

from __future__ import annotations

import struct

import lmdb

from .env import Dbs

NAMES = ("hits", "misses", "tokens_served", "tokens_stored", "nodes", "nbytes")
_VALUE = struct.Struct("<q")


def check_names(deltas: dict[str, int]) -> None:
    unknown = sorted(set(deltas) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown counters {unknown}; known: {list(NAMES)}")


def add(
    txn: lmdb.Transaction, dbs: Dbs, namespace: bytes, deltas: dict[str, int]
) -> None:
    for name, delta in deltas.items():
        if not delta:
            continue
        key = namespace + name.encode()
        old = txn.get(key, db=dbs.counters)
        value = (_VALUE.unpack(old)[0] if old is not None else 0) + int(delta)
        txn.put(key, _VALUE.pack(value), db=dbs.counters)


def read(txn: lmdb.Transaction, dbs: Dbs, namespace: bytes) -> dict[str, int]:
    out = {}
    for name in NAMES:
        raw = txn.get(namespace + name.encode(), db=dbs.counters)
        out[name] = _VALUE.unpack(raw)[0] if raw is not None else 0
    return out
