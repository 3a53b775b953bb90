"""A writer that inserts prefixes of shared-prefix token sequences into a store
until it is killed (tests/store/test_crash.py sends SIGKILL at a random instant).

Run as: python _crash_worker.py STORE_DIR DURABILITY SEED [HOT_BYTES]
It imports everything, prints "imported", waits for "go" on stdin (so the parent
can verify the store while the next writer is starting up), opens the store,
prints "ready", then loops: fetch a random prefix, prefill what was not served,
insert it; it prints the number of inserts done every few rounds.
"""

from __future__ import annotations

import random
import sys

import numpy as np

MODEL_ID = "crash"
HOT_BYTES = 1 << 15  # small: evictions and cold loads happen all the time


def sequences() -> list[list[int]]:
    """8 sequences of 56-120 tokens sharing prefixes: a 24-token root, 2 branches of
    16 tokens, 4 of 16 more, then 8 tails of 0-64 tokens."""
    rng = np.random.default_rng(20240607)

    def draw(n):
        return [int(t) for t in rng.integers(0, 256, n)]

    root = draw(24)
    level1 = [root + draw(16) for _ in range(2)]
    level2 = [level1[i // 2] + draw(16) for i in range(4)]
    return [level2[i // 2] + draw(int(rng.integers(0, 65))) for i in range(8)]


def main(store_dir: str, durability: str, seed: int, hot_bytes: int = HOT_BYTES) -> int:
    import mlx.core as mx

    from promptstore import PromptStore
    from promptstore.testing.models import tiny_model

    model = tiny_model("llama")
    seqs = [mx.array(s, dtype=mx.uint32) for s in sequences()]
    rng = random.Random(seed)
    print("imported", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    with PromptStore.open(store_dir, durability=durability, hot_bytes=hot_bytes) as store:
        space = store.bind(model, model_id=MODEL_ID)
        print("ready", flush=True)
        inserts = 0
        while True:
            tokens = rng.choice(seqs)
            n = rng.randint(2, tokens.size)
            prefix = tokens[:n]
            hit = space.fetch(prefix)
            mx.eval(model(prefix[hit.length :][None], cache=hit.cache))
            space.insert(prefix, hit.cache)
            inserts += 1
            if inserts % 5 == 0:
                print(f"inserts {inserts}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:5])))
