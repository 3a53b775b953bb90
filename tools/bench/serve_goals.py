"""bench_serve.py's runs as figures: per server and round, the median over runs
of the round's TTFT p50 over users (with what was restored and which replies
matched), and the issue's goals as ratios of promptstore serve's TTFT p50 over
its peers'."""

from __future__ import annotations

import statistics

from serve_peers import MLX_LM, PEERS, PROMPTSTORE, VLLM_MLX

# promptstore serve's TTFT p50 over the faster peer's, at most, in a chat round
# (not after a restart): more users, a tighter goal.
CHAT_LIMITS = {"chat": 1.0, "chat-8": 1.0, "chat-16": 0.9, "chat-32": 0.9}
AFTER_SIGKILL_LIMIT = 0.3  # over each peer's, the round after a SIGKILL


def summarize(workload: str, runs: list[dict], names: list[str]) -> dict:
    """Per server, per round: the median over runs of the round's TTFT p50 over users."""
    out: dict[str, dict] = {}
    for name in names:
        rounds = {}
        for label in runs[0]["rounds"]:
            per_run = [
                statistics.median(r["ttft_s"] for r in run["rows"] if r["server"] == name and r["round"] == label)
                for run in runs
            ]
            rows = [r for run in runs for r in run["rows"] if r["server"] == name and r["round"] == label]
            cached = [r["cached_tokens"] / r["prompt_tokens"] for r in rows if r["cached_tokens"] is not None]
            diag = [run["round_diagnostics"].get(label, {}).get(name, {}) for run in runs]
            shares = [d["restored_share"] for d in diag if d.get("restored_share") is not None]
            checked = [r["round_trip"] for r in rows if "round_trip" in r]
            rounds[label] = {
                "ttft_p50_s": statistics.median(per_run),
                "ttft_p50_s_per_run": per_run,
                "ttft_max_s": max(r["ttft_s"] for r in rows),
                "requests": len(rows),
                "restored_share": statistics.mean(cached) if cached else (statistics.mean(shares) if shares else None),
                "replies_equal_mlx_lm": None,
                # Replies whose text the next turn renders back to the tokens generated.
                "replies_round_trip": f"{sum(checked)}/{len(checked)}" if checked else None,
            }
        out[name] = rounds
    base = MLX_LM if MLX_LM in names else None
    for name in names:
        for label, s in out[name].items():
            if base:
                a = [r for run in runs for r in run["rows"] if r["server"] == base and r["round"] == label]
                b = [r for run in runs for r in run["rows"] if r["server"] == name and r["round"] == label]
                s["replies_equal_mlx_lm"] = f"{sum(x['reply'] == y['reply'] for x, y in zip(a, b))}/{len(a)}"
    if all("full_prefill" in run for run in runs):  # pressure, and every workload of a sharded run
        for name in names:
            eq = [run["full_prefill"][name] for run in runs]
            out[name]["replies_equal_full_prefill"] = f"{sum(e['equal'] for e in eq)}/{sum(e['requests'] for e in eq)}"
    return out


def goal(what: str, ours: float | None, theirs: float | None, limit: float) -> dict:
    value = ours / theirs if ours is not None and theirs else None
    return {"goal": what, "value": value, "limit": limit, "met": None if value is None else value <= limit}


def goals(results: dict) -> list[dict]:
    """The issue's goals as computed ratios of TTFT p50 (None where a server was not run)."""
    ours = results.get(PROMPTSTORE, {})

    def p50(name: str, workload: str, label: str) -> float | None:
        return results.get(name, {}).get(workload, {}).get(label, {}).get("ttft_p50_s")

    out = []
    for workload in [*CHAT_LIMITS, "single"]:
        for label in ours.get(workload, {}):
            if not label.startswith("round"):
                continue
            if "SIGKILL" in label:
                for peer in PEERS:
                    g = goal(
                        f"{workload}, {label}: vs {peer}",
                        p50(PROMPTSTORE, workload, label),
                        p50(peer, workload, label),
                        AFTER_SIGKILL_LIMIT,
                    )
                    out.append(g)
            elif "SIGTERM" not in label:
                peers = [p50(peer, workload, label) for peer in PEERS if p50(peer, workload, label)]
                g = goal(
                    f"{workload}, {label}: vs the faster peer",
                    p50(PROMPTSTORE, workload, label),
                    min(peers, default=None),
                    CHAT_LIMITS.get(workload, 1.0),
                )
                out.append(g)
    for label in ours.get("pressure", {}):
        if label.startswith("pass") and "first" not in label:
            for peer, limit in ((VLLM_MLX, 0.5), (MLX_LM, 0.3)):
                g = goal(
                    f"pressure, {label}: vs {peer}",
                    p50(PROMPTSTORE, "pressure", label),
                    p50(peer, "pressure", label),
                    limit,
                )
                out.append(g)
    for workload, figures in ours.items():
        if "replies_equal_full_prefill" not in figures:
            continue
        equal, total = map(int, figures["replies_equal_full_prefill"].split("/"))
        out.append(
            {
                "goal": f"{workload}: replies equal to a full prefill's",
                "value": equal / total,
                "limit": 1.0,
                "met": equal == total,
                "at_least": True,
            }
        )
    return out


def restart_figures(results: dict) -> list[dict]:
    """After a SIGTERM restart, promptstore serve against each peer in every chat
    workload (reported, no goal)."""
    out = []
    for workload in CHAT_LIMITS:
        ours = results.get(PROMPTSTORE, {}).get(workload, {})
        for label, s in ours.items():
            if "SIGTERM" in label:
                for peer in PEERS:
                    theirs = results.get(peer, {}).get(workload, {}).get(label, {}).get("ttft_p50_s")
                    out.append(
                        {
                            "what": f"{workload}, {label}: vs {peer}",
                            "value": s["ttft_p50_s"] / theirs if theirs else None,
                        }
                    )
    return out
