"""Probe: a returning conversation's first token past its restored cache (CUDA).

promptstore serve's memory-pressure run (`bench_serve.py --workload pressure`)
restores a returning conversation's ~4.1k tokens and prefills the rest (1 to
~70 tokens) through mlx-lm's BatchGenerator. This runs such requests in one
process: 16 caches of 4,114-4,180 tokens with the exact-size arrays a hit gives,
new parts of 1-68 tokens, the server's kernel warm-up first and its attention
kernels (MLX's own; `--cudnn` for cuDNN's), variants alternating in blocks:

- `as served`: mlx-lm's BatchGenerator as promptstore serve runs it (mlx-lm
  empties MLX's buffer cache after every prompt chunk, as it ships);
- `cache kept`: the same, mlx-lm's calls to mx.clear_cache made no-ops for
  its generation module alone, MLX's cache limit at 8 GiB;
- `forward`: the model's forward of the new tokens but the last, then of the
  last, without the BatchGenerator (the compute alone).

Then two requests of 53 new tokens each of the first two ways, split: each of
mlx-lm's steps synchronised and timed (the merge into its batch, the prompt
step, the split into a generation batch, its first decode step, MLX's buffer
cache emptied). Llama-3.1-8B's shape, random bfloat16 weights.

    python3 tools/bench/probe_returning.py --out bench-results/probe-returning-cuda.json

It times; it asserts nothing. On an H100 with MLX's own attention, to the
first token (medians over all lengths): 57.1 ms as served, 57.0 with the cache
kept, 37.3 for the forward alone (bench-results/archive/2026-11/probe-returning-cuda-own-attention.*).
An earlier version, on cuDNN's attention (which builds a graph per new shape:
the first requests of each shape paid it) and with a CUDA memory-pool setting
since removed, found the prompt step at 59-77 ms as served and 17-19 with the
cache kept (bench-results/archive/2026-11/probe-returning-cuda.*).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys
import time
import types
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

LENGTHS = [1, 19, 28, 53, 68, 23]  # new tokens past the hit, as pass 2 of the pressure run met them
VARIANTS = ["as served", "cache kept", "forward"]
CACHE_LIMIT = 8 << 30


class KeptCache(types.ModuleType):
    """mlx.core as mlx-lm's generation module sees it for `cache kept`: clear_cache does nothing."""

    def __init__(self, core):
        super().__init__(core.__name__, core.__doc__)
        self.__dict__["_core"] = core

    def __getattr__(self, name: str):
        return getattr(self._core, name)

    @staticmethod
    def clear_cache() -> None:
        """MLX's allocator keeps its cache under the limit at every free."""


CONVERSATIONS = 16
SPLIT: dict[str, list[float]] = defaultdict(list)


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
    p.add_argument(
        "--cudnn", action="store_true", help="cuDNN's attention kernels (MLX's default; the server's is MLX's own)"
    )
    args = p.parse_args()
    os.environ["MLX_CUDA_USE_CUDNN_SDPA"] = "1" if args.cudnn else "0"  # read at the first attention
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
        if variant == "cache kept":
            limit = mx.set_cache_limit(CACHE_LIMIT)
            try:
                with mock.patch.object(G, "mx", KeptCache(mx)):
                    return served(model, caches[c], stored[c], new)
            finally:
                mx.set_cache_limit(limit)
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
    for variant in VARIANTS[:2]:
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
            "attention": "cuDNN's" if args.cudnn else "MLX's own",
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
