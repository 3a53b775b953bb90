"""Memory under eviction pressure (issue 16: the 2,000-operation run never filled its
hot budget, so eviction was never under test). A process whose hot tier is four nodes
wide inserts and fetches 800 prompts of 128 tokens with write_back durability: nearly
every operation evicts and spills, and fetches of older prompts load files and evict
again. Its resident memory not backed by files (the index's mapped pages grow with
the index, as they should) stays flat once warm: a bound far below what keeping one
evicted node per spill would cost. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_memory_worker.py")
NODE = 128 * 2 * 2 * 2 * 16 * 4  # bytes of one prompt's node: tokens x layers x (K, V) x heads x dim x float32
BOUND = 8 << 20


def test_rss_stays_flat_while_the_hot_tier_evicts_all_the_time(tmp_path):
    run = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "store"), "800", str(4 * NODE), "8"],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(WORKER.parents[2]), "HF_HUB_OFFLINE": "1", "PATH": ""},
    )
    assert run.returncode == 0 and run.stdout.endswith("done\n"), run.stderr[-2000:]
    samples = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    warm = next(s for s in samples if s["op"] >= 400)
    last = samples[-1]
    assert all(s["hot"] <= 4 * NODE for s in samples)  # within budget (one node is NODE bytes)
    # Pressure all along the second half: more spills than the budget could ever hold.
    spilled = last["spills"] - warm["spills"]
    assert spilled >= 100 and last["cold_loads"] - warm["cold_loads"] >= 100
    growth = last["rss_anon"] - warm["rss_anon"]
    assert growth < BOUND < spilled * NODE, (growth, samples)
