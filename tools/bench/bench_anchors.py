"""Anchors: promptstore against what users already have, measured in one run.

Workloads (token ids drawn from a seeded generator: no tokenizer is loaded, so
the same script runs where only mlx and mlx-lm are installed):

- chat     conversations over shared system prompts; every turn resends the
           history (with the reply) plus a new user message.
- restart  the chat resumed in a fresh process: one more turn of every
           conversation, after the stores were closed and the process ended.
- fork     an agent conversation forked into a tree of branches (tool
           results, then retries of each), then back to earlier points.
- hybrid   the chat workload (the same prompts) on a sliding-window model
           (gemma3_text layout) and a recurrent hybrid (qwen3_next layout); it
           reports where promptstore restored against where each prompt diverges
           from what it stores, and its prefill cut against the dense model's.

Contenders, run one after another on the same requests and the same model:

- no cache           full prefill every request (it also gives the reference
                     replies every other contender must reproduce, greedy).
- mlx-lm LRU         mlx_lm.models.cache.LRUPromptCache used the way
                     mlx_lm.server (batched path, the one every model with
                     mergeable caches takes) uses it: fetch_nearest_cache
                     (deep copy, trim when the nearest entry is longer), the
                     system-prompt segment inserted when its prefill ends,
                     prompt + reply inserted after generation, server default
                     --prompt-cache-size 10. After a restart it holds nothing.
- mlx-lm files       mlx_lm's save_prompt_cache / load_prompt_cache, one file
                     per conversation (a fork starts from its parent's file),
                     trimmed to the common prefix where the cache allows.
- promptstore hot    PromptStore defaults (write_back, hot tier 2 GiB unless
                     the profile says otherwise), told the end of the system
                     segment as mlx-lm's server is (fetch(checkpoints=...)).
- promptstore cold   hot_bytes=0, spills flushed after every request: every
                     hit is read from its files.
- ceilings           per hit, the same restored bytes produced by one
                     mx.concatenate (the one-copy floor) and by mx.load of one
                     safetensors file holding them.

Every contender generates with mlx_lm.generate.generate_step (what
mlx_lm.stream_generate and the server run) and greedy sampling; prefill is
chunked by the same step everywhere. promptstore's contender makes exactly the
calls promptstore.stream_generate(checkpoints=[end of the system segment])
makes (fetch; prefill to each checkpoint and insert; generate; insert prompt +
reply), through the public Space API.

Reported per workload and contender: tokens prefilled, time to first token
(TTFT) p50 / p95 over all requests and over hits, bytes on disk, restore GB/s
next to the ceilings, and whether every reply equals the no-cache reply; then
the issue's goals, a row each: what, the figure, the goal.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python tools/bench/bench_anchors.py            # CPU, ~10 min
    .venv/bin/python tools/bench/bench_anchors.py --quick        # smoke, < 1 min
    python tools/bench/bench_anchors.py --profile cuda           # MLX CUDA backend

Writes bench-results/anchors-<profile>.json, a PNG beside it (with
matplotlib, through anchors/plot.py) and, for the cpu and cuda profiles,
docs/benchmarks.md from whichever of anchors-cpu.json / anchors-cuda.json exist.

This file is the command line; what it runs lives in the package tools/bench/anchors/, a module
for each part: the workloads and models, the contenders (harness, lru, files, store), the
ceilings, the restart, the hybrids, the summaries, the goals and the report (the docs writer).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors.goals import goals
from anchors.harness import Engine, log, warm_up
from anchors.hybrid import FAMILIES, run_hybrid
from anchors.models import build_model
from anchors.report import report
from anchors.restart import restart_phase, run_chat_and_restart
from anchors.runs import run_fork
from anchors.summary import save_split
from anchors.workloads import PROFILES
from benchmarks_doc import write_docs
from common import REPO_ROOT, blas_info, blas_warning, gpu_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--profile", choices=sorted(PROFILES), default=None, help="cpu (default on CPU), cuda (default on a GPU), quick"
    )
    ap.add_argument("--quick", action="store_true", help="same as --profile quick")
    ap.add_argument("--workloads", default=None, help="comma-separated subset of chat,restart,fork,hybrid")
    ap.add_argument("--out", default=None, help="result JSON (default bench-results/anchors-<profile>.json)")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    ap.add_argument("--docs-only", action="store_true", help="rewrite docs/benchmarks.md from the result files")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--state", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    on_gpu = mx.default_device() == mx.gpu
    name = "quick" if args.quick else (args.profile or ("cuda" if on_gpu else "cpu"))
    profile = PROFILES[name]
    if args.workloads:
        profile = replace(profile, workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()))

    if args.phase == "restart":
        restart_phase(Path(args.state), Path(args.result), profile)
        return 0
    if args.docs_only:
        return write_docs()

    blas = blas_info()
    warning = blas_warning(blas)
    if warning and not on_gpu:
        print(warning, file=sys.stderr)
    out_path = Path(args.out) if args.out else REPO_ROOT / "bench-results" / f"anchors-{profile.name}.json"
    started = time.perf_counter()
    workloads: dict[str, dict] = {}

    def save(partial: bool) -> Path:
        # After every workload too, so a run cut short keeps what it measured.
        payload = {
            "benchmark": "anchors",
            "partial": partial,
            "profile": asdict(profile),
            "wall_s": time.perf_counter() - started,
            "workloads": workloads,
            "goals": goals(workloads),
            "gpu": gpu_name(),
        }
        return save_split(out_path, payload, blas)

    with tempfile.TemporaryDirectory(prefix="anchors-") as tmp:
        tmp = Path(tmp)
        log(f"profile {profile.name}: building the llama model")
        model, model_id, desc = build_model(profile)
        engine = Engine(model, profile)
        warm_up(engine)

        if "chat" in profile.workloads or "restart" in profile.workloads:
            run_chat_and_restart(profile, engine, model_id, desc, tmp, workloads, save)

        if "fork" in profile.workloads:
            log("fork")
            workloads["fork"] = run_fork(profile, engine, model_id, desc, tmp / "fork")
            save(partial=True)

        del engine, model
        if "hybrid" in profile.workloads:
            for family in FAMILIES:
                log(f"hybrid {family}")
                workloads[f"hybrid-{family}"] = run_hybrid(profile, family, tmp)
                save(partial=True)

    path = save(partial=False)
    doc = json.loads(path.read_text())
    print(report(doc))
    if warning and not on_gpu:
        print(warning)
    print(f"\nwrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}")
    try:
        from anchors.plot import plot

        png = plot(path)
        print(f"wrote {png.relative_to(REPO_ROOT) if png.is_relative_to(REPO_ROOT) else png}")
    except ImportError as e:
        print(f"no PNG: {e} (add matplotlib to draw bench-results/anchors-*.png)")
    if (
        profile.name in ("cpu", "cuda")
        and not args.no_docs
        and out_path == REPO_ROOT / "bench-results" / f"anchors-{profile.name}.json"
    ):
        write_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
