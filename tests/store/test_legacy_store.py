"""A store written by the snapshot format 2 code (tests/data/legacy-store-v2,
built by tests/data/make_legacy_store.py) opens and restores with fidelity:
its whole-window snapshots of sliding-window layers are read as the positions
they hold, alone and in chains with new range snapshots, and compact keeps it
serving."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.store.compact import compact

from ..conftest import _model, forward, fresh_cache, greedy, insert_following_checkpoints, prompt_tokens

DATA = Path(__file__).resolve().parents[1] / "data" / "legacy-store-v2"
FAMILIES = ("llama", "gemma3_text", "qwen3_next")
TOL = 1e-4
# The prompts the store was built from (see make_legacy_store.py).
A = prompt_tokens(40, seed=71)
B = mx.concatenate([A[:23], prompt_tokens(12, seed=72)])
C = mx.concatenate([A[:28], prompt_tokens(9, seed=73)])


@pytest.fixture
def legacy(tmp_path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(DATA, root)
    root.chmod(0o700)
    return root


def served(space, model, tokens) -> int:
    hit = space.fetch(tokens)
    got = forward(model, hit.cache, tokens[hit.length :])
    ref = fresh_cache(model)
    want = forward(model, ref, tokens)
    assert mx.abs(got - want).max().item() < TOL, hit.length
    assert greedy(model, hit.cache, got, 3) == greedy(model, ref, want, 3)
    return hit.length


def more(tokens, seed):
    return mx.concatenate([tokens, prompt_tokens(3, seed=seed)])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_format_2_store_restores_what_it_stored(legacy, family):
    model = _model(family)
    with PromptStore.open(legacy, hot_bytes=0) as store:
        space = store.bind(model, model_id=f"legacy-{family}")
        assert len(list(store.index.iter_nodes(space.namespace))) >= 5  # the same namespace as before
        for tokens, seed in ((A, 1), (B, 2), (C, 3)):
            assert served(space, model, more(tokens, seed)) == len(tokens)
        # Inside a node: attention and window layers restore there (old whole windows
        # hold the positions), recurrent ones at the last node end before it.
        inside = mx.concatenate([A[:34], prompt_tokens(4, seed=4)])
        assert served(space, model, inside) == (32 if family == "qwen3_next" else 34)
        assert list(store.reports) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_new_nodes_grow_on_format_2_nodes(legacy, family):
    """New range snapshots below and beside old whole windows: splits of old nodes,
    chains that mix both, compact joining them, a restart."""
    model = _model(family)
    longer = mx.concatenate([A, prompt_tokens(20, seed=5)])
    split = mx.concatenate([A[:37], prompt_tokens(10, seed=6)])  # inside the old node [32, 40)
    with PromptStore.open(legacy, durability="sync", prefill_step=8) as store:
        space = store.bind(model, model_id=f"legacy-{family}")
        insert_following_checkpoints(space, model, longer)
        insert_following_checkpoints(space, model, split)
        for tokens, seed in ((longer, 7), (split, 8), (B, 9)):
            assert served(space, model, more(tokens, seed)) == len(tokens)
    report = compact(legacy, verify=True)
    assert report.status != "failed", report.errors
    with PromptStore.open(legacy, hot_bytes=0) as store:
        space = store.bind(model, model_id=f"legacy-{family}")
        for tokens, seed in ((longer, 10), (split, 11), (C, 12)):
            assert served(space, model, more(tokens, seed)) == len(tokens)
        assert list(store.reports) == []
