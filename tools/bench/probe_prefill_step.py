"""What the prefill step costs: the same prefills in steps of 2,048 tokens
(mlx_lm.server's default) and smaller, side by side, on the device MLX runs on.

The demo's llama in float32 (the CPU bench's model). Each case is a cache
already holding `stored` tokens, then `new` tokens prefilled step by step and
the last one run for the first token's logits, for `batch` sequences at once;
the median of `--repeats` runs. On CPU the attention of a long step reads its
whole score matrix from memory: smaller steps stay in cache. This chose
promptstore serve's --prefill-step-size on CPU (serve/options.py).

    python tools/bench/probe_prefill_step.py [--out bench-results/prefill-step-cpu.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from common import blas_info, blas_warning, describe_device, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx_lm  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from promptstore.testing.model_dir import write_model_dir  # noqa: E402
from promptstore.testing.models import DEMO_LLAMA  # noqa: E402

# (stored, new, batch): single's first round, a fresh 4k prompt, a hot turn, the
# chat's first round (three new users on a stored system prompt), a fresh 1.1k prompt.
CASES = [(1028, 1048, 1), (0, 4096, 1), (4096, 64, 1), (772, 280, 3), (0, 1100, 1)]
STEPS = (2048, 512, 256, 128)


def prefill_ms(model, stored: int, new: int, batch: int, step: int, repeats: int) -> float:
    held = [5 + (i % 1000) for i in range(stored)]
    fresh = [7 + (i % 900) for i in range(new)]
    runs = []
    for _ in range(repeats):
        cache = make_prompt_cache(model)
        if stored:
            model(mx.array([held] * batch), cache=cache)
            mx.eval([c.state for c in cache])
        started = time.perf_counter()
        for lo in range(0, new - 1, step):
            model(mx.array([fresh[lo : min(lo + step, new - 1)]] * batch), cache=cache)
            mx.eval([c.state for c in cache])
        mx.eval(model(mx.array([fresh[-1:]] * batch), cache=cache))
        runs.append(time.perf_counter() - started)
    return statistics.median(runs) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench-results/prefill-step-cpu.json")
    args = p.parse_args()
    blas = blas_info()
    if warning := blas_warning(blas):
        print(warning)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_dir(Path(tmp) / "model", "llama", vocab_size=1024, dtype=mx.float32, **DEMO_LLAMA)
        model, _ = mlx_lm.load(str(folder))
        rows = []
        for stored, new, batch in CASES:
            ms = {step: prefill_ms(model, stored, new, batch, step, args.repeats) for step in STEPS}
            rows.append({"stored": stored, "new": new, "batch": batch, "ms_by_step": ms})
            figures = "  ".join(f"{step}: {v:,.0f} ms" for step, v in ms.items())
            ratio = ms[256] / ms[2048]
            print(
                f"{stored:>5} stored, {new:>5} new, batch {batch}:  {figures}  (256 / 2048: {ratio:.2f}x)", flush=True
            )
    payload = {
        "benchmark": "prefill-step",
        "device": describe_device(),
        "model": "the demo's llama (4 layers, hidden 256), float32",
        "repeats": args.repeats,
        "rows": rows,
    }
    print(f"wrote {write_results(args.out, payload, blas)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
