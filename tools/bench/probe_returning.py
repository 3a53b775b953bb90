"""Probe: a returning conversation's first token past its restored cache (CUDA).

promptstore serve's memory-pressure run (`bench_serve.py --workload pressure`)
restores a returning conversation's ~4.1k tokens and prefills the rest (1 to
~70 tokens) through mlx-lm's BatchGenerator. On an H100 that took 77-200 ms
from the fetch to the first token where all but one token were restored in 35.
This runs such requests in one process: 16 caches of 4,114-4,180 tokens with
the exact-size arrays a hit gives, new parts of 1-68 tokens, the server's
kernel warm-up first, variants alternating in blocks:

- `as served`: mlx-lm's BatchGenerator as promptstore serve runs it;
- `pool keeps`: the same, CUDA's default memory pool (where MLX's device
  arrays come from) told to keep what is freed (its release threshold at its
  largest; set for these requests, 0 again after);
- `no clear`: the same, mx.clear_cache a no-op (MLX keeps its freed buffers);
- `forward`: the model's forward of the new tokens but the last, then of the
  last, without the BatchGenerator (the compute alone).

Then two requests of 53 new tokens each of the first three ways, split: each of
mlx-lm's steps synchronised and timed (the merge into its batch, the prompt
step, the split into a generation batch, its first decode step, MLX's buffer
cache emptied). Llama-3.1-8B's shape, random bfloat16 weights.

    python3 tools/bench/probe_returning.py --out bench-results/probe-returning-cuda.json

It times; it asserts nothing. What it found on an H100 (docs/serve.md, the
memory-pressure paragraph; bench-results/archive/2026-11/probe-returning-cuda.*):
the prompt step of a request's new tokens took 59-77 ms as served, 17-19 with
MLX's buffers kept, 21-41 with the pool keeping; to the first token, medians
over all lengths, 61, 55 and 52 ms, the compute alone 25; per length the ways
crossed, four requests a cell.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import mlx.core as mx
from bench_serve import PROFILES, VOCAB
from common import blas_info, describe_device, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlx_lm.models.cache import KVCache  # noqa: E402

from promptstore.serve import warmup  # noqa: E402
from promptstore.snapshots import device  # noqa: E402
from promptstore.testing import tiny_model  # noqa: E402

G = importlib.import_module("mlx_lm.generate")  # the module (the package exports a function of its name)

POOL_RELEASE_THRESHOLD = 4  # cudaMemPoolAttrReleaseThreshold
LENGTHS = [1, 19, 28, 53, 68, 23]  # new tokens past the hit, as pass 2 of the pressure run met them
VARIANTS = ["as served", "pool keeps", "no clear", "forward"]
CONVERSATIONS = 16
SPLIT: dict[str, list[float]] = defaultdict(list)


def pool_keeps(rt, nbytes: int) -> None:
    """Set the release threshold of the device's default memory pool."""
    pool, value = ctypes.c_void_p(), ctypes.c_uint64(nbytes)
    rt.check(rt.lib.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), rt.device.value), "cudaDeviceGetDefaultMemPool")
    code = rt.lib.cudaMemPoolSetAttribute(pool, POOL_RELEASE_THRESHOLD, ctypes.byref(value))
    rt.check(code, "cudaMemPoolSetAttribute")


def restored(stored: int, seed: int, layers: int, kv_heads: int, head_dim: int) -> list[KVCache]:
    """A hit's cache: each layer's keys and values exactly `stored` tokens long."""
    cache = []
    for layer in range(layers):
        key = mx.random.key(seed * 1000 + layer)
        kv = mx.random.normal((2, 1, kv_heads, stored, head_dim), key=key).astype(mx.bfloat16) * 0.1
        c = KVCache()
        c.keys, c.values, c.offset = kv[0], kv[1], stored
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


def served(model, cache, stored: int, new: list[int]) -> float:
    """Seconds from the BatchGenerator's insert to the first token of `new`."""
    gen = G.BatchGenerator(
        model, completion_batch_size=32, prefill_batch_size=8, prefill_step_size=2048, stream=mx.default_stream(mx.gpu)
    )
    prefix = [1 + (i * 31) % (VOCAB - 1) for i in range(stored)]
    mx.synchronize()
    started = time.perf_counter()
    first = None
    try:
        gen.insert_segments(segments=[[new]], max_tokens=[8], caches=[cache], all_tokens=[prefix])
        for _ in range(64):
            _, out = gen.next()
            if out and first is None:
                first = time.perf_counter() - started
            if any(r.finish_reason is not None for r in out):
                break
    finally:
        gen.close()
    return first


