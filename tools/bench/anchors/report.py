"""The report of a run, and its part of docs/benchmarks.md (benchmarks_doc.py writes the page)."""

from __future__ import annotations

from .goals import goals_table
from .summary import fmt_bytes, fmt_ms, fmt_sci


def workload_table(s: dict) -> str:
    head = (
        "| contender | prefilled tokens | cut | TTFT p50 | TTFT p95 | hit TTFT p50 | hit TTFT p95 | disk "
        "| restore GB/s | restore ÷ floor | restore ÷ mx.load | restored from disk | replies = no cache "
        "| max Δ logprob, 1st token |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in s["rows"]:
        if r.get("ceiling"):
            lines.append(
                f"| *{r['contender']}* | | | | | {fmt_ms(r['hit_ttft_p50_s'])}† | {fmt_ms(r['hit_ttft_p95_s'])}† "
                f"| | {r['restore_gbps']:.2f} | | | | | |"
            )
            continue
        cut = "" if r["contender"].startswith("no cache") or r["prefill_cut"] is None else f"{r['prefill_cut']:.1%}"
        gbps = f"{r['restore_gbps']:.2f}" if r.get("restore_gbps") else "-"
        vf = f"{r['restore_vs_floor']:.2f}x" if r.get("restore_vs_floor") else "-"
        vl = f"{r['restore_vs_load']:.2f}x" if r.get("restore_vs_load") else "-"
        eq = "yes" if r["replies_equal"] else f"**NO ({len(r['replies_mismatched'])} of {r['requests']})**"
        disk_share = "-" if not r["restored_tokens"] else f"{r['disk_restored_tokens'] / r['restored_tokens']:.0%}"
        name = r["contender"]
        if r.get("kept_after_restart") is not None or "restarted" in name:
            kept = r.get("kept_after_restart")
            name += f" (kept {kept:.0%})" if kept is not None else ""
        lines.append(
            f"| {name} | {r['prefilled_tokens']:,} of {r['prompt_tokens']:,} | {cut} "
            f"| {fmt_ms(r['ttft_p50_s'])} | {fmt_ms(r['ttft_p95_s'])} | {fmt_ms(r['hit_ttft_p50_s'])} "
            f"| {fmt_ms(r['hit_ttft_p95_s'])} | {fmt_bytes(r['disk_bytes']) if r['disk_bytes'] is not None else '-'} "
            f"| {gbps} | {vf} | {vl} | {disk_share} | {eq} | {fmt_sci(r.get('max_first_token_logprob_diff'))} |"
        )
    details = []
    for r in s["rows"]:
        for m in r.get("mismatch_detail", []):
            details.append(
                f"{r['contender']}: {m['request']} (restored {m['restored']:,}) differs from token "
                f"{m['token']} on, where the top-2 logprob margin was {m['margin_no_cache']:.4f} "
                f"without a cache and {m['margin_here']:.4f} here"
            )
    if details:
        lines.append("\nReplies that differ from no cache's:\n")
        lines += [f"- {d}" for d in details]
    return "\n".join(lines)


TITLES = {
    "chat": "Chat with shared system prompts",
    "restart": "Restart: the chat resumed in a fresh process",
    "fork": "Agent forking",
    "hybrid-gemma3_text": "Hybrid model: sliding window (gemma3_text layout), chat workload",
    "hybrid-qwen3_next": "Hybrid model: recurrent + attention (qwen3_next layout), chat workload",
}


def report(doc: dict) -> str:
    m = doc["machine"]
    blas = "not used (GPU)" if "gpu" in m["mlx_device"] else doc["blas"]["name"]
    gpu = f"; GPU: {doc['gpu']}" if doc.get("gpu") else ""
    partial = " **Partial: the run stopped before every workload was done.**" if doc.get("partial") else ""
    parts = [
        f"Run {doc['date']} on {m['platform']} ({m['cpu_count']} CPUs{gpu}; MLX {m['mlx']} on {m['mlx_device']}; "
        f"mlx-lm {m['mlx_lm']}; BLAS: {blas}).{partial} Profile `{doc['profile']['name']}`: "
        f"{doc['profile']['note']}. Whole run: {doc['wall_s'] / 60:.1f} min."
    ]
    for name, s in doc["workloads"].items():
        parts.append(f"\n#### {TITLES.get(name, name)}\n\n{s['model']}; {s['requests_note']}.\n\n{workload_table(s)}")
        if s.get("restore_points"):
            parts.append(restore_points_text(s["restore_points"], "the chat's requests"))
        if s.get("divergence_probes"):
            parts.append(
                restore_points_text(s["divergence_probes"], "prompts leaving a stored one at random positions")
            )
    parts.append(f"\n#### Goals\n\n{goals_table(doc['goals'])}")
    return "\n".join(parts)


def restore_points_text(p: dict, what: str) -> str:
    hist = ", ".join(f"{k}: {v}" for k, v in p["histogram"].items())
    return (
        f"\nWhere promptstore hot restored {what}, in tokens before the point where each diverges from what "
        f"the store holds (what an attention-only model restores: a {p['attention_only_cut']:.1%} cut on these "
        f"requests): {p['at_divergence']} of {p['requests']} requests at that point, {p['within_step']} within one "
        f"prefill step ({p['prefill_step']}); gap p50 {p['gap_p50']:.0f}, p95 {p['gap_p95']:.0f}, max "
        f"{p['gap_max']:.0f}; requests by gap: {hist}."
    )


NOTES = """\
How to read the tables:

- **prefilled tokens**: prompt tokens the model computed (prompt minus restored); **cut**: fewer than no cache.
- **TTFT**: from the request's start (lookup or file load included) to the first generated token;
  **hit**: requests that restored at least one token.
- **disk**: bytes of every file the contender left (promptstore: snapshot files and the LMDB index).
- **restore GB/s**: bytes of cache state restored (keys and values up to the hit, window or
  recurrent state) over the time to get them ready (lookup, copy or file read, evaluation), over hits.
- **restore ÷ floor / ÷ mx.load**: that restore time against the same bytes made by one
  `mx.concatenate` (the one-copy floor) or read by `mx.load` from one safetensors file (page cache warm,
  as for every file here). † ceiling rows: promptstore hot's hits with their restore replaced by the ceiling.
- **replies = no cache**: every greedy reply equals the full-prefill reply; a contender that changes
  a reply is wrong.
- **max Δ logprob, 1st token**: the largest difference from no cache's log-probabilities over the
  whole vocabulary at the first generated token: rounding shows as 1e-5 (float32) to 1e-2 (float16);
  a wrong cache would show differences of order one. In float16 a greedy reply can flip where two
  tokens tie at float16's resolution; the list under a table gives each flip with the top-2 margin
  there, and the control row (no cache again, prefill chunked differently) shows full prefill
  flipping about as often.
- The TTFT goals compare whole TTFTs (restore plus the suffix prefill and first token); the detail
  column gives the stricter restore-alone ratio.
- mlx-lm's LRU restores with `copy.deepcopy`, which on the CPU shares the MLX buffer: its copy happens
  at the cache's first write, inside the prefill, so its restore column can beat the one-copy floor.
- Hybrid runs send the chat workload's prompts (when the profile gives them its sizes) to smaller
  models. Their goals: a prefill cut within 2 points of the dense model's on the same chat, disk at
  most mlx-lm's per-conversation files, and every restore within one prefill step of where the
  prompt diverges from what the store holds. promptstore stores sliding-window layers as ranges
  (restorable wherever their last window is stored) and recurrent state at every prefill step
  while it prefills, keeping in files only the states a restore used or that end a leaf or a
  branch point.
"""


def markdown_doc(docs: dict[str, dict], gpu: str = "") -> str:
    parts = [
        "# Benchmarks: promptstore against what you have",
        "",
        "Generated by `tools/bench/bench_anchors.py` (`make bench-anchors`; `--docs-only` renders this page from "
        "the result files under bench-results/ without running anything); do not edit by hand.",
        "Each section is one run, on one machine, with every contender side by side.",
        "",
        NOTES,
    ]
    for label, doc in docs.items():
        parts.append(f"\n## {label}\n")
        parts.append(report(doc))
    if gpu:
        parts.append("\n" + gpu)
    return "\n".join(parts) + "\n"
