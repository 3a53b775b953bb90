"""Benchmark snapshot, split, merge and restore against one copy and against re-prefilling.

The cache of a `--tokens` prefix on llama_1b_shape(`--layers`, float16) (Llama-3.2-1B's
per-layer shape: 8 KV heads x head dim 64) is filled directly with random float16
keys and values through `update_and_fetch`, in prefill-sized chunks, taking a snapshot
of each quarter of the prefix on the way. Then, each with warm-up and repeated runs,
everything evaluated inside the timed region:

  snapshot        snapshot_prompt_cache(cache, 0): a copy of every position
  split           split_prompt_snapshots(whole-prefix snapshots, tokens // 2)
  merge           the four quarter snapshots folded with merge_prompt_snapshots
  merge+restore   that merge, then restore_prompt_cache into fresh caches
  merge chain     merge_prompt_chain: the four quarters in one concatenation per array
  chain+restore   that one-copy merge, then restore_prompt_cache
  restore 1       restore_prompt_cache from the whole-prefix snapshots
  chain restore   restore_prompt_cache from the four quarters as a chain (per layer)
  floor           one mx.concatenate of the four quarters per array: the cost of
                  moving the state's bytes once (the ratios' denominator)
  flat copy       for reference: mx.array of each contiguous whole-prefix array, a
                  plain memcpy (faster than concatenate's strided copy)
  prefill         a forward of the prefix through a float32 copy of the model, as
                  mlx-lm's prefill does it (chunks of --prefill-steps, evaluating the
                  cache state after each); float16 only extrapolated from a few tokens

Prints a table and writes JSON (relative paths are from the repository root). On
Linux run it with OpenBLAS preloaded, or the float32 prefill baseline is unfair:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python tools/bench/bench_snapshots.py [--quick] [--out bench-results/snapshots.json]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import mlx.core as mx
from common import blas_info, blas_warning, cache_limit, sync, timed, write_results

from promptstore.caches import (
    make_prompt_cache,
    merge_prompt_chain,
    merge_prompt_snapshots,
    restore_prompt_cache,
    snapshot_prompt_cache,
    split_prompt_snapshots,
)
from promptstore.testing import llama_1b_shape

FULL = {
    "tokens": 4096,
    "runs": 20,
    "warmup": 3,
    "prefill_runs": 3,
    "prefill_steps": "2048,512",
    "fp16_prefill_tokens": 64,
}
QUICK = {"tokens": 512, "runs": 3, "warmup": 1, "prefill_runs": 1, "prefill_steps": "512", "fp16_prefill_tokens": 16}
SPANS = 4  # the prefix is snapshotted in four consecutive spans while it fills
FILL_CHUNK = 512  # positions per update_and_fetch while filling


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results/snapshots.json", help="JSON results path")
    p.add_argument("--tokens", type=int, help=f"prefix length (default {FULL['tokens']}; multiple of {SPANS})")
    p.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    p.add_argument("--runs", type=int, help=f"timed runs per copy operation (default {FULL['runs']})")
    p.add_argument("--warmup", type=int, help=f"untimed runs first (default {FULL['warmup']})")
    p.add_argument("--prefill-runs", type=int, help=f"timed prefills per step size (default {FULL['prefill_runs']})")
    p.add_argument(
        "--prefill-steps",
        help=f"comma-separated prefill chunk sizes (default {FULL['prefill_steps']}; mlx-lm's generate_step uses 2048)",
    )
    p.add_argument(
        "--fp16-prefill-tokens",
        type=int,
        help=f"tokens of float16 forward to extrapolate from; 0 skips (default {FULL['fp16_prefill_tokens']})",
    )
    p.add_argument("--skip-prefill", action="store_true", help="no prefill baselines")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument(
        "--cache-limit-mib",
        type=int,
        help="set MLX's buffer-cache limit first (default: leave MLX's own); a limit below "
        "the state's size makes every fresh output fault its pages in again",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.tokens <= 0 or args.tokens % SPANS:
        p.error(f"--tokens must be a positive multiple of {SPANS}")
    args.prefill_steps = [int(s) for s in str(args.prefill_steps).split(",") if s.strip()]
    return args


def arrays(snapshots) -> list:
    return [a for s in snapshots if s is not None for a in s.all_arrays()]


def buffers(caches) -> list:
    return [b for c in caches for b in (c.keys, c.values)]


def fill(model, tokens: int, seed: int):
    """Caches holding `tokens` random float16 positions, and per-layer snapshots of
    each of the SPANS consecutive spans, taken as the fill passes their ends."""
    args = model.args
    heads = args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    span = tokens // SPANS
    chunk = math.gcd(FILL_CHUNK, span)
    caches = make_prompt_cache(model)
    key = mx.random.key(seed)
    spans = []
    for off in range(0, tokens, chunk):
        for c in caches:
            key, k1, k2 = mx.random.split(key, 3)
            shape = (1, heads, chunk, dim)
            c.update_and_fetch(
                mx.random.normal(shape, key=k1).astype(mx.float16), mx.random.normal(shape, key=k2).astype(mx.float16)
            )
        sync(buffers(caches))
        end = off + chunk
        if end % span == 0:
            snaps = snapshot_prompt_cache(caches, end - span)
            sync(arrays(snaps))
            spans.append(snaps)
    return caches, spans


def fold(spans):
    """Left fold with merge_prompt_snapshots: ((s1 + s2) + s3) + s4, as a chain grows."""
    acc = spans[0]
    for nxt in spans[1:]:
        acc = merge_prompt_snapshots(acc, nxt)
    return acc


def check_restored(caches, reference, tokens: int) -> None:
    for c, r in zip(caches, reference):
        assert c.offset == tokens, (c.offset, tokens)
        for a, b in ((c.keys, r.keys), (c.values, r.values)):
            assert mx.array_equal(a[..., :tokens, :], b[..., :tokens, :]).item(), "restored bytes differ"


def copy_benchmarks(model, args) -> tuple[dict, dict]:
    tokens, half = args.tokens, args.tokens // 2
    caches, spans = fill(model, tokens, args.seed)
    full = snapshot_prompt_cache(caches, 0)
    sync(arrays(full))
    merged = fold(spans)
    sync(arrays(merged))
    chains = [[sp[i] for sp in spans] for i in range(len(caches))]
    state_bytes = sum(a.nbytes for a in arrays(full))

    def fresh():
        return make_prompt_cache(model)

    # Correctness, untimed: every path must give back the filled bytes.
    for snaps in (merged, chains, full):
        c = fresh()
        assert restore_prompt_cache(c, snaps, tokens)
        check_restored(c, caches, tokens)
    uppers, lowers = split_prompt_snapshots(merged, half)
    assert all(u.end == half and lo.start == half for u, lo in zip(uppers, lowers))

    def merge_restore(c):
        m = fold(spans)
        assert restore_prompt_cache(c, m, tokens)
        return arrays(m) + buffers(c)

    def chain_merge_restore(c):
        m = merge_prompt_chain(spans)
        assert restore_prompt_cache(c, m, tokens)
        return arrays(m) + buffers(c)

    def restore(snaps):
        def run(c):
            assert restore_prompt_cache(c, snaps, tokens)
            return buffers(c)

        return run

    def split():
        uppers, lowers = split_prompt_snapshots(merged, half)
        return arrays(uppers + lowers)

    def floor():
        return [
            mx.concatenate([sp[i].arrays[n] for sp in spans], axis=2)
            for i in range(len(caches))
            for n in ("keys", "values")
        ]

    ops = {
        "snapshot": {"fn": lambda: arrays(snapshot_prompt_cache(caches, 0))},
        "split": {"fn": split},
        "merge": {"fn": lambda: arrays(fold(spans))},
        "merge_restore": {"fn": merge_restore, "setup": fresh},
        "merge_chain": {"fn": lambda: arrays(merge_prompt_chain(spans))},
        "merge_chain_restore": {"fn": chain_merge_restore, "setup": fresh},
        "restore_one": {"fn": restore(full), "setup": fresh},
        "chain_restore": {"fn": restore(chains), "setup": fresh},
        "floor": {"fn": floor},
        # Not the floor the ratios use: one flat copy of contiguous arrays (what
        # snapshot's copy of a whole buffer is); concatenate copies through strides.
        "flat_copy": {"fn": lambda: [mx.array(a) for a in arrays(full)]},
    }
    results = {}
    for name, op in ops.items():
        r = timed(op["fn"], runs=args.runs, warmup=args.warmup, setup=op.get("setup"))
        r["gb_per_s"] = state_bytes / r["median_s"] / 1e9
        results[name] = r
    floor_s = results["floor"]["median_s"]
    for r in results.values():
        r["x_floor"] = r["median_s"] / floor_s
    shape = {
        "layers": len(caches),
        "kv_shape": list(full[0].arrays["keys"].shape),
        "dtype": str(full[0].arrays["keys"].dtype).split(".")[-1],
        "state_bytes": state_bytes,
        "span_tokens": tokens // SPANS,
        "fill_chunk": math.gcd(FILL_CHUNK, tokens // SPANS),
    }
    return results, shape


def prefill_once(model, toks: mx.array, step: int):
    cache = make_prompt_cache(model)
    for i in range(0, toks.size, step):
        model(toks[None, i : i + step], cache=cache)
        mx.eval([c.state for c in cache])  # as mlx-lm's generate_step: logits never computed
    return [c.state for c in cache]


def prefill_benchmarks(args) -> dict:
    out: dict = {"float32": {}, "float16": None}
    toks = mx.random.randint(0, 32000, (args.tokens,), key=mx.random.key(args.seed + 1))
    model32 = llama_1b_shape(args.layers, dtype=mx.float32)
    prefill_once(model32, toks[:64], 64)  # warm-up: first matmuls, allocations
    for step in args.prefill_steps:
        r = timed(lambda m=model32, s=step: prefill_once(m, toks, s), runs=args.prefill_runs, warmup=0)
        r["tokens_per_s"] = args.tokens / r["median_s"]
        out["float32"][str(step)] = r
        print(f"  prefill float32, step {step}: median {r['median_s']:.2f} s", flush=True)
    del model32
    mx.clear_cache()
    n = min(args.fp16_prefill_tokens, args.tokens)
    if n > 0:
        model16 = llama_1b_shape(args.layers, dtype=mx.float16)
        prefill_once(model16, toks[:8], 8)
        r = timed(lambda m=model16: prefill_once(m, toks[:n], n), runs=1, warmup=0)
        out["float16"] = {
            "measured_tokens": n,
            "measured": r,
            "extrapolated_s": r["median_s"] / n * args.tokens,
            "method": f"EXTRAPOLATED linearly from one {n}-token forward to {args.tokens} tokens; "
            "a lower bound (attention's cost grows with context and is not scaled up)",
        }
        print(f"  prefill float16, {n} tokens: {r['median_s']:.2f} s", flush=True)
    return out


def ms(s: float) -> str:
    return f"{s * 1e3:9.2f}"


def print_table(copies: dict, prefill: dict | None, shape: dict, args, fair: bool = True) -> dict:
    labels = {
        "snapshot": f"snapshot [0, {args.tokens})",
        "split": f"split at {args.tokens // 2}",
        "merge": f"merge {SPANS} spans (left fold)",
        "merge_restore": f"merge {SPANS} + restore",
        "merge_chain": f"merge chain of {SPANS} (one copy)",
        "merge_chain_restore": f"merge chain of {SPANS} + restore",
        "restore_one": "restore from 1 snapshot",
        "chain_restore": f"chain restore ({SPANS} spans)",
        "floor": "floor: 1 concatenate",
        "flat_copy": "ref: flat copy (mx.array)",
    }
    mib = shape["state_bytes"] / 2**20
    print(
        f"\n{args.tokens} tokens, {shape['layers']} layers, keys+values {shape['kv_shape']} "
        f"{shape['dtype']}: {mib:.1f} MiB of cache state; {args.runs} runs after {args.warmup} warm-up"
    )
    print(f"{'operation':<30} {'median ms':>9} {'p95 ms':>9} {'GB/s':>7} {'x floor':>8} {'faults':>7}")
    for name, label in labels.items():
        r = copies[name]
        print(
            f"{label:<30} {ms(r['median_s'])} {ms(r['p95_s'])} {r['gb_per_s']:7.2f} {r['x_floor']:8.2f} "
            f"{r.get('minor_faults_median', 0):7.0f}"
        )
    print(
        "(GB/s: state bytes / median; faults: median minor page faults per run, "
        f"{shape['state_bytes'] // 4096} = the state's size in 4 KiB pages)"
    )
    ratios = {
        f"{k}/floor": copies[k]["x_floor"]
        for k in ("snapshot", "split", "merge_restore", "merge_chain_restore", "chain_restore")
    }
    if prefill:
        print(f"\n{'prefill (forward of the prefix)':<38} {'median s':>9} {'p95 s':>8} {'tok/s':>8} {'runs':>5}")
        best = None
        for step, r in prefill["float32"].items():
            print(
                f"{'float32, chunks of ' + step:<38} {r['median_s']:9.2f} {r['p95_s']:8.2f} "
                f"{r['tokens_per_s']:8.1f} {r['runs']:5d}"
            )
            if best is None or r["median_s"] < prefill["float32"][best]["median_s"]:
                best = step
        f16 = prefill["float16"]
        if f16:
            print(
                f"{'float16 EXTRAPOLATED from ' + str(f16['measured_tokens']) + ' tok':<38} "
                f"{f16['extrapolated_s']:9.2f} {'-':>8} {args.tokens / f16['extrapolated_s']:8.1f} {1:5d}"
            )
        if best is not None:
            prefill["baseline"] = f"float32, chunks of {best} (the fastest measured)"
            base = prefill["float32"][best]["median_s"]
            ratios["prefill/chain_restore"] = base / copies["chain_restore"]["median_s"]
            if f16:
                ratios["prefill_fp16_extrapolated/chain_restore"] = (
                    f16["extrapolated_s"] / copies["chain_restore"]["median_s"]
                )
    print("\nratios (medians):")
    for k, v in ratios.items():
        print(f"  {k:<42} {v:10.2f}")
    if prefill and "baseline" in prefill:
        print(f"  (prefill = {prefill['baseline']})")
        if not fair:
            print("  !! prefill ratios are UNFAIR: float32 ran without OpenBLAS (see the warning)")
    return ratios


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    blas = blas_info()
    print(
        f"BLAS: {blas['name']} (cblas_sgemm resolves to {blas.get('cblas_sgemm_from') or 'no global symbol'}; "
        f"mapped: {', '.join(Path(p).name for p in blas['libraries']) or 'none'})"
    )
    warning = blas_warning(blas)
    if warning and not args.skip_prefill:
        print(warning, flush=True)
    if args.cache_limit_mib is not None:
        mx.set_cache_limit(args.cache_limit_mib * 2**20)
    print(f"MLX buffer-cache limit: {cache_limit() / 2**20:.0f} MiB", flush=True)
    mx.random.seed(args.seed)
    model16 = llama_1b_shape(args.layers, dtype=mx.float16)
    print("copy operations...", flush=True)
    copies, shape = copy_benchmarks(model16, args)
    del model16
    mx.clear_cache()
    prefill = None
    if not args.skip_prefill:
        print("prefill baselines...", flush=True)
        prefill = prefill_benchmarks(args)
    ratios = print_table(copies, prefill, shape, args, fair=blas["openblas"] is not False)
    if warning and not args.skip_prefill:
        print(warning)
    elapsed = time.perf_counter() - started
    settings = {
        k: getattr(args, k)
        for k in (
            "tokens",
            "layers",
            "runs",
            "warmup",
            "prefill_runs",
            "prefill_steps",
            "fp16_prefill_tokens",
            "skip_prefill",
            "quick",
            "seed",
            "cache_limit_mib",
        )
    }
    settings["mlx_cache_limit_bytes"] = cache_limit()
    payload = {
        "benchmark": "snapshots",
        "settings": {
            **settings,
            **shape,
            "spans": SPANS,
            "model": "llama_1b_shape",
            "gb_per_s": "state_bytes / median seconds / 1e9 (bytes of cache state produced; "
            "memory traffic is about twice that: read + write)",
            "prefill_method": "model(chunk, cache) per chunk, then mx.eval of every cache's state, "
            "as mlx-lm's generate_step (logits never evaluated)",
        },
        "prefill_fair": bool(blas["openblas"]) if blas["openblas"] is not None else None,
        "copies": copies,
        "prefill": prefill,
        "ratios": ratios,
        "elapsed_s": elapsed,
    }
    out = write_results(args.out, payload, blas)
    print(f"\ntook {elapsed:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
