"""bench_serve.py's results as text and markdown: a table per workload (TTFT
p50 per round and server, promptstore serve's ratios beside them) and the
goals, from bench-results/serve-cpu.json and serve-cuda.json.

`python tools/bench/benchmarks_doc.py` prints the tables of those files and
rewrites docs/benchmarks.md (every section of it, from the result files)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = (("serve-cpu.json", "CPU"), ("serve-cuda.json", "NVIDIA GPU"))
MLX_LM, VLLM_MLX, PROMPTSTORE = "mlx_lm.server", "vllm-mlx", "promptstore serve"
STATUS = {True: "met", False: "MISSED", None: "not measured (a server not run)"}
WHAT = {
    "chat": "multi-round chat, a SIGKILL restart and a SIGTERM restart",
    "pressure": "memory pressure: conversations visited round-robin, their state several times the budget",
    "single": "one conversation alone, hot",
}
REPLIES = {
    "random": "the random weights' replies (random tokens, which mostly tokenize otherwise in the next turn)",
    "round-trip": "replies that render back to the tokens generated (weights reshaped so, as a real model's "
    "replies mostly do: promptstore/testing/round_trip.py)",
}


def what(workload: str) -> str:
    """A workload's title: chat-8 is the chat workload with 8 users."""
    if workload.startswith("chat-"):
        return f"{WHAT['chat']}, {workload.split('-')[1]} users"
    return WHAT[workload]


def workload_of(goal: str) -> str:
    """The workload a goal or figure names first: `chat-8, round 2: vs ...` is chat-8's."""
    return goal.split(",")[0].split(":")[0]


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def describe(workload: str, w: dict) -> str:
    budget = f"a memory budget of {w['budget'] / 2**20:,.0f} MiB for every server"
    if workload.startswith("chat"):
        return (
            f"{w['users']} users at once, a {w['system_tokens']:,}-token system prompt they share and "
            f"{w['context_tokens']:,} tokens of each user's own, {w['answer_tokens']}-token answers; {w['rounds']} "
            f"rounds, then every server killed by SIGKILL and started again on its folders, two rounds, then "
            f"stopped by SIGTERM and the same; {budget}"
        )
    if workload == "pressure":
        state = w["conversations"] * w["context_tokens"] * w["kv_bytes_per_token"]
        return (
            f"{w['conversations']} conversations of {w['context_tokens']:,} tokens each, one request at a time, "
            f"visited round-robin {w['passes']} times, {w['answer_tokens']}-token answers; {budget}, their state "
            f"{state / w['budget']:.1f}x it before any reply"
        )
    return (
        f"one conversation: a {w['system_tokens']:,}-token system prompt, {w['context_tokens']:,} tokens of its "
        f"own in the first question, {w['rounds']} rounds, {w['answer_tokens']}-token answers; {budget}"
    )


def rows(doc: dict, workload: str) -> list[list[str]]:
    """A row per round: each server's TTFT p50 (restored share), then promptstore's ratios."""
    res = {n: r for n, r in doc["results"].items() if workload in r}  # a merged file: some ran other workloads
    names = [n for n in (MLX_LM, VLLM_MLX, PROMPTSTORE) if n in res]
    labels = list(res[names[0]][workload]) if names else []
    out = []
    for label in labels:
        if not isinstance(res[names[0]][workload][label], dict):
            continue
        row = [label]
        for n in names:
            s = res[n][workload][label]
            share = f" ({s['restored_share']:.0%})" if s.get("restored_share") is not None else ""
            row.append(ms(s["ttft_p50_s"]) + share)
        ours = res.get(PROMPTSTORE, {}).get(workload, {}).get(label, {}).get("ttft_p50_s")
        for peer in (MLX_LM, VLLM_MLX):
            if peer in res and PROMPTSTORE in res:  # the header's ratio columns
                row.append(ratio(ours, res[peer][workload][label]["ttft_p50_s"]))
        out.append(row)
    return out


