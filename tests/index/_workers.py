"""Code run in spawned processes by test_multiprocess (importable, so spawn can find it)."""

from __future__ import annotations

import traceback

from promptstore.index import Index, NodeRecord

from .conftest import SPECS

MAP_SIZE = 64 << 10  # tiny, so the map grows while the other process has it open


def open_store(path: str):
    ix = Index.open(path, map_size=MAP_SIZE, sync=False)
    return ix, ix.register_namespace(SPECS[1])


def check_consistent(match, seq) -> None:
    """A lookup seen mid-insert: spans contiguous from 0 and tokens equal to the query."""
    starts, ends = [n.start for n in match.path], [n.end for n in match.path]
    assert starts == [0, *ends][: len(starts)], match
    got = tuple(int(t) for n in match.path for t in n.tokens)[: match.matched]
    assert got == tuple(seq[: match.matched]), (got, seq, match)
    assert not match.corrupt, match


def insert_all(ix, ns, seqs, probes) -> None:
    """Insert `seqs`, checking a probe lookup between inserts."""
    record = NodeRecord.blank(ns)
    for i, seq in enumerate(seqs):
        ix.insert(ns, seq, record, split_records=(record, record))
        probe = probes[i % len(probes)]
        check_consistent(ix.lookup(ns, probe), probe)


def summary(ix, ns, queries) -> list[tuple]:
    out = []
    for q in queries:
        m = ix.lookup(ns, q)
        out.append((m.matched, [(n.start, n.end) for n in m.path], m.restorable))
    return out


def writer(path: str, seqs, probes, queries, start, other_done, results) -> None:
    ix, ns = open_store(path)
    try:
        start.wait(60)  # both processes begin inserting together
        insert_all(ix, ns, seqs, probes)
        other_done.wait(60)
        results.put(("ok", summary(ix, ns, queries)))
    except Exception as e:  # noqa: BLE001 - any failure goes back to the parent
        results.put(("error", "".join(traceback.format_exception(e))))
    finally:
        ix.close()
