"""A group's store restores, turn after turn and after a restart, what a prefill
of the same prompt computes on the same group (logits within 1e-4, greedy identical)."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import launch

TOL = 1e-4


def _prompt(n, seed=0, vocab=512):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _agreed(ranks: list[dict]) -> list[int]:
    """The hit of each step, the same on every rank."""
    hits = [[s["hit"] for s in r["steps"]] for r in ranks]
    assert all(h == hits[0] for h in hits), f"ranks restored different lengths: {hits}"
    return hits[0]


def _faithful(ranks: list[dict]) -> None:
    for r in ranks:
        for i, s in enumerate(r["steps"]):
            assert s["max_diff"] <= TOL, f"rank {r['rank']} step {i}: logits differ by {s['max_diff']}"
            assert s["greedy"] == s["reference"], f"rank {r['rank']} step {i}: greedy tokens differ"


@pytest.mark.parametrize("kind,family", [("tensor", "llama"), ("pipeline", "qwen3_next")])
def test_turns_and_restart(tmp_path, group_model, kind, family):
    model = group_model(family)
    store = tmp_path / "store"
    system = _prompt(60)
    first = system + _prompt(20, 1)
    second = first + _prompt(30, 2)
    # The end of the system prompt is a checkpoint: recurrent layers restore only where their state was stored.
    fork = system + _prompt(40, 4)
    steps = [{"tokens": first, "checkpoints": [len(system)]}, {"tokens": second}, {"tokens": fork}]
    bad = [{"tokens": first, "checkpoints": [len(first) + 5]}, {"tokens": [3, 10**6]}]  # typed errors, each rank
    ranks = launch(tmp_path, model, store, bad + steps, kind=kind)
    for r in ranks:
        assert r["steps"][:2] == [{"refused": "SnapshotRangeError"}, {"refused": "TokenRangeError"}]
        r["steps"] = r["steps"][2:]
    hits = _agreed(ranks)
    assert hits[0] == 0 and hits[1] >= len(first) - 16 and hits[2] >= len(system)
    _faithful(ranks)
    # Each rank kept its own store, and its namespace names its shard.
    assert {r["folder"] for r in ranks} == {str(store / "ranks" / f"{kind}-2" / f"rank-{i}") for i in range(2)}
    assert [r["shard"].split(" layers")[0] for r in ranks] == [f"{kind} 0/2", f"{kind} 1/2"]
    # A new group (a restart) restores from the disk what the first stored.
    third = second + _prompt(25, 3)
    again = launch(tmp_path, model, store, [{"tokens": third}], kind=kind)
    hits = _agreed(again)
    assert hits[0] >= len(second) - 16, f"the restart restored only {hits[0]} of {len(second)} stored tokens"
    _faithful(again)
