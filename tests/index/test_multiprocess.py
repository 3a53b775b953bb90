"""Two processes share one store: both insert, one looks up meanwhile, both agree after."""

from __future__ import annotations

import multiprocessing
import random

from . import _workers
from .reference import RefTrie


def _sequences(seed: int, n: int) -> list[tuple]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 12))) for _ in range(n)]


def test_two_processes_share_one_store(tmp_path):
    path = str(tmp_path / "index")
    mine, theirs = _sequences(1, 300), _sequences(2, 300)
    queries = _sequences(3, 100) + mine[:20] + theirs[:20]
    ctx = multiprocessing.get_context("spawn")
    start, done, results = ctx.Barrier(2), ctx.Event(), ctx.Queue()
    ix, ns = _workers.open_store(path)
    try:
        child = ctx.Process(
            target=_workers.writer,
            args=(path, theirs, queries, queries, start, done, results),
        )
        child.start()
        start.wait(60)
        _workers.insert_all(ix, ns, mine, queries)
        while child.is_alive() and results.empty():
            for q in queries[:10]:
                _workers.check_consistent(ix.lookup(ns, q), q)
            done.set()
        status, theirs_summary = results.get(timeout=60)
        child.join(timeout=60)
        assert status == "ok", theirs_summary
        assert child.exitcode == 0
        ref = RefTrie(ns.roles)
        for seq in mine + theirs:
            full = (tuple(True for _ in ns.whole), 0)
            ref.insert(seq, full, full, full)
        want = [(ref.matched(q), ref.spans(q), ref.restorable(q)) for q in queries]
        assert _workers.summary(ix, ns, queries) == want
        assert theirs_summary == want
        assert ix.counters(ns)["nodes"] == len(ref.nodes)
        assert ix.stats()["map_size"] > _workers.MAP_SIZE
    finally:
        done.set()
        ix.close()
