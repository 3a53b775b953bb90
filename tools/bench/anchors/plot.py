"""The plot: an anchors result (bench_anchors.py's JSON) as one PNG beside it.

One column per workload: time to first token p50 / p95 per contender (log
scale), tokens prefilled, and restore GB/s next to the two ceilings.
Needs matplotlib (imported here only, so the benchmark runs without it);
tools/bench/plot_anchors.py is its command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SHORT = {
    "no cache": "no cache",
    "mlx-lm LRUPromptCache": "mlx-lm\nLRU",
    "mlx-lm LRUPromptCache (restarted: empty)": "mlx-lm LRU\n(restarted:\nempty)",
    "mlx-lm cache files": "mlx-lm\nfiles",
    "promptstore hot": "promptstore\nhot",
    "promptstore cold only": "promptstore\ncold only",
    "promptstore (restarted)": "promptstore\n(restarted)",
    "ceiling: one mx.concatenate (one-copy floor)": "one-copy\nfloor",
    "ceiling: mx.load of one file": "mx.load",
    "no cache, prefill step 512 (control)": "no cache\n(step 512)",
}


def plot(path: str | Path) -> Path:
    path = Path(path)
    doc = json.loads(path.read_text())
    workloads = doc["workloads"]
    cols = len(workloads)
    fig, axes = plt.subplots(3, cols, figsize=(4.2 * cols, 10), squeeze=False)
    for j, (wname, s) in enumerate(workloads.items()):
        rows = [r for r in s["rows"] if not r.get("ceiling")]
        ceilings = [r for r in s["rows"] if r.get("ceiling")]
        labels = [SHORT.get(r["contender"], r["contender"]) for r in rows]
        x = range(len(rows))

        ax = axes[0][j]
        p50 = [(r["ttft_p50_s"] or 0) * 1e3 for r in rows]
        p95 = [(r["ttft_p95_s"] or 0) * 1e3 for r in rows]
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], p95, 0.4, label="p95")
        ax.set_yscale("log")
        ax.set_title(wname)
        ax.set_ylabel("time to first token (ms)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.legend(fontsize=7)

        ax = axes[1][j]
        ax.bar(list(x), [r["prefilled_tokens"] for r in rows], color="tab:gray")
        ax.set_ylabel("tokens prefilled")
        ax.set_xticks(list(x), labels, fontsize=7)

        ax = axes[2][j]
        restore = [r for r in rows if r.get("restore_gbps")] + ceilings
        ax.bar(
            range(len(restore)),
            [r["restore_gbps"] for r in restore],
            color=["tab:green" if not r.get("ceiling") else "tab:orange" for r in restore],
        )
        ax.set_yscale("log")
        ax.set_ylabel("restore GB/s (orange: ceilings)")
        ax.set_xticks(range(len(restore)), [SHORT.get(r["contender"], r["contender"]) for r in restore], fontsize=7)

    m = doc["machine"]
    fig.suptitle(
        f"promptstore anchors, profile {doc['profile']['name']}: {doc['date']}, "
        f"MLX {m['mlx']} on {m['mlx_device']}, {m['cpu_count']} CPUs",
        fontsize=10,
    )
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
