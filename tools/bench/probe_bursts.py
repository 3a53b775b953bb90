"""Probe: do the requests of a burst prefill together in promptstore serve?

python3 tools/bench/probe_bursts.py [--profile cuda|cpu] [--rounds N] [--out FILE]

bench_serve.py's model and multi-round chat (all users at once each round, one
user first in round 0), served by promptstore serve three times, each time from an
empty store: with `--arrival-wait 0` (the generation thread starts the first
request of a burst as soon as it is queued) and with the default wait (it
waits for the requests whose prompts are being checked at that moment), then
without the wait again (the first server on a machine builds MLX's kernels). For
each round: TTFT p50, and every request's phases from the server's log
(queue, gather, prefill to the first token). It times; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from bench_serve import PROFILES, VOCAB, Contender, Server, text_of, timelines

from promptstore.testing.model_dir import write_model_dir

# The first server of a fresh machine also builds MLX's kernels: the variant without the
# wait runs again last, after both, so that one pair compares servers with built kernels.
VARIANTS = {"no wait": ["--arrival-wait", "0"], "wait (default)": [], "no wait, again": ["--arrival-wait", "0"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", help="JSON path (default: none)")
    args = p.parse_args()
    profile = PROFILES[args.profile]
    work = Path(tempfile.mkdtemp(prefix="probe-bursts-"))
    started = time.perf_counter()
    model = write_model_dir(
        work / "model", "llama", vocab_size=VOCAB, dtype=getattr(mx, profile["dtype"]), **profile["model"]
    )
    print(f"model written in {time.perf_counter() - started:.1f} s", flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    answer = str(profile["answer_tokens"])
    serve = [sys.executable, "-m", "promptstore", "serve", "--model", str(model), "--model-id", "probe"]
    serve += ["--max-tokens", answer]
    system = text_of(profile["system_tokens"], 0)
    conversations = [
        [{"role": "system", "content": system + "\n\n" + text_of(profile["context_tokens"], 11 * (u + 1))}]
        for u in range(profile["users"])
    ]
    out = {"profile": args.profile, "rounds": args.rounds, "variants": {}}
    for name, flags in VARIANTS.items():
        log = work / f"server-{len(out['variants'])}.log"
        server = Server(name, [*serve, "--store", str(work / f"store-{len(out['variants'])}"), *flags], env, log)
        contender = Contender(server.start(), conversations)
        try:
            rounds = []
            for turn in range(args.rounds):
                contender.round("fill", turn, profile["answer_tokens"])
                ttfts = [r["ttft_s"] for r in contender.results if r["turn"] == turn]
                rounds.append(round(statistics.median(ttfts) * 1e3, 1))
                print(f"  {name}: round {turn} TTFT p50 {rounds[-1]:,.0f} ms", flush=True)
        finally:
            server.stop()
        phases = [
            {k: t[k] for k in ("prompt", "queue_ms", "gather_ms", "prefill_first_ms") if k in t} for t in timelines(log)
        ]
        out["variants"][name] = {"ttft_p50_ms_per_round": rounds, "requests": phases}
        print(f"{name}: TTFT p50 per round {rounds}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
