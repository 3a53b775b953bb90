"""One rank of a distributed group (started by mlx.launch in the tests): loads a
model folder sharded, opens the group's store, and plays turns.

    _rank.py --model DIR --store ROOT --kind tensor|pipeline --steps FILE --out DIR

Each turn (`{"tokens": [...], "generate": n, "checkpoints": [...]}`) fetches the longest prefix the group
restores, prefills the rest (inserting at the hit's checkpoints, as a server's
prefill does), stores the prompt, and checks the result against a prefill of the
whole prompt from an empty cache in this same group: the last position's logits
(largest difference) and `n` greedy tokens from each. What this rank saw goes to
OUT/rank-R.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import sharded_load

from promptstore import PromptStore
from promptstore.errors import PromptStoreError
from promptstore.store.group import Group


def prefill(model, cache, toks, start, points, space=None):
    """Run toks[start:] through the model, stopping at each of `points` to insert
    the prefix there (when `space` is given); the last position's logits."""
    pos, logits = start, None
    for end in [p for p in points if start < p < len(toks)] + [len(toks)]:
        logits = model(mx.array([toks[pos:end]]), cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        if space is not None and end < len(toks):
            space.insert(toks[:end], cache)
        pos = end
    return logits


def greedy(model, cache, logits, n):
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--kind", choices=("tensor", "pipeline"), required=True)
    p.add_argument("--steps", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    handle = mx.distributed.init()
    group = Group.of(handle, args.kind)
    model, _ = sharded_load(
        args.model,
        pipeline_group=handle if args.kind == "pipeline" else None,
        tensor_group=handle if args.kind == "tensor" else None,
    )
    store = PromptStore.open(args.store, group=group, hot_bytes=64 << 20)
    space = store.bind(model, model_id="group-test")
    seen = []
    for step in json.loads(Path(args.steps).read_text()):
        toks = step["tokens"]
        try:
            hit = space.fetch(toks, step.get("checkpoints", ()))
        except PromptStoreError as e:  # bad input: refused alike on every rank, the group goes on
            seen.append({"refused": type(e).__name__})
            continue
        logits = prefill(model, hit.cache, toks, hit.length, hit.checkpoints, space)
        space.insert(toks, hit.cache)
        reference_cache = space.new_cache()
        reference = prefill(model, reference_cache, toks, 0, ())
        diff = float(mx.max(mx.abs(logits.astype(mx.float32) - reference.astype(mx.float32))).item())
        n = step.get("generate", 8)
        seen.append(
            {
                "hit": hit.length,
                "checkpoints": list(hit.checkpoints),
                "max_diff": diff,
                "greedy": greedy(model, hit.cache, logits, n),
                "reference": greedy(model, reference_cache, reference, n),
            }
        )
    counts = dict(store.counts)
    store.close()
    rank = handle.rank() if group else 0
    out = {
        "rank": rank,
        "size": handle.size(),
        "folder": str(store.path),
        "shard": space.namespace.spec.shard,
        "counts": counts,
    }
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(out | {"steps": seen}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
