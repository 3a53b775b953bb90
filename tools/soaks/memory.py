"""The soak's memory section: a process whose hot tier is four nodes wide inserts
and fetches with write_back (tests/reliability/_memory_worker.py); its anonymous
RSS over the second half of the run is bounded."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .common import REPO, now

MEMORY_BOUND = 8 << 20


def memory(args, work: Path) -> dict:
    import subprocess

    node = 128 * 2 * 2 * 2 * 16 * 4  # one 128-token node of the tiny llama, float32
    started = now()
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests/reliability/_memory_worker.py"),
            str(work / "memory"),
            str(args.memory_ops),
            str(4 * node),
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=7200,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    samples = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not samples:
        print(f"  memory: worker failed: {run.stderr[-500:]}", flush=True)
        return {"failed": run.stderr[-2000:], "over_bound": 1}
    warm = next(s for s in samples if s["op"] >= args.memory_ops // 2)
    last = samples[-1]
    mib = 1 / 2**20
    result = {
        "ops": args.memory_ops,
        "hot_budget": 4 * node,
        "hot_max": max(s["hot"] for s in samples),
        "spills": last["spills"],
        "cold_loads": last["cold_loads"],
        "rss_anon_mib": [round(s["rss_anon"] * mib, 1) for s in samples],
        "rss_mib": [round(s["rss"] * mib, 1) for s in samples],
        "ops_sampled": [s["op"] for s in samples],
        "anon_growth_second_half_mib": round((last["rss_anon"] - warm["rss_anon"]) * mib, 2),
        "rss_growth_second_half_mib": round((last["rss"] - warm["rss"]) * mib, 2),
        "spills_second_half": last["spills"] - warm["spills"],
        "bound_mib": MEMORY_BOUND * mib,
        "seconds": round(now() - started, 1),
    }
    result["over_bound"] = int(last["rss_anon"] - warm["rss_anon"] >= MEMORY_BOUND)
    print(
        f"  memory: {result['ops']} ops, hot budget {result['hot_budget']} B (max held {result['hot_max']}), "
        f"spills={result['spills']} cold_loads={result['cold_loads']}; anonymous RSS "
        f"{result['rss_anon_mib'][0]} -> {round(warm['rss_anon'] * mib, 1)} (op {warm['op']}) -> "
        f"{result['rss_anon_mib'][-1]} MiB: +{result['anon_growth_second_half_mib']} MiB over the second half "
        f"({result['spills_second_half']} spills; bound {result['bound_mib']:.0f} MiB); all RSS "
        f"+{result['rss_growth_second_half_mib']} MiB (the index's mapped pages grow with it) ({result['seconds']} s)",
        flush=True,
    )
    return result
