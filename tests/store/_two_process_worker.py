"""A process that inserts and fetches on a shared store, checking every hit."""

import sys

import mlx.core as mx

from promptstore import PromptStore
from promptstore.caches import make_prompt_cache
from promptstore.testing.models import tiny_model


def main(store_dir: str, seed: int, rounds: int) -> int:
    model = tiny_model("llama")
    base = mx.random.randint(0, 256, (48,), key=mx.random.key(100))  # shared by both processes
    bad = hits = 0
    with PromptStore.open(store_dir, durability="write_through") as store:
        space = store.bind(model, model_id="m")
        for r in range(rounds):
            tail = mx.random.randint(0, 256, (16 + r % 7,), key=mx.random.key(seed * 1000 + r))
            tokens = mx.concatenate([base, tail])
            hit = space.fetch(tokens)
            hits += hit.length > 0
            logits = model(tokens[hit.length :][None], cache=hit.cache)[:, -1]
            want = model(tokens[None], cache=make_prompt_cache(model))[:, -1]
            bad += mx.abs(logits - want).max().item() > 1e-4
            space.insert(tokens, hit.cache)  # the forward above left every token in it
    print(f"bad={bad} hits={hits}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
