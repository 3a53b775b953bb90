"""Hybrid models restore where prompts diverge, not only at checkpoints, through
every path: hot, cold, split, forked, after a restart, and after compact.

Prompts diverge at positions that are no checkpoint (not on the prefill grid, not
a node end); every hit must continue exactly as a full prefill does (logits
within 1e-4 in float32, greedy tokens identical). Window layers (gemma3_text,
baichuan_m1's sliding layers) restore at the divergence itself when nothing
else limits them; recurrent layers at most one prefill step before it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.store.compact import compact

from ..conftest import _model, forward, fresh_cache, greedy, insert_following_checkpoints, prompt_tokens

TOL = 1e-4
STEP = 8  # prefill step, so short prompts cross several chunk boundaries
FAMILIES = ["gemma3_text", "qwen3_next", "falcon_h1", "baichuan_m1"]
RECURRENT = {"qwen3_next", "falcon_h1", "baichuan_m1"}
A = prompt_tokens(44, seed=61)


def diverging(at: int, seed: int, n: int = 9) -> mx.array:
    return mx.concatenate([A[:at], prompt_tokens(n, seed=seed)])


def shared(a: mx.array, b: mx.array) -> int:
    return next((i for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())) if x != y), min(len(a), len(b)))


def check(space, model, tokens, diverges_at: int, family: str) -> int:
    """Fetch `tokens`, continue, compare with a full prefill; returns the hit length."""
    hit = space.fetch(tokens)
    # A window model restores at the divergence; a recurrent one at most a step before it.
    floor = diverges_at - (STEP if family in RECURRENT else 0)
    assert min(floor, len(tokens) - 1) <= hit.length <= len(tokens) - 1, (hit.length, diverges_at)
    got = forward(model, hit.cache, tokens[hit.length :])
    ref_cache = fresh_cache(model)
    want = forward(model, ref_cache, tokens)
    assert mx.abs(got - want).max().item() < TOL
    assert greedy(model, hit.cache, got, 4) == greedy(model, ref_cache, want, 4)
    return hit.length


def window_positions(snapshots) -> list[int]:
    """Positions each sliding-window part of a node's snapshots holds."""
    out = []
    for s in snapshots:
        for part in s.children if s is not None and s.children else (s,):
            if part is not None and part.kind == "rotating":
                out.append(part.arrays["keys"].shape[2] if part.arrays else 0)
    return out


def store(root, **settings):
    return PromptStore.open(root, prefill_step=STEP, **settings)


@pytest.mark.parametrize("family", FAMILIES)
def test_divergences_inside_nodes_restore_hot_cold_and_after_compact(tmp_path, family):
    model = _model(family)
    b, c = diverging(21, seed=62), diverging(30, seed=63)
    with store(tmp_path, durability="sync") as s:
        space = s.bind(model, model_id="m")
        insert_following_checkpoints(space, model, A)
        check(space, model, b, shared(A, b), family)  # hot, inside the node [16, 24)
        insert_following_checkpoints(space, model, b)  # splits it at 21
        check(space, model, c, shared(A, c), family)
        check(space, model, diverging(21, seed=64), 21, family)  # at the branch point
    with store(tmp_path, hot_bytes=0) as s:  # after a restart, from the files only
        space = s.bind(model, model_id="m")
        for tokens in (c, diverging(12, seed=65), mx.concatenate([b, prompt_tokens(3, seed=66)])):
            check(space, model, tokens, shared(A if len(tokens) != len(b) + 3 else b, tokens), family)
        assert list(s.reports) == []
    report = compact(tmp_path, verify=True)
    assert report.status != "failed" and "merged chains" in report.actions, report.actions
    with store(tmp_path, hot_bytes=0) as s:  # joined nodes restore at their ends and past them
        space = s.bind(model, model_id="m")
        for node in s.index.iter_nodes(space.namespace):  # a window layer keeps at most its last window
            assert all(held <= 16 for held in window_positions(s.tiers.get(node))), (node.start, node.end)
        for tokens in (mx.concatenate([A, prompt_tokens(3, seed=67)]), diverging(21, seed=68)):
            hit = space.fetch(tokens)
            assert hit.length > 0
            got = forward(model, hit.cache, tokens[hit.length :])
            assert mx.abs(got - forward(model, fresh_cache(model), tokens)).max().item() < TOL
        assert list(s.reports) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_forks_of_a_hit_inside_a_node_are_independent(tmp_path, family):
    model = _model(family)
    with store(tmp_path) as s:
        space = s.bind(model, model_id="m")
        insert_following_checkpoints(space, model, A)
        tokens = diverging(27, seed=69)
        one, two = space.fetch(tokens), space.fetch(tokens)
        assert one.length == two.length > 0
        forward(model, one.cache, prompt_tokens(13, seed=70))  # one fork goes elsewhere
        check(space, model, tokens, 27, family)
        got = forward(model, two.cache, tokens[two.length :])
        assert mx.abs(got - forward(model, fresh_cache(model), tokens)).max().item() < TOL


def test_a_window_model_restores_at_every_divergence(tmp_path):
    """gemma3_text keeps no state: every divergence point is a restore point, with
    no checkpoint there, once the prompt is stored node by node (the prefill grid)."""
    model = _model("gemma3_text")
    with store(tmp_path, durability="sync") as s:
        space = s.bind(model, model_id="m")
        insert_following_checkpoints(space, model, A)
        for at in range(1, len(A)):
            assert space.fetch(diverging(at, seed=100 + at, n=2)).length == shared(A, diverging(at, 100 + at, 2))


def test_a_split_takes_the_window_the_inserting_prompt_still_holds(tmp_path):
    """A long node stored from a cache that had dropped its first positions holds
    only its tail; when a second prompt splits it early, the upper node's window
    comes from that prompt's cache, so the branch point becomes a restore point."""
    model = _model("gemma3_text")  # window of 16
    with store(tmp_path, durability="sync") as s:
        space = s.bind(model, model_id="m")
        cache = fresh_cache(model)
        forward(model, cache, A[:30])
        forward(model, cache, A[30:])  # the window now holds [13, 44): the node keeps no more
        space.insert(A, cache)
        b = diverging(20, seed=71)
        hit = space.fetch(b)
        assert hit.length == 0  # [4, 20) is stored nowhere yet
        forward(model, hit.cache, b)
        space.insert(b, hit.cache)  # its cache holds all of b: the split upper [0, 20) gets them
        assert check(space, model, diverging(20, seed=72), 20, "gemma3_text") == 20
