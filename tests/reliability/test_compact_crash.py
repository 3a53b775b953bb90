"""Compact killed at random instants (issue 16: the probe's 30 SIGKILLs of
tools/compact, now a test and a soak section). Between kills a writer grows the
store turn by turn (chains to merge, splits, a budget to evict to); after each
kill the store opens and serves only verified state; a compact left to finish
repairs what the kills left, and the next one finds nothing to do."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.snapshots.cold import TEMP_MARK
from promptstore.store.compact import compact

from ..conftest import _model, forward
from ..store._crash_worker import MODEL_ID
from ..store.test_crash import SEQS, Checker

WORKER = Path(__file__).with_name("_compact_worker.py")
BUDGET = 160 << 10  # below what the writer stores: compact evicts too
OWN_WORK = {"merged chains", "over budget", "LMDB space"}


def grow(root: Path, rng: random.Random, inserts: int) -> None:
    """Insert random prefixes of the shared-prefix sequences, one turn at a time."""
    model = _model("llama")
    with PromptStore.open(root, durability="sync") as store:
        space = store.bind(model, model_id=MODEL_ID)
        for _ in range(inserts):
            seq = rng.choice(SEQS)
            n = rng.randint(2, seq.size)
            hit = space.fetch(seq[:n])
            forward(model, hit.cache, seq[hit.length : n])
            space.insert(seq[:n], hit.cache)


class Compaction:
    """One compact process, killed or let finish."""

    def __init__(self, root: Path):
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(root), str(BUDGET)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "imported", self.proc.stderr.read()[-2000:]

    def run_for(self, seconds: float) -> tuple[str, float]:
        """Let it work up to `seconds`, then SIGKILL it; returns ('killed' or how it
        ended, seconds it ran)."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "started"
        started = time.monotonic()
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        ran = time.monotonic() - started
        out, err = self.proc.communicate(timeout=60)
        ended = "killed" if self.proc.returncode == -9 else f"{self.proc.returncode} {out.strip()} {err[-500:]}"
        return ended, ran


def kill_compact(root: Path, kills: int, seed: int, stats) -> Checker:
    """Rounds of grow, then compact killed at a random instant of its work, then check,
    until `kills` kills; returns the checker. The instant is drawn over the length of the
    last compact that finished (the first one is let finish to measure it)."""
    rng = random.Random(seed)
    checker = Checker(seed)
    span = None
    while stats["killed"] < kills:
        grow(root, rng, 6)
        ended, ran = Compaction(root).run_for(3600 if span is None else rng.uniform(0.0, span))
        if ended != "killed" and not ended.startswith("0 done"):
            stats["compact_errors"] += 1  # it failed on its own
            checker.reports.append(("compact", ended))
        stats["killed" if ended == "killed" else "finished"] += 1
        span = span if ended == "killed" else ran
        checker.check(root)
    return checker


def repaired_for_good(root: Path) -> dict:
    """A compact left to finish, then a second one: what they report and leave."""
    first = compact(root, verify=True, max_bytes=BUDGET)
    second = compact(root, verify=True, max_bytes=BUDGET)
    with PromptStore.open(root, hot_bytes=0) as store:
        space = store.bind(_model("llama"), model_id=MODEL_ID)
        named = {n.record.file for n in store.index.iter_nodes(space.namespace) if n.record.file}
    on_disk = {str(p.relative_to(root / "cold")) for p in (root / "cold" / "files").rglob("*.safetensors")}
    return {
        "first": first.status,
        "second": second.status,
        # What a crash can leave; merges, evictions and LMDB space are compact's own work.
        "second_repairs": sorted(k for k, v in second.actions.items() if any(v.values()) and k not in OWN_WORK),
        "temp_files": sum(1 for _ in (root / "cold" / "files").rglob(f"*{TEMP_MARK}*")),
        "unnamed_files": len(on_disk - {p for p in on_disk if TEMP_MARK in p} - named),
        "missing_files": len(named - on_disk),
    }


@pytest.mark.slow
def test_compact_killed_at_random_instants(tmp_path):
    from collections import Counter

    root, stats = tmp_path / "store", Counter()
    checker = kill_compact(root, kills=10, seed=3, stats=stats)
    assert stats["finished"] <= stats["killed"] and stats["compact_errors"] == 0, (stats, checker.reports)
    for name in ("failed_opens", "fetch_errors", "corrupt_hits"):
        assert checker.stats.get(name, 0) == 0, (name, checker.reports)
    assert checker.stats["hits"] > 0
    after = repaired_for_good(root)
    assert after["first"] != "failed" and after["second"] != "failed" and after["second_repairs"] == [], after
    assert (after["temp_files"], after["unnamed_files"], after["missing_files"]) == (0, 0, 0), after
    final = Checker(4)
    final.check(root)
    assert final.stats.get("corrupt_hits", 0) == 0 and final.stats["hits"] > 0
    mx.clear_cache()
