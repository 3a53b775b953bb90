"""Where a hot round's time goes: promptstore serve's ways of storing a reply, beside mlx_lm.server.

The hot round is the everyday one: a conversation in memory, only the new
message to prefill. A finished chat reply is stored as the next turn will send
it, which prefills the re-rendered reply (`--reply-tokens rendered`, the
default) before the next turn's fetch (`--reply-before-fetch`); or it is stored
as generated and the next turn's batch prefills what differs, as mlx_lm.server
does (`--reply-tokens generated`). This runs the same users' rounds through
mlx_lm.server and each variant, interleaved (who goes first alternates), then
one conversation alone, and prints TTFT p50 per round with promptstore's
per-request phases from its log.

    python tools/bench/probe_hot_round.py --profile cuda --out bench-results/probe-hot-round-cuda.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from bench_serve import PROFILES, VOCAB, Contender, Server, text_of, timelines, warm_up_process
from common import OPENBLAS_HINT, blas_info, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from promptstore.testing.model_dir import write_model_dir  # noqa: E402

VARIANTS = {
    "promptstore serve": [],
    "promptstore serve (generated replies)": ["--reply-tokens", "generated"],
    "promptstore serve (no reply before fetch)": ["--no-reply-before-fetch"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default="promptstore serve,promptstore serve (generated replies)")
    p.add_argument("--out", default="bench-results/probe-hot-round.json")
    args = p.parse_args()
    profile = PROFILES[args.profile]
    work = Path(tempfile.mkdtemp(prefix="probe-hot-"))
    try:
        return run(args, profile, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, profile: dict, work: Path) -> int:
    model = write_model_dir(
        work / "model", "llama", vocab_size=VOCAB, dtype=getattr(mx, profile["dtype"]), **profile["model"]
    )
    mx.clear_cache()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if args.profile == "cpu" and Path(OPENBLAS_HINT).exists():
        env["LD_PRELOAD"] = OPENBLAS_HINT
    answer = profile["answer_tokens"]
    common = ["--model", str(model), "--prompt-cache-size", "100", "--max-tokens", str(answer)]
    py = sys.executable
    ps = [py, "-m", "promptstore", "serve", *common]
    if args.profile == "cuda":
        warm = argparse.Namespace(
            system_tokens=profile["system_tokens"], context_tokens=profile["context_tokens"], users=profile["users"]
        )
        warm.answer_tokens = answer
        warm_up_process(work, ps, env, warm)
    servers = {"mlx_lm.server": Server("mlx_lm.server", [py, "-m", "mlx_lm", "server", *common], env, work / "mlx.log")}
    for i, name in enumerate(args.variants.split(",")):
        store = work / f"store-{i}"
        servers[name] = Server(name, [*ps, *VARIANTS[name], "--store", str(store)], env, work / f"ps-{i}.log")
    system = text_of(profile["system_tokens"], 0)
    users = [
        [{"role": "system", "content": system + "\n\n" + text_of(profile["context_tokens"], 11 * (u + 1))}]
        for u in range(profile["users"])
    ]
    alone = [[{"role": "system", "content": text_of(profile["system_tokens"] + profile["context_tokens"], 3)}]]
    started = {name: s.start() for name, s in servers.items()}
    many = {name: Contender(s, users) for name, s in started.items()}
    one = {name: Contender(s, alone) for name, s in started.items()}
    names = list(servers)
    table: dict[str, dict[str, float]] = {name: {} for name in names}
    for label, contenders in (("users", many), ("alone", one)):
        for turn in range(args.rounds):
            for name in names if turn % 2 == 0 else names[::-1]:
                contenders[name].round(label, turn, answer)
                ttft = [r["ttft_s"] for r in contenders[name].results if r["turn"] == turn]
                table[name][f"{label} {turn}"] = statistics.median(ttft)
                print(f"  {label} {turn}: {name} TTFT p50 {statistics.median(ttft) * 1e3:,.0f} ms", flush=True)
    for s in servers.values():
        s.stop()
    base = table["mlx_lm.server"]
    payload = {
        "profile": args.profile,
        "note": profile["note"],
        "ttft_p50_s": table,
        "ratio_to_mlx_lm_server": {n: {k: v / base[k] for k, v in t.items()} for n, t in table.items()},
        "timelines": {n: timelines(s.log) for n, s in servers.items() if n != "mlx_lm.server"},
        "requests": {n: many[n].results + one[n].results for n in names},
    }
    print(f"\n{'round':10}" + "".join(f"{n[:28]:>30}" for n in names))
    for k in base:
        print(f"{k:10}" + "".join(f"{table[n][k] * 1e3:24.0f} ms {table[n][k] / base[k]:4.2f}" for n in names))
    for n, rows in payload["timelines"].items():
        keys = [k for k in rows[0] if k.endswith("_ms")] if rows else []
        print(f"{n}: " + " ".join(f"{k[:-3]}={statistics.median(r.get(k, 0.0) for r in rows):.1f}" for k in keys))
    print(f"wrote {write_results(args.out, payload, blas_info())}")
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"{time.perf_counter() - started:.0f} s")
    sys.exit(code)
