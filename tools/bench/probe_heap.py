"""What a kept heap saves on MLX's CPU backend: the CPU chat's first round (three
new users' 281 tokens each over the 772 every one restores, in one mlx-lm batch)
in a fresh process, with `promptstore serve`'s heap reserve and without it, side
by side (serve/heap.py).

Each run is a process of its own, as a started server is: the model loaded, the
772 tokens prefilled, then the round twice: the first time, where the process
has never held that much memory, and again. The page faults of each are counted
(each a page the kernel zeroes), and the time to the first tokens. Runs with
and without the reserve alternate; medians.

    python tools/bench/probe_heap.py [--runs 5] [--out bench-results/heap-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from common import blas_info, blas_warning, describe_device, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from promptstore.serve.heap import DEFAULT_RESERVE, keep_heap  # noqa: E402
from promptstore.testing.model_dir import write_model_dir  # noqa: E402
from promptstore.testing.models import DEMO_LLAMA  # noqa: E402

SHARED, NEW, QUESTION, USERS = 772, 259, 22, 3  # bench_serve's chat, round 1
PREFILL_STEP = 512  # promptstore serve's on CPU


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(model_dir: str, reserve: int) -> dict:
    """One fresh process's round, twice; what it measured."""
    import copy

    import mlx_lm
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(model_dir)
    kept = keep_heap(reserve)
    token = lambda i: 1 + (i * 7919) % 1000  # noqa: E731
    shared = [token(i) for i in range(SHARED)]
    users = [[token(10_000 + u * 997 + i) for i in range(NEW)] for u in range(USERS)]
    questions = [[token(50_000 + u * 131 + i) for i in range(QUESTION)] for u in range(USERS)]
    base = make_prompt_cache(model)
    model(mx.array([shared]), cache=base)
    mx.eval([c.state for c in base])

    def round_() -> tuple[float, int]:
        caches = [copy.deepcopy(base) for _ in range(USERS)]
        generator = BatchGenerator(
            model, completion_batch_size=USERS, prefill_batch_size=USERS, prefill_step_size=PREFILL_STEP
        )
        before, started = _faults(), time.perf_counter()
        try:
            generator.insert_segments(
                segments=[[u, q] for u, q in zip(users, questions)],
                max_tokens=[2] * USERS,
                caches=caches,
                all_tokens=[shared] * USERS,
            )
            for _ in range(64):  # bounded: the first tokens come within a few steps
                _, generated = generator.next()
                if generated:
                    break
            seconds = time.perf_counter() - started
        finally:
            generator.close()
        return seconds, _faults() - before

    (first_s, first_faults), (again_s, again_faults) = round_(), round_()
    return {
        "reserve": reserve,
        "kept": kept[0] if kept else 0,
        "touch_s": kept[1] if kept else 0.0,
        "first_ms": first_s * 1e3,
        "first_faults": first_faults,
        "again_ms": again_s * 1e3,
        "again_faults": again_faults,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="fresh processes each way (default 5)")
    p.add_argument("--reserve", type=int, default=DEFAULT_RESERVE, help="bytes (default: promptstore serve's)")
    p.add_argument("--out", default="bench-results/heap-cpu.json")
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "RESERVE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return 0
    if mx.default_device() != mx.cpu:
        print("probe_heap: the heap reserve applies on MLX's CPU backend only", file=sys.stderr)
        return 2
    blas = blas_info()
    if warning := blas_warning(blas):
        print(warning)
    runs: dict[int, list[dict]] = {0: [], args.reserve: []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_dir(Path(tmp) / "model", "llama", vocab_size=1024, dtype=mx.float32, **DEMO_LLAMA)
        for i in range(args.runs):
            for reserve in (0, args.reserve) if i % 2 == 0 else (args.reserve, 0):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(folder), str(reserve)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                )
                got = json.loads(out.stdout.strip().splitlines()[-1])
                runs[reserve].append(got)
                print(
                    f"run {i + 1}, reserve {reserve >> 20:>4} MiB: first round {got['first_ms']:6.1f} ms "
                    f"({got['first_faults']:>6} faults), again {got['again_ms']:6.1f} ms ({got['again_faults']} faults)",
                    flush=True,
                )
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    summary = {
        str(reserve): {key: med(rows, key) for key in ("first_ms", "first_faults", "again_ms", "again_faults")}
        for reserve, rows in runs.items()
    }
    bare, kept = summary["0"], summary[str(args.reserve)]
    print(
        f"first round, medians: {bare['first_ms']:.1f} ms without a reserve ({bare['first_faults']:.0f} faults), "
        f"{kept['first_ms']:.1f} ms with {args.reserve >> 20} MiB ({kept['first_faults']:.0f}): "
        f"{kept['first_ms'] / bare['first_ms']:.2f}x; the round again: {bare['again_ms']:.1f} and {kept['again_ms']:.1f} ms"
    )
    payload = {
        "benchmark": "heap",
        "device": describe_device(),
        "model": "the demo's llama (4 layers, hidden 256), float32",
        "round": {"shared": SHARED, "new": NEW + QUESTION, "users": USERS, "prefill_step": PREFILL_STEP},
        "runs": args.runs,
        "medians": summary,
        "rows": [r for rows in runs.values() for r in rows],
    }
    print(f"wrote {write_results(args.out, payload, blas)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
