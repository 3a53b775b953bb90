"""Splitting an edge of a hybrid model where its recurrent state is unknown.

A second prompt that diverges inside a stored node splits it at a position
where recurrent layers have no state. Layers that hold a range there (KV,
including the KV child of a cache list: Falcon-H1, Baichuan-M1) keep it, so the
node below stays restorable; whole-state layers wait for a checkpoint, which a
later prefill that passes the branch point fills in.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.store.compact import compact

from ..conftest import _model, forward, fresh_cache, insert_following_checkpoints, prompt_tokens

TOL = 1e-4
A = prompt_tokens(40, seed=31)
BRANCH = 17
B = mx.concatenate([A[:BRANCH], prompt_tokens(15, seed=32)])
FAMILIES = ["falcon_h1", "baichuan_m1", "qwen3_next", "llama"]


def prefill_insert(space, model, tokens):
    hit = space.fetch(tokens)
    forward(model, hit.cache, tokens[hit.length :])
    space.insert(tokens, hit.cache)


def served(space, model, tokens) -> tuple[int, float]:
    """(hit length, max |logits - full prefill|) continuing `tokens` from a fetch."""
    hit = space.fetch(tokens)
    got = forward(model, hit.cache, tokens[hit.length :])
    want = forward(model, fresh_cache(model), tokens)
    return hit.length, mx.abs(got - want).max().item()


def then(tokens, seed):
    return mx.concatenate([tokens, prompt_tokens(3, seed=seed)])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_lower_half_of_a_split_serves_whole(tmp_path, family):
    model = _model(family)
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        prefill_insert(space, model, A)
        prefill_insert(space, model, B)  # splits [0, 40) at 17, where no recurrent state is known
        spans = sorted((n.start, n.end) for n in store.index.iter_nodes(space.namespace))
        assert spans == sorted([(0, BRANCH), (BRANCH, len(A)), (BRANCH, len(B))])
        for tokens, seed in ((A, 1), (B, 2)):
            length, err = served(space, model, then(tokens, seed))
            assert length == len(tokens) and err < TOL, (length, err)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:  # from disk, in a new store
        space = store.bind(model, model_id="m")
        length, err = served(space, model, then(A, 3))
        assert (length, list(store.reports)) == (len(A), []) and err < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_through_the_branch_point_fills_its_checkpoint(tmp_path, family):
    model = _model(family)
    hybrid = family != "llama"
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        prefill_insert(space, model, A)
        prefill_insert(space, model, B)
        at_branch = then(A[:BRANCH], 4)
        hit = space.fetch(at_branch)
        # Recurrent layers have no state at the branch point yet: nothing before it is served.
        assert hit.length == (0 if hybrid else BRANCH)
        if hybrid:
            assert BRANCH in hit.checkpoints
            forward(model, hit.cache, at_branch[:BRANCH])
            space.insert(at_branch[:BRANCH], hit.cache)
        length, err = served(space, model, at_branch)
        assert length == BRANCH and err < TOL, (length, err)
    report = compact(tmp_path, verify=True)  # nothing to repair: no orphan, no bad file
    assert report.status != "failed" and set(report.actions) <= {"LMDB space"}, report.actions
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        for tokens, _seed in ((then(A[:BRANCH], 5), None), (then(A, 6), None), (then(B, 7), None)):
            length, err = served(space, model, tokens)
            assert length == len(tokens) - 3 and err < TOL, (length, err)
        assert list(store.reports) == []


SYSTEM = A[:BRANCH]  # a system prompt every conversation starts with


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_next", "gemma3_text"])
def test_a_checkpoint_the_caller_names_serves_the_second_conversation(tmp_path, family):
    """Recurrent layers restore only where a state was stored, so the hint is what
    serves the second conversation; window layers are ranges, and restore at the
    whole shared prefix with or without it."""
    model = _model(family)
    first, second = (mx.concatenate([SYSTEM, prompt_tokens(12, seed=s)]) for s in (41, 42))
    shared = next(i for i, (a, b) in enumerate(zip(first.tolist(), second.tolist())) if a != b)
    recurrent = family != "gemma3_text"
    with PromptStore.open(tmp_path / "told", durability="sync") as store:
        space = store.bind(model, model_id="m")
        assert BRANCH in insert_following_checkpoints(space, model, first, checkpoints=(BRANCH,)).checkpoints
        length, err = served(space, model, second)
        assert length == (BRANCH if recurrent else shared) and err < TOL, (length, err)
    with PromptStore.open(tmp_path / "not told", durability="sync") as store:
        space = store.bind(model, model_id="m")
        insert_following_checkpoints(space, model, first)
        length, err = served(space, model, second)
        assert (length < BRANCH if recurrent else length == shared) and err < TOL, (length, err)


def test_named_checkpoints_are_not_needed_by_attention_only_models(tmp_path):
    model = _model("llama")
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="m")
        assert space.fetch(A, checkpoints=(BRANCH,)).checkpoints == ()


@pytest.mark.parametrize("bad", [(-1,), (len(A) + 1,), ("17",), (1.5,)])
def test_bad_checkpoints_are_a_typed_error(tmp_path, bad):
    from promptstore.errors import SnapshotRangeError

    with PromptStore.open(tmp_path) as store:
        space = store.bind(_model("qwen3_next"), model_id="m")
        with pytest.raises(SnapshotRangeError):
            space.fetch(A, checkpoints=bad)
        assert store.index.namespaces() and list(store.index.iter_nodes(space.namespace)) == []
