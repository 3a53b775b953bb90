"""A process whose hot tier evicts all the time, sampling its own memory.

Run as: python _memory_worker.py STORE_DIR OPS HOT_BYTES [SAMPLES [TOKENS]]
It inserts prompts of TOKENS tokens (default 128; groups of four share a
16-token prefix, so inserts split nodes too) and fetches earlier ones (cold loads, promoted hot,
evicted again), under a hot budget a few nodes wide with write_back
durability, so nearly every operation evicts and spills. It prints one JSON
line per sample: operation, RSS and its anonymous part (from /proc/self/statm), the hot tier's bytes,
MLX's active and cache memory, spills and cold loads so far; then "done".
"""

from __future__ import annotations

import json
import os
import random
import sys

import mlx.core as mx

from promptstore import PromptStore
from promptstore.testing.models import tiny_model

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> tuple[int, int]:
    """(resident bytes, resident bytes not backed by a file): the index's mapped
    pages count in the first only."""
    with open("/proc/self/statm") as f:
        _, resident, shared = (int(x) for x in f.read().split()[:3])
    return resident * PAGE, (resident - shared) * PAGE


def prompt(i: int, n: int) -> mx.array:
    head = mx.random.randint(0, 256, (16,), key=mx.random.key(10_000 + i // 4))
    return mx.concatenate([head, mx.random.randint(0, 256, (n - 16,), key=mx.random.key(i))])


def main(root: str, ops: int, hot_bytes: int, samples: int = 20, n_tokens: int = 128) -> None:
    model = tiny_model("llama")
    rng = random.Random(0)
    largest = 0
    with PromptStore.open(root, durability="write_back", hot_bytes=hot_bytes) as store:
        space = store.bind(model, model_id="m")
        stored = 0
        for op in range(ops):
            i = stored if stored < 8 or rng.random() < 0.6 else rng.randrange(stored)
            tokens = prompt(i, n_tokens)
            hit = space.fetch(tokens)
            if hit.length < len(tokens):
                model(tokens[hit.length :][None], cache=hit.cache)
                space.insert(tokens, hit.cache)
            stored += i == stored
            largest = max([largest, *(e.nbytes for e in store.tiers.hot.entries.values())])
            if op % max(1, ops // samples) == 0 or op == ops - 1:
                mx.eval([])
                sample = {
                    "op": op,
                    "rss": rss()[0],
                    "rss_anon": rss()[1],
                    "hot": store.in_memory()[1],
                    "hot_largest": largest,
                    "active": mx.get_active_memory(),
                    "cache": mx.get_cache_memory(),
                    "spills": store.counts["spills"],
                    "cold_loads": store.counts["cold_loads"],
                    "stored": stored,
                }
                print(json.dumps(sample), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
