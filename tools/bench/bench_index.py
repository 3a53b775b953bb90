"""Benchmark the LMDB index: lookup latency against store size, and insert rate.

A 32,768-token prompt is stored as a chain of 64 nodes of 512 tokens; the store is
filled with other sequences (in its namespace, branching off the prompt, and in
other namespaces) to each size, and the prompt is looked up repeatedly. Prints a
table and writes JSON. Figures, not verdicts.

    .venv/bin/python tools/bench/bench_index.py [--out bench-results/index.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from promptstore.index import Index, LayerSpec, NamespaceSpec, NodeRecord

PROMPT_TOKENS = 32_768
EDGE_TOKENS = 512
VOCAB = 1 << 17


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results/index.json", help="JSON results path")
    p.add_argument("--sizes", default="1000,10000,100000", help="store sizes in nodes")
    p.add_argument("--lookups", type=int, default=2000, help="timed lookups per size")
    p.add_argument("--layers", type=int, default=32, help="layers per namespace (1 in 4 rotating)")
    p.add_argument("--batch", type=int, default=2000, help="inserts per write txn while filling")
    p.add_argument("--dir", default=None, help="where to build the store (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def spec(model_id: str, n_layers: int) -> NamespaceSpec:
    layers = [
        LayerSpec(kind="rotating", window=4096) if i % 4 == 3 else LayerSpec(kind="kv", dtype="bfloat16")
        for i in range(n_layers)
    ]
    return NamespaceSpec(model_id=model_id, layers=layers)


def record(ns, rng: np.random.Generator) -> NodeRecord:
    return NodeRecord.blank(
        ns,
        tier="cold",
        file="cold/xx.safetensors",
        nbytes=int(rng.integers(1 << 20, 1 << 24)),
        checksum="0" * 32,
        prefill_seconds=0.05,
    )


def store_chain(ix: Index, ns, prompt: np.ndarray, rng) -> dict:
    """Insert the prompt one 512-token node at a time (one durable txn each)."""
    started = time.perf_counter()
    for end in range(EDGE_TOKENS, PROMPT_TOKENS + 1, EDGE_TOKENS):
        ix.insert(ns, prompt[:end], record(ns, rng))
    seconds = time.perf_counter() - started
    return {
        "nodes": PROMPT_TOKENS // EDGE_TOKENS,
        "seconds": seconds,
        "nodes_per_s": PROMPT_TOKENS // EDGE_TOKENS / seconds,
    }


def fill_item(spaces, prompt: np.ndarray, rng) -> tuple:
    """One random sequence: half own-namespace, a fifth branching off the prompt, rest elsewhere."""
    roll = rng.random()
    tail = rng.integers(0, VOCAB, size=int(rng.integers(64, 257)), dtype=np.uint32)
    if roll < 0.2:
        at = EDGE_TOKENS * int(rng.integers(1, PROMPT_TOKENS // EDGE_TOKENS))
        tail[0] = (prompt[at] + 1 + tail[0] % (VOCAB - 1)) % VOCAB  # diverge right at a node end
        return spaces[0], np.concatenate([prompt[:at], tail])
    if roll < 0.7:
        while tail[0] == prompt[0]:
            tail[0] = rng.integers(0, VOCAB)
        return spaces[0], tail
    return spaces[int(rng.integers(1, len(spaces)))], tail


def fill(ix: Index, spaces, prompt, target: int, batch: int, rng) -> dict:
    """Grow the store to `target` nodes with batched write transactions."""

    def split(plan):
        return record(plan.namespace, rng), record(plan.namespace, rng)

    started, added = time.perf_counter(), 0
    while (have := ix.stats()["nodes"]) < target:
        items: dict = {}
        for _ in range(min(batch, target - have)):
            ns, tokens = fill_item(spaces, prompt, rng)
            items.setdefault(ns, []).append((tokens, record(ns, rng)))
        for ns, pairs in items.items():
            ix.insert_many(ns, pairs, split_records=split)
        added += ix.stats()["nodes"] - have
    seconds = time.perf_counter() - started
    return {
        "nodes_added": added,
        "seconds": seconds,
        "nodes_per_s": added / seconds if seconds else 0.0,
    }


def time_lookups(ix: Index, ns, tokens, n: int) -> dict:
    for _ in range(50):
        match = ix.lookup(ns, tokens)
    samples = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        match = ix.lookup(ns, tokens)
        samples[i] = time.perf_counter_ns() - t0
    us = samples / 1e3
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "max_us": float(us.max()),
        "matched": match.matched,
        "path_nodes": len(match.path),
        "restorable": match.restorable,
    }


def measure(ix: Index, ns, prompt, n_lookups: int) -> dict:
    as_array = time_lookups(ix, ns, prompt, n_lookups)
    as_list = time_lookups(ix, ns, prompt.tolist(), max(200, n_lookups // 10))
    diverging = prompt.copy()
    diverging[PROMPT_TOKENS // 2 + 100] ^= 1  # mismatch inside node 32's edge
    partial = time_lookups(ix, ns, diverging, n_lookups)
    return {"array": as_array, "list": as_list, "diverging_mid_edge": partial}


def run(args: argparse.Namespace, root: Path) -> dict:
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, VOCAB, size=PROMPT_TOKENS, dtype=np.uint32)
    results: dict = {
        "host": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "layers": args.layers,
        "sizes": [],
    }
    with Index.open(root / "index") as ix:
        spaces = [ix.register_namespace(spec(f"bench-model-{i}", args.layers)) for i in range(4)]
        results["chain_insert"] = store_chain(ix, spaces[0], prompt, rng)
        for size in (int(s) for s in args.sizes.split(",")):
            filled = fill(ix, spaces, prompt, size, args.batch, rng)
            stats = ix.stats()
            row = {
                "target_nodes": size,
                "nodes": stats["nodes"],
                "fill": filled,
                "used_bytes": stats["used_bytes"],
                **measure(ix, spaces[0], prompt, args.lookups),
            }
            results["sizes"].append(row)
            print_row(row)
    return results


def print_header() -> None:
    print(
        f"{'nodes':>8} | {'p50 µs':>7} {'p99 µs':>7} | {'list p50':>8} {'list p99':>8} | "
        f"{'div p50':>7} {'div p99':>7} | {'path':>4} {'matched':>7} | {'fill n/s':>8} {'MiB':>6}"
    )


def print_row(row: dict) -> None:
    a, li, d = row["array"], row["list"], row["diverging_mid_edge"]
    print(
        f"{row['nodes']:>8} | {a['p50_us']:>7.1f} {a['p99_us']:>7.1f} | {li['p50_us']:>8.1f} "
        f"{li['p99_us']:>8.1f} | {d['p50_us']:>7.1f} {d['p99_us']:>7.1f} | {a['path_nodes']:>4} "
        f"{a['matched']:>7} | {row['fill']['nodes_per_s']:>8.0f} {row['used_bytes'] / 2**20:>6.1f}",
        flush=True,
    )


def main() -> None:
    args = parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="promptstore-bench-"))
    print_header()
    try:
        results = run(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    chain = results["chain_insert"]
    print(f"single inserts (plan+commit, one durable txn each): {chain['nodes_per_s']:.0f} nodes/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
