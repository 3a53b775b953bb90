"""Probe: how long does an index commit wait beside a spill's writeback?

python3 tools/bench/probe_writeback.py [--gib 2.5] [--rounds 2] [--dir DIR] [--out FILE]

A spill writes gigabytes with write_safetensors (durable, then fsync) while
another thread commits small transactions to an LMDB environment opened as the
index opens its own (synced commits, the file growing), one every 20 ms, as
inserts on a server's generation thread do. Variants: the writer as it is (at
most IN_FLIGHT stretches queued at the disk) and without that bound (every
stretch handed over at once, as before). For each: the spill's GB/s and the
commits' latency p50, p95 and max. The disk and page cache are the machine's,
so run it where the store lives (--dir). It times; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import lmdb
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from promptstore.snapshots import safetensors_writer as W  # noqa: E402

VARIANTS = {"bounded (as shipped)": None, "unbounded (before)": 1 << 30}


def spill(path: Path, arrays: list[mx.array], total: int) -> float:
    """Seconds to write `total` bytes as node files of the given arrays, each fsynced."""
    views = [memoryview(a) for a in arrays]
    per_file = sum(a.nbytes for a in arrays)
    started = time.perf_counter()
    for i in range(max(1, total // per_file)):
        fd = os.open(path / f"node-{i}.safetensors", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            W.write_safetensors(fd, [(f"a{j}", a, v) for j, (a, v) in enumerate(zip(arrays, views))], {}, durable=True)
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - started


def commits(path: Path, stop: threading.Event, latencies: list[float]) -> None:
    env = lmdb.open(str(path), map_size=1 << 30, sync=True, metasync=True)
    value, i = os.urandom(2048), 0
    try:
        while not stop.is_set():
            started = time.perf_counter()
            with env.begin(write=True) as txn:
                txn.put(i.to_bytes(8, "big"), value)
            latencies.append(time.perf_counter() - started)
            i += 1
            stop.wait(0.02)
    finally:
        env.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.5, help="bytes each spill writes")
    p.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternated")
    p.add_argument("--dir", help="where the files go (default: a temporary directory)")
    p.add_argument("--out", help="JSON path (default: none)")
    args = p.parse_args()
    total = int(args.gib * 2**30)
    arrays = [mx.random.normal((8, 4096, 128)).astype(mx.bfloat16) for _ in range(8)]  # 64 MiB a file
    mx.eval(arrays)
    shipped = W.IN_FLIGHT
    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name, in_flight in VARIANTS.items():
            with tempfile.TemporaryDirectory(prefix="probe-writeback-", dir=args.dir) as tmp:
                work = Path(tmp)
                (work / "index").mkdir()
                os.sync()
                stop, latencies = threading.Event(), []
                committer = threading.Thread(target=commits, args=(work / "index", stop, latencies))
                committer.start()
                time.sleep(0.2)  # commits before the spill starts
                W.IN_FLIGHT = in_flight if in_flight is not None else shipped
                try:
                    seconds = spill(work, arrays, total)
                finally:
                    W.IN_FLIGHT = shipped
                    stop.set()
                    committer.join()
            ms = np.array(latencies) * 1e3
            row = {
                "spill_gbps": total / seconds / 1e9,
                "commits": len(ms),
                "commit_p50_ms": float(np.median(ms)),
                "commit_p95_ms": float(np.percentile(ms, 95)),
                "commit_max_ms": float(ms.max()),
            }
            rows[name].append(row)
            print(
                f"round {r} {name:22s} spill {row['spill_gbps']:.2f} GB/s; {row['commits']} commits: p50 "
                f"{row['commit_p50_ms']:.1f} ms, p95 {row['commit_p95_ms']:.1f} ms, max {row['commit_max_ms']:.1f} ms",
                flush=True,
            )
    if args.out:
        doc = {
            "probe": "writeback",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "device": str(mx.default_device()),
            "spill_bytes": total,
            "writeback_bytes": W.WRITEBACK_BYTES,
            "in_flight": shipped,
            "rows": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