def forward(model, cache, new: list[int]) -> float:
    """Seconds of the model's forward of `new` over a copy of `cache`'s state, to the first token."""
    own = []
    for c in cache:
        k = KVCache()
        k.keys, k.values, k.offset = c.keys, c.values, c.offset
        own.append(k)
    mx.synchronize()
    started = time.perf_counter()
    if len(new) > 1:
        model(mx.array(new[:-1])[None], cache=own)
        mx.eval([c.state for c in own])
    mx.argmax(model(mx.array(new[-1:])[None], cache=own)[0, -1]).item()  # the first token, on the host
    return time.perf_counter() - started


def synced(label: str, fn, result_arrays):
    """fn, synchronised before and after, its seconds added to SPLIT[label]."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        mx.synchronize()
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        arrays = result_arrays(out, args)
        if arrays:
            mx.eval(arrays)
        mx.synchronize()
        SPLIT[label].append(time.perf_counter() - started)
        return out

    return run


def states(caches) -> list:
    return [c.state for c in caches if getattr(c, "keys", None) is not None]


def split_patches():
    """Each of mlx-lm's steps of a request, synchronised and timed."""
    P, B = G.PromptProcessingBatch, G.GenerationBatch
    return [
        mock.patch.object(G, "_merge_caches", synced("merge", G._merge_caches, lambda out, a: states(out))),
        mock.patch.object(P, "prompt", synced("prompt step", P.prompt, lambda out, a: states(a[0].prompt_cache))),
        mock.patch.object(P, "split", synced("split", P.split, lambda out, a: states(out.prompt_cache))),
        mock.patch.object(P, "generate", synced("first decode step", P.generate, lambda out, a: [])),
        mock.patch.object(B, "next", synced("decode step", B.next, lambda out, a: [])),
        mock.patch.object(mx, "clear_cache", synced("clear_cache", mx.clear_cache, lambda out, a: [])),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=4, help="blocks of each variant (each block: every length once)")
    p.add_argument("--out", default="bench-results/probe-returning-cuda.json")
    args = p.parse_args()
    rt = device.runtime()
    if rt is None:
        print("this probe needs MLX's CUDA backend", file=sys.stderr)
        return 2
    shape = PROFILES["cuda"]["model"]
    model = tiny_model("llama", seed=0, dtype=mx.bfloat16, vocab_size=VOCAB, **shape)
    mx.eval(model.parameters())
    warmup.warm_up(model, VOCAB, 4, prefill_batch_size=8, prefill_step_size=2048)
    dims = dict(layers=shape["num_hidden_layers"], kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"])
    stored = [4114 + (c * 7) % 67 for c in range(CONVERSATIONS)]
    caches = [restored(n, c, **dims) for c, n in enumerate(stored)]
    mx.clear_cache()
    rows = []

    def one(variant: str, c: int, length: int) -> float:
        new = [1 + (c * 13 + i * 7) % (VOCAB - 1) for i in range(length)]
        if variant == "forward":
            return forward(model, caches[c], new)
        if variant == "pool keeps":
            pool_keeps(rt, 2**64 - 1)
            try:
                return served(model, caches[c], stored[c], new)
            finally:
                pool_keeps(rt, 0)
        if variant == "no clear":
            with mock.patch.object(mx, "clear_cache", lambda: None):
                return served(model, caches[c], stored[c], new)
        return served(model, caches[c], stored[c], new)

    i = 0
    for block in range(args.blocks * len(VARIANTS)):
        variant = VARIANTS[block % len(VARIANTS)]
        for length in LENGTHS:
            c = i % CONVERSATIONS
            seconds = one(variant, c, length)
            rows.append(dict(variant=variant, new_tokens=length, stored=stored[c], ms=seconds * 1e3))
            print(f"{variant:>10} {length:3d} new over {stored[c]}: {seconds * 1e3:7.1f} ms", flush=True)
            i += 1
    summary = {}
    for variant in VARIANTS:
        for length in LENGTHS:
            ms = [r["ms"] for r in rows if r["variant"] == variant and r["new_tokens"] == length]
            summary[f"{variant}, {length} new"] = statistics.median(ms)
        summary[f"{variant}, all"] = statistics.median(r["ms"] for r in rows if r["variant"] == variant)
    print("\nmedians, ms:")
    for k, v in summary.items():
        print(f"  {k}: {v:.1f}")
    split = {}
    for variant in VARIANTS[:3]:
        SPLIT.clear()
        patches = split_patches()
        for patch in patches:
            patch.start()
        try:
            for c in (3, 4):
                one(variant, c, 53)
        finally:
            for patch in reversed(patches):
                patch.stop()
        split[variant] = {k: [round(s * 1e3, 2) for s in v] for k, v in SPLIT.items()}
        print(f"\nsplit, {variant}: {split[variant]}", flush=True)
    write_results(
        args.out,
        {
            "benchmark": "probe_returning",
            "device": describe_device(),
            "model": "Llama-3.1-8B's shape, random bfloat16 weights, 1,024-token vocabulary",
            "lengths": LENGTHS,
            "rows": rows,
            "medians_ms": summary,
            "split_ms": split,
        },
        blas_info(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
