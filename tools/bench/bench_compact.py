"""Compact figures: time per GB and per 10,000 nodes, and the fetch time of a
50-turn conversation before and after compact merges its chain of nodes.

The conversation is 50 turns of `--turn-tokens` tokens on a Llama-3.2-1B-shaped
layer stack (float16 KV, filled directly: compact and fetch only see the
cached arrays), stored one node per turn, then fetched with no hot tier so
every fetch reads its files. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import blas_info, summarize, write_results  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.caches import make_prompt_cache  # noqa: E402
from promptstore.store.compact import compact  # noqa: E402
from promptstore.testing.models import llama_1b_shape, tiny_model  # noqa: E402


def conversation(path: Path, model, turns: int, turn_tokens: int) -> mx.array:
    tokens = mx.random.randint(0, 512, (turns * turn_tokens + 1,), key=mx.random.key(5))
    with PromptStore.open(path, durability="write_through") as store:
        space = store.bind(model, model_id="bench")
        cache = make_prompt_cache(model)
        key = mx.random.key(0)
        for t in range(1, turns + 1):
            for c in cache:
                key, k1, k2 = mx.random.split(key, 3)
                shape = (1, 8, turn_tokens, 64)
                c.update_and_fetch(
                    mx.random.normal(shape, key=k1).astype(mx.float16),
                    mx.random.normal(shape, key=k2).astype(mx.float16),
                )
            space.insert(tokens[: t * turn_tokens], cache)
    return tokens


def fetch_times(path: Path, model, tokens, runs: int) -> dict:
    with PromptStore.open(path, hot_bytes=0) as store:
        space = store.bind(model, model_id="bench")
        samples, nodes = [], 0
        for i in range(runs + 2):
            t0 = time.perf_counter()
            hit = space.fetch(tokens)
            mx.eval([a for c in hit.cache for a in (c.keys, c.values)])
            if i >= 2:
                samples.append(time.perf_counter() - t0)
            nodes = hit.nodes
        return {**summarize(samples), "nodes": nodes, "length": hit.length}


def many_nodes(path: Path, n: int) -> None:
    """n small nodes: short sequences sharing prefixes, on a tiny model."""
    model = tiny_model("llama")
    with PromptStore.open(path, durability="write_through") as store:
        space = store.bind(model, model_id="tiny")
        for i in range(n // 2):
            toks = mx.random.randint(0, 256, (24,), key=mx.random.key(i))
            for end in (12, 24):
                cache = make_prompt_cache(model)
                model(toks[:end][None], cache=cache)
                space.insert(toks[:end], cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default="bench-results/compact.json")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="promptstore-compact-"))
    try:
        model = llama_1b_shape(args.layers, dtype=mx.float16, vocab_size=512)
        tokens = conversation(work / "chat", model, args.turns, args.turn_tokens)
        before = fetch_times(work / "chat", model, tokens, args.runs)
        merged = compact(work / "chat", max_bytes=10**12, verify=True)
        after = fetch_times(work / "chat", model, tokens, args.runs)
        gb = merged.before["bytes"] / 1e9
        many_nodes(work / "many", args.nodes)
        big = compact(work / "many", max_bytes=10**12, verify=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {
        "chat": {
            "turns": args.turns,
            "turn_tokens": args.turn_tokens,
            "bytes": merged.before["bytes"],
            "compact_s": merged.seconds,
            "compact_s_per_gb": merged.seconds / gb,
            "fetch_before": before,
            "fetch_after": after,
            "actions": merged.actions,
        },
        "many": {
            "nodes": big.before["nodes"],
            "compact_s": big.seconds,
            "compact_s_per_10k_nodes": big.seconds / big.before["nodes"] * 10_000,
            "note": f"measured on {big.before['nodes']} nodes and scaled linearly to 10,000",
            "actions": big.actions,
        },
    }
    c = figures["chat"]
    print(f"{args.turns}-turn conversation: {c['bytes'] / 2**20:.0f} MiB in {before['nodes']} nodes")
    print(f"  compact --verify (merging the chain): {c['compact_s']:.2f} s = {c['compact_s_per_gb']:.2f} s/GB")
    print(
        f"  fetch with no hot tier: before {before['median_s'] * 1e3:.1f} ms ({before['nodes']} files), "
        f"after {after['median_s'] * 1e3:.1f} ms ({after['nodes']} files); "
        f"restored {after['length']} tokens both times"
    )
    m = figures["many"]
    print(
        f"many small nodes: {m['nodes']} nodes, compact --verify {m['compact_s']:.2f} s "
        f"= {m['compact_s_per_10k_nodes']:.1f} s per 10,000 nodes ({m['note']})"
    )
    out = write_results(args.out, {"benchmark": "compact", "settings": vars(args), **figures}, blas_info())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
