"""What storing a burst's waiting replies costs, one by one against one batch.

A chat server stores each finished reply as the next turn will send it, which
prefills the reply's re-rendered tokens (~50 with a random-weight model) on
top of its conversation's cache (~5k tokens). When several next turns come
together, their replies are stored before their fetches. This times, on the
model of bench_serve's profile: each reply's prefill on its own (synchronised),
and the replies as one batch through mlx-lm's prompt batch, with and without
mlx-lm's buffer-cache clearing after each evaluation, and split into its parts
(merging the caches, the forward pass, moving the padding and extracting each
sequence).

    python tools/bench/probe_reply_batch.py --profile cuda --out bench-results/probe-reply-batch-cuda.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch, _merge_caches
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import describe_device  # noqa: E402

from promptstore.generation import prefill  # noqa: E402
from promptstore.testing.models import tiny_model  # noqa: E402
from tools.bench.bench_serve import PROFILES, VOCAB  # noqa: E402


def timed(fn) -> float:
    mx.synchronize()
    t = time.perf_counter()
    out = fn()
    if out is not None:
        mx.eval(out)
    mx.synchronize()
    return time.perf_counter() - t


def prefill_together(model, caches: list[list], tokens: list[list[int]], step: int) -> list[list]:
    """Each tokens[i] after caches[i], as one batch through mlx-lm's prompt batch
    (right-padded to the longest, then the padding moved to the left); returns
    each sequence's cache (a copy), the given caches left as they were."""
    batch = PromptProcessingBatch(model, list(range(len(caches))), caches, prefill_step_size=step)
    batch.prompt([list(t) for t in tokens])
    return [batch.extract_cache(i) for i in range(len(caches))]


def states(caches: list[list]) -> list:
    return [c.state for cache in caches for c in cache]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--replies", type=int, default=4)
    ap.add_argument("--context", type=int, default=5000, help="tokens each conversation's cache holds")
    ap.add_argument("--new", type=int, default=51, help="reply tokens prefilled again")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    profile = PROFILES[args.profile]
    dtype = getattr(mx, profile["dtype"])
    model = tiny_model("llama", dtype=dtype, vocab_size=VOCAB, **profile["model"])
    mx.eval(model.parameters())
    caches = []
    for i in range(args.replies):
        cache = make_prompt_cache(model)
        tokens = mx.random.randint(0, VOCAB, (args.context + i,), key=mx.random.key(i)).tolist()
        prefill(model, cache, tokens, 0, len(tokens), 2048)
        caches.append(cache)
    news = [mx.random.randint(0, VOCAB, (args.new,), key=mx.random.key(100 + i)).tolist() for i in range(args.replies)]

    def one_by_one():
        for cache, new in zip(caches, news):
            prefill(model, cache, new, 0, len(new), 2048)
            mx.synchronize()
            for c in cache:
                c.trim(len(new))  # back to the conversation alone for the next repetition

    def batched():
        return states(prefill_together(model, caches, news, 2048))

    def parts():
        out = {}
        out["merge"] = timed(lambda: [c.state for c in _merge_caches(caches)])
        batch = PromptProcessingBatch(model, list(range(len(caches))), caches, prefill_step_size=2048)
        mx.eval([c.state for c in batch.prompt_cache])
        out["prompt"] = timed(lambda: batch.prompt(news))
        out["extract"] = timed(lambda: states([batch.extract_cache(i) for i in range(len(caches))]))
        return out

    rows: dict[str, list[float]] = {}
    for rep in range(args.reps + 1):
        figures = {"one_by_one": timed(one_by_one), "batched": timed(batched)}
        with mock.patch.object(mx, "clear_cache", lambda: None):
            figures["batched_keep_buffers"] = timed(batched)
        figures.update({f"batched_{k}": v for k, v in parts().items()})
        if rep == 0:
            continue  # kernels compile on the first repetition
        for k, v in figures.items():
            rows.setdefault(k, []).append(v)
    medians = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    print(f"{args.replies} replies of {args.new} tokens on {args.context}-token caches ({mx.default_device()}):")
    for k, v in medians.items():
        print(f"  {k:28} {v:8.1f} ms (median of {args.reps})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(
            profile=args.profile,
            device=describe_device(),
            replies=args.replies,
            context_tokens=args.context,
            new_tokens=args.new,
            median_ms=medians,
            samples_ms={k: [round(x * 1e3, 2) for x in v] for k, v in rows.items()},
        )
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
