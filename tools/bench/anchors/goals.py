"""The issue's goals: each workload's figures for them, shown beside the goals."""

from __future__ import annotations

from .summary import fmt_bytes, row_of

GOALS = [
    ("prefill tokens cut (promptstore hot vs no cache)", ">= 90%"),
    ("hit TTFT / TTFT at the one-copy floor (promptstore hot, p50 over hits)", "<= 2x"),
    ("hit TTFT / TTFT at mx.load (promptstore cold only, p50 over hits)", "<= 1.25x"),
    ("disk bytes (promptstore hot / mlx-lm files)", "<= 0.3x"),
    ("tokens restorable after a restart / before (promptstore)", ">= 95%"),
    ("hybrid prefill cut minus the dense model's on the same chat (promptstore hot)", "within 2 points"),
    ("hybrid disk bytes (promptstore hot / mlx-lm files)", "<= 1.0x"),
    ("hybrid restores within one prefill step of the divergence (promptstore hot)", "100%"),
]


def goals(workloads: dict[str, dict]) -> list[dict]:
    out = []

    def add(goal, workload, value, ok, shown, detail=""):
        out.append(
            {
                "goal": goal,
                "workload": workload,
                "value": value,
                "met": bool(ok) if value is not None else False,
                "shown": shown,
                "detail": detail,
            }
        )

    for wname, s in workloads.items():
        if wname.startswith("hybrid-"):
            hybrid_goals(add, wname, s, workloads.get("chat"))
        if wname == "restart":
            kept = s["survived"]["promptstore (restarted)"]["kept"]
            add(
                GOALS[4][0],
                wname,
                kept,
                kept is not None and kept >= 0.95,
                "n/a" if kept is None else f"{kept:.1%}",
                f"LRU keeps {s['survived']['mlx-lm LRUPromptCache (restarted: empty)']['kept'] or 0:.0%}, "
                f"files {s['survived']['mlx-lm cache files']['kept'] or 0:.0%}",
            )
            continue
        hot, cold, files = (
            row_of(s, "promptstore hot"),
            row_of(s, "promptstore cold only"),
            row_of(s, "mlx-lm cache files"),
        )
        if hot is None:
            continue
        cut = hot["prefill_cut"]
        if not wname.startswith("hybrid-"):  # the hybrids have their own cut and disk goals
            add(GOALS[0][0], wname, cut, cut is not None and cut >= 0.90, f"{cut:.1%}")
        r = hot.get("hit_ttft_vs_floor_p50")
        add(
            GOALS[1][0],
            wname,
            r,
            r is not None and r <= 2.0,
            "n/a" if r is None else f"{r:.2f}x",
            f"restore alone: {hot['restore_vs_floor']:.2f}x the floor" if hot.get("restore_vs_floor") else "",
        )
        if cold is not None:
            r = cold.get("hit_ttft_vs_load_p50")
            add(
                GOALS[2][0],
                wname,
                r,
                r is not None and r <= 1.25,
                "n/a" if r is None else f"{r:.2f}x",
                f"restore alone: {cold['restore_vs_load']:.2f}x mx.load" if cold.get("restore_vs_load") else "",
            )
        if files is not None and files["disk_bytes"] and not wname.startswith("hybrid-"):
            r = hot["disk_bytes"] / files["disk_bytes"]
            add(
                GOALS[3][0],
                wname,
                r,
                r <= 0.3,
                f"{r:.2f}x",
                f"{fmt_bytes(hot['disk_bytes'])} vs {fmt_bytes(files['disk_bytes'])}",
            )
    return out


def hybrid_goals(add, wname: str, s: dict, chat: dict | None) -> None:
    hot, files = row_of(s, "promptstore hot"), row_of(s, "mlx-lm cache files")
    points = s.get("restore_points") or {}
    dense_row = row_of(chat, "promptstore hot") if chat and s.get("same_prompts_as_chat") else None
    if dense_row is not None:
        dense, of = dense_row["prefill_cut"], "the chat workload's dense model"
    else:
        dense, of = points.get("attention_only_cut"), "an attention-only model on the same requests"
    if hot and dense is not None:
        diff = hot["prefill_cut"] - dense
        add(
            GOALS[5][0],
            wname,
            diff,
            abs(diff) <= 0.02,
            f"{diff * 100:+.1f} points",
            f"{hot['prefill_cut']:.1%} vs {dense:.1%} ({of}); LRU {row_of(s, 'mlx-lm LRUPromptCache')['prefill_cut']:.1%}",
        )
    if hot and files and files["disk_bytes"]:
        r = hot["disk_bytes"] / files["disk_bytes"]
        add(
            GOALS[6][0],
            wname,
            r,
            r <= 1.0,
            f"{r:.2f}x",
            f"{fmt_bytes(hot['disk_bytes'])} vs {fmt_bytes(files['disk_bytes'])}",
        )
    probes = s.get("divergence_probes")
    if probes:  # counted over the chat's requests and the probes together
        points = dict(points)
        for k in ("requests", "at_divergence", "within_step"):
            points[k] += probes[k]
        points["gap_max"] = max(points["gap_max"] or 0, probes["gap_max"] or 0)
    if points:
        share = points["within_step"] / points["requests"] if points["requests"] else None
        add(
            GOALS[7][0],
            wname,
            share,
            share == 1.0,
            "n/a" if share is None else f"{share:.0%}",
            f"{points['at_divergence']} of {points['requests']} at the divergence itself (chat requests and "
            f"random divergence probes); max gap {points['gap_max']:.0f} tokens",
        )


def goals_table(gs: list[dict]) -> str:
    """The goals as rows of what, workload, figure and goal (the result file keeps
    whether each was met)."""
    targets = dict(GOALS)
    lines = ["| what | workload | figure | goal | detail |", "|---|---|---|---|---|"]
    for g in gs:
        lines.append(f"| {g['goal']} | {g['workload']} | {g['shown']} | {targets[g['goal']]} | {g['detail']} |")
    return "\n".join(lines)