def header(doc: dict, workload: str | None = None) -> list[str]:
    res = {n: r for n, r in doc["results"].items() if workload is None or workload in r}
    names = [n for n in (MLX_LM, VLLM_MLX, PROMPTSTORE) if n in res]
    ratios = [f"promptstore ÷ {p}" for p in (MLX_LM, VLLM_MLX) if p in res and PROMPTSTORE in names]
    return ["round", *names, *ratios]


def goal_rows(doc: dict, workload: str | None = None) -> list[tuple[str, float | None, str]]:
    out = []
    for g in doc["goals"]:
        if workload and workload_of(g["goal"]) != workload:
            continue
        limit = f">= {g['limit']}" if g.get("at_least") else f"<= {g['limit']}"
        out.append((g["goal"], g["value"], f"{limit}, {STATUS[g['met']]}"))
    return out


def section(name: str, where: str, doc: dict) -> str:
    note = doc.get("run_note") or ""
    run_note = f" {note[:1].upper()}{note[1:]}." if note else ""
    skipped = "".join(f" {k} was not run: {v}." for k, v in doc.get("skipped", {}).items())
    lines = [
        f"### {where}: `bench-results/{name}`",
        "",
        " then ".join(f"`{c}`" for c in doc["commands"])
        + f", {doc['date'][:10]}, {doc['device']}; {doc['note']}. Each figure is the median over runs of a round's "
        f"TTFT p50 over its users; the whole run took {doc['wall_s'] / 60:.1f} min.{run_note}{skipped} "
        f"Versions: {versions(doc)}. Replies: {REPLIES[doc.get('replies', 'random')]}.",
        "",
        "Each cell is a round's TTFT p50 and, in brackets, the share of the prompt the server restored from its "
        "cache (mlx_lm.server and promptstore serve in their replies' usage, vllm-mlx in its log).",
    ]
    for workload in doc["workloads"]:
        w = doc["workloads"][workload]
        lines += [
            "",
            f"#### {what(workload)}",
            "",
            describe(workload, w) + f"; {w['runs']} run(s), {w['wall_s'] / 60:.1f} min.",
            "",
        ]
        head = header(doc, workload)
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows(doc, workload)]
        if workload == "pressure":
            eq = {n: r["pressure"].get("replies_equal_full_prefill") for n, r in doc["results"].items()}
            if any(eq.values()):
                said = ", ".join(f"{n} {v}" for n, v in eq.items())
                lines += ["", f"Replies equal to a full prefill's: {said}."]
            else:
                lines += ["", "Replies not compared with a full prefill's (bfloat16: the check is float32's)."]
        figs = ", ".join(
            f"{f['what'].split(': ')[-1]} {f['value']:.2f}x"
            for f in doc.get("after_sigterm", [])
            if f["value"] and workload_of(f["what"]) == workload
        )
        if figs:
            lines += ["", f"After the SIGTERM restart (no goal), promptstore serve's TTFT p50 {figs}."]
        if said := round_trips(doc, workload):
            lines += ["", f"Replies that render back to the tokens generated: {said}."]
        if said := reply_stores(doc, workload):
            lines += ["", f"promptstore serve's reply stores, over every run: {said}."]
        phases = timeline_medians(doc, workload)
        if phases:
            lines += ["", f"promptstore serve's request phases, medians: {phases}."]
        g = goal_rows(doc, workload)
        if g:
            lines += ["", "| goal | figure | limit |", "|---|---|---|"]
            lines += [f"| {w_} | {'-' if f is None else f'{f:.3f}'} | {lim} |" for w_, f, lim in g]
    return "\n".join(lines)


def versions(doc: dict) -> str:
    v = doc.get("versions", {})
    peer = v.get(VLLM_MLX)
    text = f"mlx {v.get('mlx')}, mlx-lm {v.get('mlx-lm')}"
    return text + (f"; vllm-mlx {peer['vllm-mlx']} on mlx-lm {peer['mlx-lm']}, mlx {peer['mlx']}" if peer else "")


def round_trips(doc: dict, workload: str) -> str:
    """Per server, the replies the next turn renders back to the tokens generated, over all rounds."""
    said = []
    for name, res in doc["results"].items():
        counts = [s.get("replies_round_trip") for s in res.get(workload, {}).values() if isinstance(s, dict)]
        counts = [tuple(map(int, c.split("/"))) for c in counts if c]
        if counts:
            said.append(f"{name} {sum(a for a, _ in counts)}/{sum(b for _, b in counts)}")
    return ", ".join(said)


