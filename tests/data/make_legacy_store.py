"""Build tests/data/legacy-store-v2: a store written by the snapshot format 2 code
(commit dd4fc98), holding llama, gemma3_text and qwen3_next nodes, so later code
can be tested against it. Run from the repository root at that commit:

    .venv/bin/python tests/data/make_legacy_store.py

Each family stores prompt A (following the checkpoints its hit asks for, on a grid
of 16), then prompt B, which diverges inside A's span and splits a node, then
prompt C, inserted without following checkpoints: its split leaves a node whose
whole-state layers wait for a checkpoint.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from promptstore import PromptStore  # noqa: E402
from tests.conftest import _model, forward, insert_following_checkpoints, prompt_tokens  # noqa: E402

FAMILIES = ("llama", "gemma3_text", "qwen3_next")
A = prompt_tokens(40, seed=71)
BRANCH = 23
B = mx.concatenate([A[:BRANCH], prompt_tokens(12, seed=72)])
C_BRANCH = 28
C = mx.concatenate([A[:C_BRANCH], prompt_tokens(9, seed=73)])
OUT = Path(__file__).resolve().parent / "legacy-store-v2"


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    with PromptStore.open(OUT, durability="sync", checkpoint_interval=16) as store:
        for family in FAMILIES:
            model = _model(family)
            space = store.bind(model, model_id=f"legacy-{family}")
            insert_following_checkpoints(space, model, A)
            insert_following_checkpoints(space, model, B)
            hit = space.fetch(C)
            forward(model, hit.cache, C[hit.length :])
            space.insert(C, hit.cache)
    (OUT / "lock").unlink(missing_ok=True)
    (OUT / "index" / "lock.mdb").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
