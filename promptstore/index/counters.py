"""Per-namespace counters that persist: hits, misses, tokens served and stored, totals.

Insert, remove and update_record keep nodes, nbytes and tokens_stored; callers
bump hits, misses, tokens_served, the checkpoint counters and the disk bytes
written and read.
"""

from __future__ import annotations

import struct

import lmdb

from .env import Dbs

NAMES = (
    "hits",
    "misses",
    "tokens_served",
    "tokens_stored",
    "nodes",
    "nbytes",
    # Checkpoints (recurrent states at prefill-grid positions): what they cost and save.
    "checkpoints",
    "checkpoint_bytes",
    "checkpoints_dropped",
    "checkpoint_bytes_dropped",
    "checkpoint_hits",
    "checkpoint_tokens",
    # What wears a disk, against what it saved: bytes of node files written (spills),
    # rewritten by compact's joins, and read back (cold hits, warm starts).
    "disk_written_bytes",
    "compact_written_bytes",
    "disk_read_bytes",
)
_VALUE = struct.Struct("<q")


def _value(raw) -> int:
    # Counters are advisory: a damaged one reads as 0 and is rewritten (compact recounts).
    return _VALUE.unpack(raw)[0] if raw is not None and len(raw) == _VALUE.size else 0


def check_names(deltas: dict[str, int]) -> None:
    unknown = sorted(set(deltas) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown counters {unknown}; known: {list(NAMES)}")


def add(txn: lmdb.Transaction, dbs: Dbs, namespace: bytes, deltas: dict[str, int]) -> None:
    for name, delta in deltas.items():
        if not delta:
            continue
        key = namespace + name.encode()
        value = _value(txn.get(key, db=dbs.counters)) + int(delta)
        txn.put(key, _VALUE.pack(value), db=dbs.counters)


def read(txn: lmdb.Transaction, dbs: Dbs, namespace: bytes) -> dict[str, int]:
    out = {}
    for name in NAMES:
        out[name] = _value(txn.get(namespace + name.encode(), db=dbs.counters))
    return out