def reply_stores(doc: dict, workload: str) -> str:
    """promptstore serve's reply stores over every run's rounds: forwards run, the
    replies they stored, and the replies stored with none (empty where it logged none)."""
    diags = [
        by_server.get(PROMPTSTORE, {})
        for run in doc.get("details", {}).get(workload, [])
        for by_server in run.get("round_diagnostics", {}).values()
    ]
    total = {k: sum(d.get(k, 0) for d in diags) for k in ("reply_forwards", "replies_by_forwards")}
    total["without"] = sum(d.get("replies_without_forward", 0) for d in diags)
    if not any(total.values()):
        return ""
    return (
        f"{total['reply_forwards']} forwards storing {total['replies_by_forwards']} replies, "
        f"{total['without']} replies stored without a forward"
    )


def timeline_medians(doc: dict, workload: str) -> str:
    rows_ = [
        t
        for run in doc.get("details", {}).get(workload, [])
        for t in (run["promptstore_log"] or {}).get("timelines", [])
    ]
    keys = list(dict.fromkeys(k for t in rows_ for k in t if k.endswith("_ms")))
    if not keys:
        return ""
    return f"over {len(rows_)} requests, " + ", ".join(
        f"{k[:-3]} {statistics.median(t[k] for t in rows_ if k in t):.1f} ms" for k in keys
    )


def sections(results: Path) -> str:
    """Markdown for each peers result file present; empty if none is."""
    parts = []
    for name, where in RESULTS:
        path = results / name
        if path.exists() and (doc := json.loads(path.read_text())).get("benchmark") == "serve-peers":
            parts.append(section(name, where, doc))
    if not parts:
        return ""
    head = (
        "## Servers side by side: promptstore serve, mlx_lm.server and vllm-mlx\n\n"
        "Rendered from the result files of `tools/bench/bench_serve.py` (`make peers` installs vllm-mlx). Every "
        "server runs the same model directory with the same memory budget and its own best caching settings, and "
        "they answer the same requests in turn. A goal missed is shown as MISSED; the result file holds each "
        "round's figures per run and promptstore serve's per-request timelines that explain it.\n\n"
        "vllm-mlx 0.6.0 as measured here: its stream opens with an empty chunk, so TTFT is taken at the first "
        "chunk with text, for every server; its replies keep a leading space mlx-lm's drop, so its conversations' "
        "later prompts differ from the others' by that space, and its replies are checked against its own "
        "software with the prefix cache off; its SSD tier holds a prompt with its generated tokens, a prefix of "
        "the next turn only where the template renders the reply back to the same tokens, and it turns a "
        "promotion down when the memory budget is full (`budget denied` in its log) instead of evicting for it."
    )
    return "\n\n".join([head, *parts])


def print_report(doc: dict) -> None:
    """The tables and the goals, as text."""
    from common import print_goals

    print(f"\nreplies: {doc.get('replies', 'random')}")
    for workload in doc["workloads"]:
        print(f"\n{what(workload)}: TTFT p50 (restored share)")
        head = header(doc, workload)
        table = [head, *rows(doc, workload)]
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        for r in table:
            print("  " + "  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(r)))
        if workload == "pressure":
            eq = {n: r["pressure"].get("replies_equal_full_prefill") for n, r in doc["results"].items()}
            if any(eq.values()):
                print("  replies equal to a full prefill's: " + ", ".join(f"{n} {v}" for n, v in eq.items()))
        phases = timeline_medians(doc, workload)
        if phases:
            print(f"  promptstore serve's request phases, medians {phases}")
        if said := round_trips(doc, workload):
            print(f"  replies that render back to the tokens generated: {said}")
        if said := reply_stores(doc, workload):
            print(f"  promptstore serve's reply stores: {said}")
    print("\nGoals (promptstore serve's TTFT p50 over the peer's):")
    print_goals(goal_rows(doc))
