"""Warm start: after a restart the most recently used nodes are read into the hot
tier in the background, within each tenant's budget, verified like any cold read;
hits on them are hot and continue exactly as a full prefill; a damaged file is
quarantined; closing the store during a warm start stops it."""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from promptstore import PromptStore

from ..conftest import _model, forward, fresh_cache, greedy, prompt_tokens

TOL = 1e-4
PROMPTS = [prompt_tokens(40, seed=80 + i) for i in range(6)]  # independent prompts: one node each


def fill(root, model, order, **settings):
    """Store every prompt, then fetch them in `order` (the last is the most recently used)."""
    with PromptStore.open(root, durability="sync", **settings) as store:
        space = store.bind(model, model_id="m")
        for tokens in PROMPTS:
            cache = fresh_cache(model)
            forward(model, cache, tokens)
            space.insert(tokens, cache)
        for i in order:
            time.sleep(0.002)
            assert space.fetch(PROMPTS[i]).length == len(PROMPTS[i]) - 1
        space.flush_stats()  # the access order is written in batches
        return space.namespace.key, store.index.get(_key(store, space, 0)).record.nbytes


def _key(store, space, i):
    return store.index.lookup(space.namespace, PROMPTS[i][:-1]).path[-1].key


def held(store, space) -> list[int]:
    return [i for i in range(len(PROMPTS)) if store.tiers.is_held(store.index.get(_key(store, space, i)))]


def test_a_warm_start_reads_the_most_recently_used_nodes_within_the_budget(tmp_path):
    model = _model("llama")
    order = [4, 1, 5, 0, 3, 2]  # most recent last
    _, nbytes = fill(tmp_path, model, order)
    with PromptStore.open(tmp_path, hot_bytes=3 * nbytes + nbytes // 2) as store:  # room for three
        space = store.bind(model, model_id="m")
        warming = store.warm()
        assert warming.wait(60)
        assert sorted(held(store, space)) == sorted(order[-3:])
        assert warming.progress()["nodes"] == 3 and store.in_memory()[1] <= 3 * nbytes + nbytes // 2
        tokens = mx.concatenate([PROMPTS[order[-1]], prompt_tokens(3, seed=90)])
        hit = space.fetch(tokens)
        assert hit.length == len(PROMPTS[order[-1]]) and hit.cold_nodes == 0 and hit.plan is None
        got = forward(model, hit.cache, tokens[hit.length :])
        ref = fresh_cache(model)
        want = forward(model, ref, tokens)
        assert mx.abs(got - want).max().item() < TOL
        assert greedy(model, hit.cache, got, 4) == greedy(model, ref, want, 4)


def test_the_warm_start_setting_starts_on_open_and_spares_other_namespaces(tmp_path):
    model = _model("llama")
    namespace, _ = fill(tmp_path, model, range(len(PROMPTS)))
    with PromptStore.open(tmp_path, warm_start=True) as store:
        assert store.warming is not None and store.warming.wait(60)
        assert store.warming.progress()["nodes"] == len(PROMPTS)
    with PromptStore.open(tmp_path) as store:
        assert store.warm(namespaces=[b"\0" * len(namespace)]).wait(60)
        assert store.warming.progress()["nodes"] == 0


def test_a_damaged_file_met_while_warming_is_quarantined_and_never_served(tmp_path):
    model = _model("llama")
    fill(tmp_path, model, range(len(PROMPTS)))
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="m")
        node = store.index.get(_key(store, space, 2))
        path = store.tiers.cold.absolute(node.record.file)
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x40  # a byte of the last array's data
        path.write_bytes(bytes(data))
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="m")
        assert store.warm().wait(60)
        assert 2 not in held(store, space) and len(held(store, space)) == len(PROMPTS) - 1
        assert [r.reason for r in store.reports] == ["checksum"]
        assert len(list((tmp_path / "cold" / "quarantine").iterdir())) == 1
        assert space.fetch(PROMPTS[2]).length == 0  # the node lost its file: a miss
        assert [r.reason for r in store.reports] == ["checksum"]


def test_closing_the_store_stops_a_warm_start_between_reads(tmp_path, monkeypatch):
    model = _model("llama")
    fill(tmp_path, model, range(len(PROMPTS)))
    with PromptStore.open(tmp_path) as store:
        reading = threading.Event()
        real = store.tiers.read_into_memory

        def slow(nodes):  # a slow disk: each batch takes a while
            reading.set()
            time.sleep(0.3)
            return real(nodes)

        monkeypatch.setattr(store.tiers, "read_into_memory", slow)
        monkeypatch.setattr("promptstore.store.warm_start.BATCH_FILES", 1)
        warming = store.warm()
        assert reading.wait(30)
        started = time.monotonic()
    assert time.monotonic() - started < 5  # close waited for one batch, not for all
    assert warming.done.is_set() and not warming.thread.is_alive()
    assert warming.progress()["nodes"] < len(PROMPTS)
    with PromptStore.open(tmp_path) as store:  # nothing left behind: it opens and hits
        space = store.bind(model, model_id="m")
        assert space.fetch(PROMPTS[0]).length == len(PROMPTS[0]) - 1
