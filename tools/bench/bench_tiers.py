"""Cold tier figures for the 4,096-token prefix of the snapshot benchmark.

Side by side in one run, on the same bytes (a Llama-3.2-1B-shaped layer stack,
float16 KV): promptstore's cold write (temp file, fsync, rename, dir fsync,
per-array xxh3-128) against mx.save_safetensors (with and without an fsync),
each writing a new file as a spill does, and promptstore's cold load (header check, identity, checksums, format)
against mx.load of one file holding the same bytes. Files are in the page
cache, as a store's hot-on-disk working set would be. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import blas_info, summarize, sync, timed, write_results  # noqa: E402

from promptstore.caches import make_prompt_cache, snapshot_prompt_cache, to_flat  # noqa: E402
from promptstore.identity import NodeId
from promptstore.snapshots.cold import ColdTier, checksum, checksums  # noqa: E402
from promptstore.testing.models import model_args  # noqa: E402

KEY, NAMESPACE = b"\x11" * 16, b"\x22" * 16


def snapshots(tokens: int, layers: int):
    """Per-layer snapshots of `tokens` random float16 positions, Llama-3.2-1B KV shape."""
    args = model_args(
        "llama", num_hidden_layers=layers, num_key_value_heads=8, head_dim=64, hidden_size=2048, num_attention_heads=32
    )

    class Shell:
        pass

    shell = Shell()  # make_prompt_cache only needs the layer count
    shell.layers = [None] * args.num_hidden_layers
    caches = make_prompt_cache(shell)
    key = mx.random.key(0)
    for c in caches:
        key, k1, k2 = mx.random.split(key, 3)
        shape = (1, 8, tokens, 64)
        c.update_and_fetch(
            mx.random.normal(shape, key=k1).astype(mx.float16), mx.random.normal(shape, key=k2).astype(mx.float16)
        )
    snaps = snapshot_prompt_cache(caches, 0)
    sync([a for s in snaps for a in s.all_arrays()])
    return snaps


def paired(a, b, runs: int, warmup: int = 3, cleanup=None) -> tuple[dict, dict]:
    """Time `a` and `b` alternately, so both see the same machine noise.
    cleanup: called untimed with what each call returned (e.g. a file to delete)."""
    samples = {a: [], b: []}
    mx.clear_cache()
    for i in range(warmup + runs):
        for fn in (a, b) if i % 2 else (b, a):
            mx.synchronize()
            t0 = time.perf_counter()
            out = fn()
            sync(out if cleanup is None else None)
            dt = time.perf_counter() - t0
            if cleanup is not None:
                cleanup(out)
            if i >= warmup:
                samples[fn].append(dt)
    return summarize(samples[a]), summarize(samples[b])


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", default="bench-results/tiers.json")
    parser.add_argument("--device", choices=["cpu", "gpu"], help="MLX default device (default: MLX's own)")
    args = parser.parse_args(argv)
    if args.device:
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)

    snaps = snapshots(args.tokens, args.layers)
    arrays, metadata = to_flat(snaps)
    nbytes = sum(a.nbytes for a in arrays.values())
    work = Path(tempfile.mkdtemp(prefix="promptstore-bench-"))
    try:
        cold = ColdTier(work / "store")
        counter = iter(range(10**9))

        # Every write makes a new file, as a spill does (overwriting one file is
        # much cheaper here: its dirty pages are dropped, never written back);
        # each file is deleted after its timing.
        def cold_write():
            return (
                cold.root / cold.write(NodeId(next(counter).to_bytes(16, "big"), NAMESPACE, 0, args.tokens), snaps).path
            )

        def save_new():
            path = str(work / f"plain-{next(counter)}.safetensors")
            mx.save_safetensors(path, arrays, metadata)
            return path

        def save_new_fsync():
            path = save_new()
            fsync_path(path)
            return path

        plain = str(work / "plain.safetensors")
        mx.save_safetensors(plain, arrays, metadata)

        ref = cold.write(NodeId(KEY, NAMESPACE, 0, args.tokens), snaps)

        def cold_load():
            return [a for s in cold.load(ref.path, NodeId(KEY, NAMESPACE, 0, args.tokens)) for a in s.all_arrays()]

        def mx_load():
            return list(mx.load(plain).values())

        loaded = mx.load(plain)
        sync(list(loaded.values()))

        def hash_threads():  # what cold load and write run
            checksums(loaded)

        def hash_one_thread():
            for a in loaded.values():
                checksum(a)

        load, plain_load = paired(cold_load, mx_load, args.runs)
        write, plain_write = paired(cold_write, save_new_fsync, args.runs, cleanup=os.unlink)
        _, plain_nosync = paired(cold_write, save_new, args.runs, cleanup=os.unlink)
        rows = {
            "cold write (promptstore)": write,
            "mx.save_safetensors + fsync": plain_write,
            "mx.save_safetensors": plain_nosync,
            "cold load + verify (promptstore)": load,
            "mx.load": plain_load,
            "checksums (hashing threads, as load and write)": timed(hash_threads, runs=args.runs),
            "checksums (one thread)": timed(hash_one_thread, runs=args.runs),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: v["median_s"] for k, v in rows.items()}
    ratios = {
        "cold_load / mx.load (goal <= 1.25)": med["cold load + verify (promptstore)"] / med["mx.load"],
        "cold_write / save_safetensors+fsync": med["cold write (promptstore)"] / med["mx.save_safetensors + fsync"],
        "cold_write / save_safetensors": med["cold write (promptstore)"] / med["mx.save_safetensors"],
        "checksum share of cold load": med["checksums (hashing threads, as load and write)"]
        / med["cold load + verify (promptstore)"],
        "checksum share of cold write": med["checksums (hashing threads, as load and write)"]
        / med["cold write (promptstore)"],
        "checksums / mx.load": med["checksums (hashing threads, as load and write)"] / med["mx.load"],
    }
    print(
        f"{args.tokens} tokens x {args.layers} layers, float16 KV: {nbytes / 2**20:.1f} MiB per file; {args.runs} runs"
    )
    print(f"{'operation':48} {'median ms':>10} {'p95 ms':>9} {'GB/s':>7}")
    for name, r in rows.items():
        print(f"{name:48} {r['median_s'] * 1e3:10.2f} {r['p95_s'] * 1e3:9.2f} {nbytes / r['median_s'] / 1e9:7.2f}")
    for name, value in ratios.items():
        print(f"  {name:44} {value:6.2f}")
    out = write_results(
        args.out,
        {"benchmark": "tiers", "settings": vars(args), "bytes": nbytes, "rows": rows, "ratios": ratios},
        blas_info(),
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
