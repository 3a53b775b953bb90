"""A fetch whose index read a spill made stale before the fetch read the data:
the node is found as the index has it now, never a miss.

A fetch reads the path from the index, then each node's data from memory, the
writer's queue or its file. The writer may publish a spill in between: the
job leaves the queue and the record read before names no file (or a file the
spill replaced and removed). `make test` once failed on it: a hybrid hit of 29
tokens came back as 16."""

import threading

import mlx.core as mx

from promptstore import PromptStore
from promptstore.index import index as index_module
from promptstore.snapshots.writer import SpillJob

from ..conftest import _model, assert_hit_whole, forward, fresh_cache, insert_following_checkpoints, prompt_tokens
from .test_hybrid_checkpoints import STEP, A, diverging


def _filled(model, tokens):
    cache = fresh_cache(model)
    forward(model, cache, tokens)
    return cache


def _after_lookup(monkeypatch, then):
    """Index.lookup runs `then()` once, after its read and before the fetch uses it."""
    real, done = index_module.Index.lookup, []

    def lookup_then(self, namespace, tokens):
        match = real(self, namespace, tokens)
        if not done:
            done.append(True)
            then()
        return match

    monkeypatch.setattr(index_module.Index, "lookup", lookup_then)
    return done


def _spills_held(store, monkeypatch):
    """The store's writer holds every spill until the returned `publish()`, which
    lets them go and waits until they are published."""
    real_write, gate = store.tiers.cold.write, threading.Event()

    def write_when_let(node, snapshots):
        assert gate.wait(30), "the test never let the spills go"
        return real_write(node, snapshots)

    monkeypatch.setattr(store.tiers.cold, "write", write_when_let)

    def publish():
        gate.set()
        store.tiers.spills.writer.flush()

    return publish


def test_a_spill_published_between_the_lookup_and_the_read_is_read_from_its_file(tmp_path, model_of, monkeypatch):
    model = model_of("llama")
    a = prompt_tokens(40, seed=1)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:  # every node leaves memory for the writer at once
        space = store.bind(model, model_id="m")
        publish = _spills_held(store, monkeypatch)
        space.insert(a, _filled(model, a))
        [node] = store.index.lookup(space.namespace, a).path
        assert node.record.file is None and store.tiers.is_held(node)  # queued, not yet on disk
        done = _after_lookup(monkeypatch, publish)
        hit = space.fetch(a)
        assert done and (hit.length, hit.cold_nodes) == (len(a) - 1, 1)  # the job had gone: read from the file
        monkeypatch.undo()
        assert_hit_whole(space, model, a)
        assert not store.reports


def test_a_file_replaced_between_the_lookup_and_the_read_is_read_as_replaced(tmp_path, model_of, monkeypatch):
    model = model_of("llama")
    a = prompt_tokens(40, seed=2)
    with PromptStore.open(tmp_path, durability="sync") as store:
        store.bind(model, model_id="m").insert(a, _filled(model, a))
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        [node] = store.index.lookup(space.namespace, a).path
        first = store.tiers.reads.file_of(node)
        snapshots = store.tiers.get(node)
        assert first.exists() and snapshots is not None and not store.tiers.is_held(node)

        def respill():  # as the writer does when a node is spilled again: a new file, the old one removed
            store.tiers.spills.writer.write_now(SpillJob(node.id, snapshots))

        done = _after_lookup(monkeypatch, respill)
        hit = space.fetch(a)
        assert done and not first.exists()
        assert (hit.length, hit.cold_nodes) == (len(a) - 1, 1)
        monkeypatch.undo()
        assert_hit_whole(space, model, a)
        assert not store.reports


def test_the_hybrid_hit_that_failed_in_ci_restores_whole_when_the_spills_land_after_the_lookup(tmp_path, monkeypatch):
    """test_hybrid_checkpoints' last fetch, with the race made certain: a falcon_h1
    store whose spills (the checkpoint at 24 filled in again, the branch point at
    29) are published between the fetch's lookup and its reads. It restored 16
    tokens of 29 before."""
    model = _model("falcon_h1")
    with PromptStore.open(tmp_path, prefill_step=STEP) as store:
        space = store.bind(model, model_id="m")
        insert_following_checkpoints(space, model, A)
        assert space.fetch(diverging(21, seed=82)).length == 16  # the state at 16 is used, so kept
    with PromptStore.open(tmp_path, prefill_step=STEP, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        publish = _spills_held(store, monkeypatch)
        insert_following_checkpoints(space, model, diverging(29, seed=83))
        done = _after_lookup(monkeypatch, publish)
        tokens = diverging(30, seed=84)
        hit = space.fetch(tokens)
        assert done and hit.length == 29
        got = forward(model, hit.cache, tokens[hit.length :])
        assert mx.abs(got - forward(model, fresh_cache(model), tokens)).max().item() < 1e-4
        assert not store.reports
