"""The store end to end: the demo's workload as a benchmark, and a hit's restore
overhead against the one-copy floor.

1. Workload (promptstore.demo's chats over shared system prompts and agent forks,
   on its random-weight llama and in-process tokenizer): run without a store,
   with a fresh store, and after a restart (a new PromptStore with no hot tier,
   so every hit comes from disk). Reports prefill tokens saved, and time to
   first token p50 / p95 for misses, hot hits and cold hits.
2. Restore overhead: a 4,096-token prefix stored as four nodes on a
   Llama-3.2-1B-shaped layer stack (float16 KV, filled directly); a hot fetch
   against one mx.concatenate of the same bytes (goal: at most 2x).

Prints tables, writes JSON. Say which BLAS ran: the no-store baseline is only
fair with OpenBLAS preloaded on Linux.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import blas_info, blas_warning, summarize, sync, write_results  # noqa: E402

from promptstore import (
    PromptStore,  # noqa: E402
    demo,  # noqa: E402
)
from promptstore.caches import make_prompt_cache  # noqa: E402
from promptstore.testing.models import llama_1b_shape  # noqa: E402


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else None


def workload(store_dir: Path) -> dict:
    model, tokenizer, model_id = demo.load(None)
    rounds = demo.workload()
    demo.serve(model, tokenizer, None, [[rounds[0][0]]])  # warm-up
    plain = demo.serve(model, tokenizer, None, rounds)
    with PromptStore.open(store_dir, checkpoint_interval=256) as store:
        fresh = demo.serve(model, tokenizer, store.bind(model, model_id=model_id), rounds)
    with PromptStore.open(store_dir, checkpoint_interval=256, hot_bytes=0) as store:
        cold = demo.serve(model, tokenizer, store.bind(model, model_id=model_id), rounds)
    same = all(a.reply == b.reply for a, b in zip(plain, fresh)) and all(
        a.reply == b.reply for a, b in zip(plain, cold)
    )
    groups = {
        "no store": [o.ttft for o in plain],
        "miss": [o.ttft for o in fresh + cold if o.restored_hot + o.restored_cold == 0],
        "hot hit": [o.ttft for o in fresh if o.restored_hot > 0],
        "cold hit": [o.ttft for o in cold if o.restored_cold > 0],
    }
    prompt = sum(o.prompt_tokens for o in plain)
    saved = {
        name: sum(o.restored_hot + o.restored_cold for o in run) for name, run in (("fresh", fresh), ("restart", cold))
    }
    return {
        "requests": len(plain),
        "prompt_tokens": prompt,
        "restored_tokens": saved,
        "prefill_saved_fraction": {k: v / prompt for k, v in saved.items()},
        "ttft": {k: {"n": len(v), "p50_s": pct(v, 0.5), "p95_s": pct(v, 0.95)} for k, v in groups.items()},
        "replies_equal": same,
    }


def restore_overhead(store_dir: Path, tokens: int, layers: int, runs: int) -> dict:
    model = llama_1b_shape(layers, dtype=mx.float16, vocab_size=512)
    toks = mx.random.randint(0, 512, (tokens + 1,), key=mx.random.key(3))
    with PromptStore.open(store_dir, durability="write_back") as store:
        space = store.bind(model, model_id="bench-1b-shape")
        cache = make_prompt_cache(model)
        key = mx.random.key(0)
        for end in range(tokens // 4, tokens + 1, tokens // 4):
            for c in cache:
                key, k1, k2 = mx.random.split(key, 3)
                shape = (1, 8, tokens // 4, 64)
                c.update_and_fetch(
                    mx.random.normal(shape, key=k1).astype(mx.float16),
                    mx.random.normal(shape, key=k2).astype(mx.float16),
                )
            space.insert(toks[:end], cache)
        nodes = list(store.index.iter_nodes(space.namespace))
        pieces = [
            [s.arrays[n] for s in store.tiers.get(node) for n in ("keys", "values")]
            for node in sorted(nodes, key=lambda n: n.start)
        ]
        per_array = list(zip(*pieces))  # each layer's keys (or values) across the four nodes
        mx.clear_cache()  # start from an empty buffer cache: what is in it decides who faults
        fetch_s, floor_s = [], []

        def fetch():
            hit = space.fetch(toks)
            assert hit.length == tokens
            return [a for c in hit.cache for a in (c.keys, c.values)]

        def floor():
            return [mx.concatenate(list(p), axis=2) for p in per_array]

        for i in range(runs + 3):
            # Each side is timed right after an untimed twin of itself has
            # freed its buffers, so both reuse MLX's freed buffers alike
            # (fresh pages fault, and faults are slow on this VM).
            for fn, samples in ((fetch, fetch_s), (floor, floor_s)):
                sync(fn())
                t0 = time.perf_counter()
                sync(fn())
                if i >= 3:
                    samples.append(time.perf_counter() - t0)
    f, fl = summarize(fetch_s), summarize(floor_s)
    return {
        "tokens": tokens,
        "layers": layers,
        "nodes": 4,
        "fetch": f,
        "floor": fl,
        "fetch_over_floor": f["median_s"] / fl["median_s"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--skip-workload", action="store_true")
    parser.add_argument(
        "--cache-limit-mib",
        type=int,
        default=None,
        help="MLX buffer-cache limit (default: MLX's); with a small one, whichever side "
        "allocates after the other frees pays fresh page faults",
    )
    parser.add_argument("--out", default="bench-results/store.json")
    args = parser.parse_args(argv)
    if args.cache_limit_mib is not None:
        mx.set_cache_limit(args.cache_limit_mib * 2**20)
    blas = blas_info()
    warning = blas_warning(blas)
    if warning:
        print(warning)
    with tempfile.TemporaryDirectory() as tmp:
        work = None if args.skip_workload else workload(Path(tmp) / "demo")
        over = restore_overhead(Path(tmp) / "overhead", args.tokens, args.layers, args.runs)
    if work:
        print(
            f"workload: {work['requests']} requests, {work['prompt_tokens']} prompt tokens; replies equal: {work['replies_equal']}"
        )
        for k, v in work["prefill_saved_fraction"].items():
            print(f"  prefill tokens saved ({k}): {v:.1%}")
        print(f"  {'TTFT':12} {'n':>4} {'p50 ms':>9} {'p95 ms':>9}")
        for k, v in work["ttft"].items():
            if v["n"]:
                print(f"  {k:12} {v['n']:4d} {v['p50_s'] * 1e3:9.1f} {v['p95_s'] * 1e3:9.1f}")
    print(
        f"restore overhead ({over['tokens']} tokens in {over['nodes']} nodes, {over['layers']} layers, float16): "
        f"fetch {over['fetch']['median_s'] * 1e3:.2f} ms vs one concatenate {over['floor']['median_s'] * 1e3:.2f} ms "
        f"= {over['fetch_over_floor']:.2f}x (goal <= 2x)"
    )
    out = write_results(
        args.out, {"benchmark": "store", "settings": vars(args), "workload": work, "restore_overhead": over}, blas
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
