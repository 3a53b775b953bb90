"""stats and compact over a distributed group's store: each rank's store in turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import ROOT, launch
from .test_fidelity import _prompt


def _promptstore(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "promptstore", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_stats_and_compact_take_each_ranks_store(tmp_path, group_model):
    store, alone = tmp_path / "store", tmp_path / "alone"
    first = _prompt(70)
    steps = [{"tokens": first}, {"tokens": first + _prompt(30, 1)}]
    launch(tmp_path, group_model("llama"), store, steps)
    launch(tmp_path, group_model("llama"), alone, steps, ranks=1)
    stats = _promptstore("stats", "--store", str(store), "--json")
    assert stats.returncode == 0, stats.stderr
    said = json.loads(stats.stdout)
    assert [r["store"] for r in said["ranks"]] == [str(store / "ranks/tensor-2" / f"rank-{i}") for i in range(2)]
    assert all(r["nodes"] > 0 and r["nbytes"] > 0 for r in said["ranks"])
    # Each rank holds its half of the heads: about half the bytes one machine's store
    # holds of the same turns (what a snapshot keeps besides its arrays is not halved).
    one = json.loads(_promptstore("stats", "--store", str(alone), "--json").stdout)
    assert [r["nodes"] for r in said["ranks"]] == [one["nodes"]] * 2
    assert all(one["nbytes"] / 2 <= r["nbytes"] <= 0.55 * one["nbytes"] for r in said["ranks"]), (said, one)
    compact = _promptstore("compact", "--store", str(store), "--verify")
    assert compact.returncode == 0, compact.stdout + compact.stderr
    for i in range(2):
        assert f"store {store / 'ranks/tensor-2' / f'rank-{i}'}" in compact.stdout
    assert compact.stdout.count("clean") == 2
    # A rank's store damaged: compact repairs it, and says so (status 1).
    files = sorted((store / "ranks/tensor-2/rank-1/cold/files").rglob("*.safetensors"))
    files[0].write_bytes(b"not a snapshot")
    repaired = _promptstore("compact", "--store", str(store), "--verify")
    assert repaired.returncode == 1, repaired.stdout + repaired.stderr
    # --model selects one namespace, of one rank's model: refused over the group's folder, in one line.
    refused = _promptstore("stats", "--store", str(store), "--model", str(group_model("llama")))
    assert refused.returncode == 1 and "give one rank's folder" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
