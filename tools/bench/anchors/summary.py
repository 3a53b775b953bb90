"""Per-workload summaries of the outcomes, and the result files."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from common import write_results

from .ceilings import ceiling_rows, ceiling_times
from .harness import Outcome, pct
from .workloads import GiB


def summarize_contender(
    name: str,
    outs: list[Outcome],
    reference: dict[str, list[int]],
    nocache_prefilled: int,
    samples: list[dict],
    disk: int | None,
) -> dict:
    hits = [o for o in outs if o.restored]
    # Tokens restored from files: all of them for mlx-lm's files, none for the
    # LRU, what the store read from its cold tier for promptstore.
    from_files = {"mlx-lm cache files": lambda o: o.restored, "mlx-lm LRUPromptCache": lambda o: 0}
    disk_tokens = sum(from_files.get(name.split(" (")[0], lambda o: o.cold_tokens)(o) for o in outs)
    prompt = sum(o.prompt_tokens for o in outs)
    restored = sum(o.restored for o in outs)
    prefilled = prompt - restored
    ttft = [o.ttft_s for o in outs]
    hit_ttft = [o.ttft_s for o in hits]
    mismatched = [o.name for o in outs if o.name in reference and o.reply != reference[o.name]]
    row = {
        "contender": name,
        "requests": len(outs),
        "hits": len(hits),
        "prompt_tokens": prompt,
        "restored_tokens": restored,
        "cold_tokens": sum(o.cold_tokens for o in outs),
        "disk_restored_tokens": disk_tokens,
        "prefilled_tokens": prefilled,
        "prefill_cut": 1 - prefilled / nocache_prefilled if nocache_prefilled else None,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p95_s": pct(ttft, 95),
        "hit_ttft_p50_s": pct(hit_ttft, 50),
        "hit_ttft_p95_s": pct(hit_ttft, 95),
        "disk_bytes": disk,
        "replies_equal": not mismatched,
        "replies_mismatched": mismatched,
        "max_first_token_logprob_diff": max((o.lp_diff0 for o in outs if o.lp_diff0 is not None), default=None),
        "mismatch_detail": [
            {
                "request": o.name,
                "token": o.diverge,
                "margin_no_cache": o.margin_ref,
                "margin_here": o.margin_at,
                "restored": o.restored,
            }
            for o in outs
            if o.diverge is not None
        ],
    }
    if hits and samples:
        rb = sum(o.restored_bytes for o in hits)
        rs = sum(o.restore_s for o in hits)
        floors = [ceiling_times(o.restored_bytes, samples) for o in hits]
        fs, ls = sum(f for f, _ in floors), sum(lo for _, lo in floors)
        row.update(
            {
                "restored_bytes": rb,
                "restore_s": rs,
                "restore_gbps": rb / rs / 1e9 if rs else None,
                "restore_vs_floor": rs / fs if fs else None,
                "restore_vs_load": rs / ls if ls else None,
                # each hit's TTFT against the same hit with its restore done at the ceiling
                "hit_ttft_vs_floor_p50": pct(
                    [o.ttft_s / (o.ttft_s - o.restore_s + f) for o, (f, _) in zip(hits, floors)], 50
                ),
                "hit_ttft_vs_load_p50": pct(
                    [o.ttft_s / (o.ttft_s - o.restore_s + lo) for o, (_, lo) in zip(hits, floors)], 50
                ),
            }
        )
    return row


def summarize_workload(
    name: str,
    desc: str,
    results: dict[str, list[Outcome]],
    reference: dict,
    samples: list[dict],
    disks: dict[str, int | None],
    wall: float,
    extra: dict | None = None,
) -> dict:
    base = results["no cache"]
    nocache_prefilled = sum(o.prompt_tokens for o in base)
    rows = [
        summarize_contender(n, outs, reference, nocache_prefilled, samples, disks.get(n)) for n, outs in results.items()
    ]
    hot = results.get("promptstore hot") or results.get("promptstore (restarted)")
    rows += ceiling_rows(hot or [], samples)
    return {
        "workload": name,
        "model": desc,
        "rows": rows,
        "ceiling_samples": samples,
        "wall_s": wall,
        "outcomes": {n: [asdict(o) for o in outs] for n, outs in results.items()},
        **(extra or {}),
    }


def row_of(summary: dict, name: str) -> dict | None:
    return next((r for r in summary["rows"] if r["contender"] == name), None)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_ms(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def fmt_sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def save_split(out_path: Path, payload: dict, blas: dict) -> Path:
    """The summary to `out_path` (common.write_results), every request's
    outcome to `<name>.requests.json` beside it (compact: it is large)."""
    workloads = {n: {k: v for k, v in w.items() if k != "outcomes"} for n, w in payload["workloads"].items()}
    requests = {n: w["outcomes"] for n, w in payload["workloads"].items() if "outcomes" in w}
    path = write_results(
        out_path, dict(payload, workloads=workloads, requests_file=out_path.with_suffix(".requests.json").name), blas
    )
    if requests:
        path.with_suffix(".requests.json").write_text(json.dumps(requests, separators=(",", ":")) + "\n")
    return path
