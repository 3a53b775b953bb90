"""The GPU sections of docs/benchmarks.md: the cold tier (bench_cold.py) and a
server restart (bench_serve.py), rendered from their result files as they
are, each with the command that made it and its figures beside their goals.

The earlier runs' files (those named archive/2026-11/...) left the tree: they
are read from git history, at HISTORY, the last commit that had them, and
their sections name them as `HISTORY:bench-results/archive/2026-11/...` (what
`git show` takes)."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

HISTORY = "6b6e4cf"  # the last commit with bench-results/archive/2026-11/ in the tree
ARCHIVE = "archive/"


class HistoryUnreadable(Exception):
    """A result file this page renders from git history could not be read (no git, or no history)."""


# (file, what the run was); the first of each kind is the one docs/figures.md quotes.
COLD_RUNS = (
    ("cold-cuda.json", "an H100; fifteen runs a cell at 2k and 8k, the profile's default now"),
    (
        "cold-cuda-h200.json",
        "an H200; seven runs a cell at 2k and 8k, the page cache's warm paths run before the dropped ones",
    ),
    (
        "archive/2026-11/cold-cuda-runs15.json",
        "the same code on that H200, fifteen runs a cell at 2k and 8k (`--short-runs 15`)",
    ),
    (
        "archive/2026-11/cold-cuda-rotating-order.json",
        "that H200, the bench's earlier order: auto's warm runs always right after overlap's drop of the page cache",
    ),
    ("archive/2026-11/cold-cuda-32k.json", "that H200, the 32k prefix alone (`--prefixes 32768`)"),
    ("archive/2026-11/cold-cuda-short-2.json", "that H200, the 2k and 8k prefixes only, 15 runs a cell"),
    ("archive/2026-11/cold-cuda-run3.json", "third run, a third H100 machine"),
    (
        "archive/2026-11/cold-cuda-short.json",
        "an H200, the 2k and 8k prefixes only, 15 runs a cell; a restore from one file hands its arrays over uncopied",
    ),
    ("archive/2026-11/cold-cuda-run2.json", "second run, a second H100 machine"),
    ("archive/2026-11/cold-cuda-run1.json", "first run"),
)
OLD_PLANS = {"split": "overlap"}  # plan names in result files, as they are called now
SERVE_RUNS = (
    (
        "archive/2026-11/serve-cuda-1.json",
        "an H100; the code at 5078ef6, the first of three runs in a row in one machine session",
    ),
    ("archive/2026-11/serve-cuda-2.json", "the same code, the second run of that machine session"),
    ("archive/2026-11/serve-cuda-3.json", "the same code, the third run of that machine session"),
    (
        "archive/2026-11/serve-cuda-idle-stores.json",
        "an H100; the idle generation thread also stores waiting replies while a burst's requests are still "
        "being checked (it only waited for them before)",
    ),
    ("archive/2026-11/serve-cuda-idle-stores-2.json", "the same code, a second run, in the same machine call after it"),
    (
        "archive/2026-11/serve-cuda-idle-stores-3.json",
        "the same code, a third run, on a second H100 session, right after serve-cuda-before-idle-stores-2.json",
    ),
    (
        "archive/2026-11/serve-cuda-before-idle-stores.json",
        "that H100, later in the same machine session: the code before (the generation thread waits for "
        "requests being checked)",
    ),
    (
        "archive/2026-11/serve-cuda-before-idle-stores-2.json",
        "the code before, a second run, on the second H100 session, just before serve-cuda-idle-stores-3.json",
    ),
    (
        "archive/2026-11/serve-cuda-batched-replies.json",
        "an H200; a burst's waiting replies prefilled as one batch through mlx-lm's prompt batch (reverted: "
        "no cheaper than one by one, tools/bench/probe_reply_batch.py, in git history at commit 16d144d)",
    ),
    (
        "archive/2026-11/serve-cuda-batched-replies-2.json",
        "the same (reverted) code, a second run, in the same call after it",
    ),
    (
        "serve-cuda-reply-first.json",
        "an H200; a chat's next turn stores its previous reply before its fetch (`--reply-before-fetch`, the "
        "default since), and at most one part of each request's prompt waits",
    ),
    (
        "archive/2026-11/serve-cuda-reply-first-2.json",
        "the same code (the default), a second run, on a freshly started H200",
    ),
    (
        "archive/2026-11/serve-cuda-reply-first-3.json",
        "the same code (the default), a third run, on a freshly started H200",
    ),
    (
        "archive/2026-11/serve-cuda-batch-prefills-reply.json",
        "the H200 of serve-cuda-reply-first.json, in the same call before it: the batch prefills a reply not yet "
        "stored (the GPU's default then, `--no-reply-before-fetch` since)",
    ),
    (
        "archive/2026-11/serve-cuda-batch-prefills-reply-2.json",
        "`--no-reply-before-fetch`, the H200 of serve-cuda-reply-first-2.json, in the same call after it",
    ),
    (
        "archive/2026-11/serve-cuda-give-way.json",
        "an H200; spills give way while requests wait for their first tokens, a prompt's parts stored once "
        "the first tokens are out, a finished request's insert when the generation thread has nothing to serve",
    ),
    ("archive/2026-11/serve-cuda-give-way-2.json", "the same code, a second run on an H200"),
    (
        "archive/2026-11/serve-cuda-background.json",
        "an H200; a finished request's insert when the generation thread has nothing to serve (spills not "
        "giving way, a prompt's parts stored before the next step)",
    ),
    (
        "archive/2026-11/serve-cuda-background-2.json",
        "the same code, with queued and arriving requests also going first",
    ),
    ("archive/2026-11/serve-cuda-background-3.json", "the same code, a third run on an H200"),
    (
        "archive/2026-11/serve-cuda-prompt-deferred.json",
        "an H200; files no record names removed off the generation thread, a prompt's parts stored after its "
        "first token",
    ),
    ("archive/2026-11/serve-cuda-prompt-deferred-2.json", "the same code, a second run on an H200"),
    ("archive/2026-11/serve-cuda-prompt-deferred-3.json", "the same code, a third run on an H200"),
    (
        "archive/2026-11/serve-cuda-phases.json",
        "an H200; each insert's phases timed, before the removals left the generation thread",
    ),
    ("archive/2026-11/serve-cuda-removals.json", "an H200; files no record names removed on a thread of their own"),
    ("archive/2026-11/serve-cuda-removals-2.json", "the same code, a second run on an H200"),
    ("archive/2026-11/serve-cuda-gradual.json", "an H200; those files removed in 8 MB steps (not kept)"),
    (
        "archive/2026-11/serve-cuda-deferred.json",
        "an H200; every insert after the step's tokens, replies included (not kept)",
    ),
    (
        "archive/2026-11/serve-cuda-generated-replies.json",
        "an H200; `--reply-tokens generated`: what the rendered reply's prefill costs the steady rounds",
    ),
    (
        "archive/2026-11/serve-cuda-bounded-writeback.json",
        "an H200; a hit's figures kept without its cache, spills keeping two 32 MB stretches queued at the disk",
    ),
    ("archive/2026-11/serve-cuda-bounded-writeback-2.json", "the same code, a second run on that H200"),
    ("archive/2026-11/serve-cuda-bounded-writeback-3.json", "the same code, a third run on that H200"),
    (
        "archive/2026-11/serve-cuda-last-hit.json",
        "that H200, a hit's figures kept without its cache (before the bounded writeback)",
    ),
    (
        "archive/2026-11/serve-cuda-stats-thread.json",
        "an H200; staged spills, and the advisory counters written on a stats thread, off the request path",
    ),
    ("archive/2026-11/serve-cuda-stats-thread-2.json", "the same code, a second run on that H200"),
    (
        "archive/2026-11/serve-cuda-write-back.json",
        "staged spills with `--durability write_back` (nothing spilled before the restart), that H200",
    ),
    (
        "archive/2026-11/serve-cuda-staged.json",
        "an H200; spills copied to the host by the GPU's copy engine into pinned buffers; restores uncopied",
    ),
    ("archive/2026-11/serve-cuda-staged-2.json", "the same code, a second run on that H200"),
    ("archive/2026-11/serve-cuda-staged-3.json", "the same code, a third run on that H200"),
    (
        "archive/2026-11/serve-cuda-h200-spill-copies.json",
        "an H200; requests arriving together prefill together; spill copies leave MLX's buffer cache",
    ),
    ("archive/2026-11/serve-cuda-h200-spill-copies-2.json", "the same code, a second run on that H200"),
    ("archive/2026-11/serve-cuda-h200-arrivals.json", "that H200, before spill copies left MLX's buffer cache"),
    (
        "archive/2026-11/serve-cuda-h100.json",
        "an H100, promptstore serve on MLX's own attention kernels, before arrivals were gathered",
    ),
    ("archive/2026-11/serve-cuda-cudnn.json", "an H100, both servers on cuDNN's attention kernels, MLX's default"),
    ("archive/2026-11/serve-cuda-nocudnn.json", "an H100, both servers on MLX's own attention kernels"),
)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def goals_table(rows: list[tuple[str, float, str]]) -> list[str]:
    """Figures beside their goals as a markdown table, a row each: (what, figure,
    goal), as common.print_goals prints them."""
    return ["| what | figure | goal |", "|---|---|---|", *(f"| {w} | {f:.3f} | {g} |" for w, f, g in rows)]


def cold_command(doc: dict) -> str:
    """The command that repeats the run with today's bench: the profile, and the
    options where the run's profile differs from today's default of it."""
    from bench_cold import PROFILES

    p, default = doc["profile"], PROFILES[doc["profile"]["name"]]
    options = [f"--profile {p['name']}"]
    if tuple(p["prefixes"]) != tuple(default.prefixes):
        options.append("--prefixes " + ",".join(str(n) for n in p["prefixes"]))
    if p.get("short_runs", p["runs"]) != default.short_runs:
        options.append(f"--short-runs {p.get('short_runs', p['runs'])}")
    return "python3 tools/bench/bench_cold.py " + " ".join(options)


def cold_section(name: str, what: str, doc: dict) -> str:
    p = doc["profile"]
    lines = [
        f"### The cold tier: `{where(name)}` ({what})",
        "",
        f"`{cold_command(doc)}`, {doc['date'][:10]}, {doc['device']}; {p['note']}. "
        f"Page cache dropped by {doc['page_cache_drop']}. Runs per cell: {p.get('short_runs', p['runs'])} at the "
        f"shorter prefixes, {p['runs']} at {p['prefixes'][-1]:,} tokens; medians.",
        "",
        f"At {doc['prefix_tokens']:,} tokens ({doc['kv_bytes'] / 1e9:.2f} GB of KV):",
        "",
        "| path | TTFT | vs full prefill |",
        "|---|---|---|",
    ]
    prefill = doc["prefill_ttft_s"]
    for label, key in (
        ("full prefill", "prefill_ttft_s"),
        ("hot hit", "hot_ttft_s"),
        ("cold hit, page cache warm", "cold_warm_ttft_s"),
        ("cold hit, page cache dropped", "cold_disk_ttft_s"),
    ):
        lines.append(f"| {label} | {ms(doc[key])} | {doc[key] / prefill:.3f}x |")
    lim = doc.get("host_limits") or {}
    lines += [
        "",
        f"Restore alone: {doc['restore_gbps_warm']:.1f} GB/s from the page cache, "
        f"{doc['restore_gbps_dropped']:.2f} GB/s after dropping it; {doc['restore_vs_mx_load']:.2f}x the time of "
        f"`mx.load` of the same bytes. Write with fsync {doc['write_gbps']:.2f} GB/s "
        f"({doc['write_gbps_no_fsync']:.2f} without) against mlx-lm's `save_prompt_cache` "
        f"{doc['mlx_lm_save_gbps']:.2f} GB/s, {doc['mlx_lm_save_fsync_gbps']:.2f} with fsync.",
    ]
    if lim:
        lines.append("The host, measured in the same run: " + ", ".join(f"{k} {v:.2f}" for k, v in lim.items()) + ".")
    lines += [
        "",
        "| prefix | page cache | load | recompute | overlap | auto | auto vs the best |",
        "|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple, dict] = {}
    for c in doc["sweep"]:
        # Runs before the rename name the overlap plan "split".
        cells.setdefault((c["prefix"], c["page_cache"]), {})[OLD_PLANS.get(c["plan"], c["plan"])] = c
    for (prefix, page), plans in cells.items():
        best = min(c["ttft_s"] for c in plans.values())
        row = [f"{prefix:,}", page]
        for plan in ("load", "recompute", "overlap", "auto"):
            c = plans.get(plan)
            row.append(
                "-" if c is None else f"{ms(c['ttft_s'])} ({'/'.join(OLD_PLANS.get(t, t) for t in c['plans_taken'])})"
            )
        row.append(f"{plans['auto']['ttft_s'] / best:.2f}x" if "auto" in plans else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        f"First token equal on every path: {doc['first_token_equal_everywhere']}. Figures beside their goals:",
        "",
        *goals_table([(g["goal"], g["value"], f"<= {g['limit']}") for g in doc["goals"]]),
    ]
    return "\n".join(lines)


def serve_command(doc: dict) -> str:
    w = doc["workload"]
    flags = [f"--profile {w['profile']}"]
    flags += ["--drop-page-cache"] if w.get("drop_page_cache") else []
    flags += ["--skip-generated"] if w.get("skip_generated") else []
    flags += [] if w.get("warm_up_process") else ["--no-warm-up-process"]
    flags += [f"--serve-args '{w['serve_args']}'"] if w.get("serve_args") else []
    return "python3 tools/bench/bench_serve.py " + " ".join(flags)


def serve_section(name: str, what: str, doc: dict) -> str:
    w = doc["workload"]
    results = doc["results"]
    base, ours = results["mlx_lm.server"], results["promptstore serve"]
    lines = [
        f"### A server restart: `{where(name)}` ({what})",
        "",
        f"`{serve_command(doc)}`, {doc['date'][:10]}, {doc['device']}; {doc['note']}. "
        f"{w['users']} users, a {w['system_tokens']:,}-token system prompt, {w['context_tokens']:,} tokens of "
        f"each user's own, {w['answer_tokens']}-token answers; {w['rounds']} rounds, then SIGTERM"
        + (", the page cache dropped" if doc.get("page_cache_dropped_at_restart") else "")
        + ", both servers started again.",
    ]
    if doc.get("run_note"):
        lines += ["", f"This run: {doc['run_note']}."]
    lines += ["", "| round | mlx_lm.server | promptstore serve | ratio |", "|---|---|---|---|"]
    for a, b in zip(base["rounds"], ours["rounds"]):
        label = f"{a['phase']} {a['turn']}"
        lines.append(
            f"| {label} | {ms(a['ttft_p50_s'])} | {ms(b['ttft_p50_s'])} | {b['ttft_p50_s'] / a['ttft_p50_s']:.2f}x |"
        )
    timelines = doc.get("promptstore_timelines") or []
    if timelines:
        keys = list(dict.fromkeys(k for t in timelines for k in t if k.endswith("_ms")))
        medians = {k: statistics.median(t[k] for t in timelines if k in t) for k in keys}
        lines += [
            "",
            f"promptstore serve's request phases, medians over {len(timelines)} requests: "
            + ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in medians.items())
            + ".",
        ]
    g = doc["goals"]
    others = [v for k, v in g["ttft_p50_ratio_per_round"].items() if not k.startswith("resume")]
    lines += [
        "",
        "TTFT p50, promptstore serve over mlx_lm.server, beside its goals:",
        "",
        *goals_table(
            [
                ("first round after the restart", g["after_restart_ttft_p50_ratio"], "<= 0.4"),
                ("slowest other round, or the first request", max([g["first_request_ttft_ratio"], *others]), "<= 1.0"),
            ]
        ),
        "",
        f"Replies equal between the two servers: {doc['replies_equal']} (bf16 with random weights; fidelity is "
        "checked by `make test` in float32).",
    ]
    return "\n".join(lines)


def where(name: str) -> str:
    """How a section names its result file: its path, or its place in git history."""
    return f"{HISTORY}:bench-results/{name}" if name.startswith(ARCHIVE) else f"bench-results/{name}"


def read(results: Path, name: str) -> dict | None:
    """A result file: from the tree, or, for an earlier run's, from git history; None if the tree lacks it."""
    if not name.startswith(ARCHIVE):
        return json.loads((results / name).read_text()) if (results / name).exists() else None
    spec = f"{HISTORY}:bench-results/{name}"
    try:
        shown = subprocess.run(
            ["git", "-C", str(results.parent), "show", spec], capture_output=True, text=True, timeout=60
        )
    except OSError as e:
        raise HistoryUnreadable(f"{spec}: git: {e.strerror}") from e
    if shown.returncode != 0:
        raise HistoryUnreadable(f"{spec}: {shown.stderr.strip() or 'git show failed'} (a clone with its history?)")
    return json.loads(shown.stdout)


def sections(results: Path) -> str:
    """Markdown for every GPU result file present; empty if none is. Raises HistoryUnreadable
    when an earlier run's file cannot be read from git history."""
    parts = []
    for name, what in COLD_RUNS:
        if (doc := read(results, name)) is not None:
            parts.append(cold_section(name, what, doc))
    for name, what in SERVE_RUNS:
        # serve-cuda.json holds the servers side by side now (serve_docs.py renders it).
        if (doc := read(results, name)) is not None and "benchmark" not in doc:
            parts.append(serve_section(name, what, doc))
    if not parts:
        return ""
    head = (
        "## NVIDIA GPU: the cold tier and a server restart\n\n"
        "Rendered from the result files of `tools/bench/bench_cold.py` and `tools/bench/bench_serve.py`; "
        "each section names the command that made it. docs/cold.md and docs/serve.md discuss them. "
        "Their cold plan overlap (called split then) is shown by its name now. A file named "
        f"`{HISTORY}:bench-results/archive/2026-11/...` is an earlier run's, in git history at commit {HISTORY} "
        f"(`git show {HISTORY}:bench-results/archive/2026-11/NAME`)."
    )
    return "\n\n".join([head, *parts])
