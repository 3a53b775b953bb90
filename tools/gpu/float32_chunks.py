"""How far a float32 prefill in two chunks lands from one in a single call, on
whatever device MLX runs (no store, no batching): the floor under any
restore-against-prefill comparison there. On CPU the two agree exactly; on an
H200 they differed by 0.7-3.1e-3 in the logits (bench-results/chat-users/
cuda-float32-chunks.json), above the 1e-4 the CPU suite holds restores to.
Prints the figures and writes cuda-float32-chunks.json under $OUT (else here)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from promptstore.testing.models import tiny_model  # noqa: E402

FAMILIES = ("llama", "gemma3_text", "qwen3_next")


def main() -> int:
    out: dict = {"device": str(mx.default_device())}
    tokens = [(i * 7919) % 500 + 1 for i in range(120)]
    for family in FAMILIES:
        model = tiny_model(family, seed=0, dtype=mx.float32, vocab_size=512)
        whole = model(mx.array([tokens]), cache=make_prompt_cache(model))[0, -1]
        cache = make_prompt_cache(model)
        model(mx.array([tokens[:70]]), cache=cache)
        parts = model(mx.array([tokens[70:]]), cache=cache)[0, -1]
        out[family] = mx.abs(whole - parts).max().item()
    print(json.dumps(out))
    (Path(os.environ.get("OUT", ".")) / "cuda-float32-chunks.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
