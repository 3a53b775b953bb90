"""Probe: what a process's first read from the cold tier builds, and when (CUDA).

On CUDA a read from disk runs two kernels promptstore itself does not ship
compiled: the one-thread kernel that makes each block and hands back its
device address (`mx.fast.cuda_kernel`: built in every process, the kernel
caches warm or not), and MLX's gather that reads a read's ends back to check
them (compiled once per machine, then loaded from MLX's disk cache). Opening
a cold tier now builds both (`snapshots/reader.py` `prepare`); before, the
first read of each process did, inside whatever request made it.

Each variant runs in a fresh process of its own against one node file of a
small bfloat16 llama written first: the cold tier opened, then the file read
once. `prepare` is the shipped code; `no prepare` the same with
`reader.prepare` made a no-op. Each variant first on empty kernel caches
(MLX's PTX cache and the driver's, folders of the probe's own), then twice
more on the caches it left. Prints and writes each process's open and
first-read times and the kernel files each left.

    python3 tools/bench/probe_first_read.py --out bench-results/probe-first-read-cuda.json

It times; it asserts nothing (it says whether each read equalled what was
written). Off CUDA nothing is built at either point. On an H100 (medians of
the two processes on warm kernel caches): first read 1,855 ms without the
prepare, 7.5 ms with it; the tier's opening 2.3 s and 3.1 s
(bench-results/archive/2026-11/probe-first-read-cuda.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEY, NAMESPACE = bytes.fromhex("a1b2c3d4" * 4), bytes.fromhex("5a" * 16)
TOKENS = 40
WARM_RUNS = 2


def child(root: Path, what: str) -> dict:
    """One process's part: write the node file, or open the tier and read it."""
    sys.path.insert(0, str(REPO))
    import mlx.core as mx

    from promptstore import caches as C
    from promptstore.identity import NodeId
    from promptstore.snapshots import cold, reader
    from promptstore.testing import tiny_model

    model = tiny_model("llama", dtype=mx.bfloat16)
    cache = C.make_prompt_cache(model)
    model(mx.arange(1, TOKENS + 1)[None], cache=cache)
    snaps = [s.eval() for s in C.snapshot_prompt_cache(cache, 0)]
    mx.synchronize()
    node = NodeId(KEY, NAMESPACE, 0, TOKENS)
    if what == "write":
        (root / "ref").write_text(cold.ColdTier(root / "cold").write(node, snaps).path)
        return {}
    if what == "no prepare":
        reader.prepare = lambda: None
    before = kernel_files()
    t = time.perf_counter()
    tier = cold.ColdTier(root / "cold")
    opened = time.perf_counter() - t
    at_open = kernel_files()
    t = time.perf_counter()
    got = tier.load((root / "ref").read_text(), node)
    mx.synchronize()
    read = time.perf_counter() - t
    return {
        "open_ms": opened * 1e3,
        "first_read_ms": read * 1e3,
        "equal": len(got) == len(snaps) and all(C.arrays_equal(a, b) for a, b in zip(got, snaps)),
        "built_at_open": sorted(at_open - before),
        "built_at_read": sorted(kernel_files() - at_open),
        "reading_threads": cold.parallel_reads(),
    }


def kernel_files() -> set[str]:
    """The files of MLX's PTX cache and the driver's (this probe's own folders)."""
    out = set()
    for var in ("MLX_PTX_CACHE_DIR", "CUDA_CACHE_PATH"):
        d = Path(os.environ[var])
        if d.exists():
            out |= {f"{d.name}/{p.relative_to(d)}" for p in d.rglob("*") if p.is_file() and p.name != "index"}
    return out


def run(root: Path, what: str, caches: Path) -> dict:
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(caches / "ptx"), CUDA_CACHE_PATH=str(caches / "nv"))
    cmd = [sys.executable, __file__, "--child", what, "--root", str(root)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{what}: the process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default bench-results/probe-first-read-<device>.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.root), args.child)))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from common import blas_info, describe_device, write_results

    rows = []
    with tempfile.TemporaryDirectory(prefix="probe-first-read-") as tmp:
        root = Path(tmp)
        run(root, "write", root / "writer-kernels")
        for variant in ("prepare", "no prepare"):
            caches = root / variant.replace(" ", "-")  # empty at its first process
            for n in range(1 + WARM_RUNS):
                row = {"variant": variant, "kernel_caches": "empty" if n == 0 else "warm", **run(root, variant, caches)}
                rows.append(row)
                print(
                    f"{variant:>10} ({row['kernel_caches']} kernel caches): open {row['open_ms']:,.0f} ms "
                    f"({len(row['built_at_open'])} kernel files made), first read {row['first_read_ms']:,.0f} ms "
                    f"({len(row['built_at_read'])} made), equal {row['equal']}",
                    flush=True,
                )
    summary = {}
    for variant in ("prepare", "no prepare"):
        warm = [r for r in rows if r["variant"] == variant and r["kernel_caches"] == "warm"]
        summary[variant] = {k: statistics.median(r[k] for r in warm) for k in ("open_ms", "first_read_ms")}
    print(json.dumps(summary))
    import mlx.core as mx

    device = describe_device()
    out = args.out or f"bench-results/probe-first-read-{'cuda' if mx.default_device() == mx.gpu else 'cpu'}.json"
    path = write_results(
        out,
        {"benchmark": "probe_first_read", "device": device, "rows": rows, "warm_medians": summary},
        blas_info(),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
