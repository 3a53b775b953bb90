"""PromptStore.metrics(): after a known sequence of fetches and inserts (a miss, a
hot hit, a restart and a cold hit, an eviction, a damaged file, a warm start) the
counters equal what happened, each hit's tokens counted under the tier it came
from."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from promptstore import PromptStore
from promptstore.store.metrics import ModelMetrics, StoreMetrics

from ..conftest import _model, forward, fresh_cache, prompt_tokens

A = prompt_tokens(40, seed=301)
B = prompt_tokens(40, seed=302)


def stored(space, model, tokens) -> None:
    cache = fresh_cache(model)
    forward(model, cache, tokens)
    space.insert(tokens, cache)


def node_file(store, space, tokens):
    node = store.index.lookup(space.namespace, tokens[:-1]).path[-1]
    return node, store.tiers.reads.file_of(node)


def test_the_stores_own_fetch_is_not_counted(tmp_path):
    """fetch(count=False), which the server makes to extend what it holds: the
    same hit, left out of the metrics, the namespace's counters and last_hit."""
    model = _model("llama")
    longer = mx.concatenate([A, prompt_tokens(5, seed=304)])
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        stored(space, model, A)
        counted = space.fetch(longer)
        before = store.metrics().models["m"]
        own = space.fetch(longer, count=False)
        assert own.length == counted.length == len(A) and space.last_hit == counted.figures()
        assert store.metrics().models["m"] == before
        assert space.fetch(A[:1], count=False).length == 0 and store.metrics().models["m"] == before
        space.flush_stats()
        counts = store.index.counters(space.namespace)
        assert (counts["hits"], counts["misses"]) == (1, 0)


def test_a_miss_a_hot_hit_a_restart_and_a_cold_hit_are_counted_by_tier(tmp_path):
    model = _model("llama")
    longer = mx.concatenate([A, prompt_tokens(5, seed=303)])
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        assert space.fetch(A).length == 0
        stored(space, model, A)
        hot = space.fetch(longer)
        assert hot.length == len(A) and hot.cold_nodes == 0
        node, path = node_file(store, space, A)
        m = store.metrics()
    assert isinstance(m, StoreMetrics) and list(m.models) == ["m"]
    got = m.models["m"]
    assert (got.fetches, got.hits, got.prompt_tokens) == (2, 1, len(A) + len(longer))
    assert got.restored_tokens == {"hot": len(A), "cold": 0, "remote": 0, "computed": 0}
    assert got.restores == {"hot": 1, "cold": 0, "remote": 0}
    assert got.restore_bytes["hot"] == node.record.nbytes > 0
    assert got.restore_seconds["hot"] == hot.seconds
    assert got.prefilled_tokens == len(A) + len(longer) - len(A)
    assert (m.files_written, m.disk_written_bytes) == (1, path.stat().st_size)
    assert (m.stored_nodes, m.stored_bytes, m.hot_nodes) == (1, node.record.nbytes, 1)
    assert m.warm_start is None and m.quarantined_files == 0 and m.evictions == {"hot": 0, "cold": 0}

    # A new process: its counters start at zero, and the node comes from disk.
    with PromptStore.open(tmp_path, cold_plan="load", hot_bytes=1 << 30) as store:
        space = store.bind(model, model_id="m")
        cold = space.fetch(longer)
        assert cold.length == len(A) and cold.cold_tokens == len(A)
        m = store.metrics()
    got = m.models["m"]
    assert (got.fetches, got.hits) == (1, 1)
    assert got.restored_tokens == {"hot": 0, "cold": len(A), "remote": 0, "computed": 0}
    assert got.restores == {"hot": 0, "cold": 1, "remote": 0}
    assert got.restore_bytes["cold"] == node.record.nbytes
    assert m.files_written == 0 and got.hit_rate == len(A) / len(longer)


def test_memory_evictions_and_a_quarantined_file_are_counted(tmp_path):
    model = _model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        stored(space, model, A)
        nbytes = node_file(store, space, A)[0].record.nbytes
    # Room for one node: the second leaves the first's place.
    with PromptStore.open(tmp_path, durability="sync", hot_bytes=nbytes + nbytes // 2) as store:
        space = store.bind(model, model_id="m")
        assert space.fetch(A).cold_nodes == 1  # read into memory
        held = store.in_memory()[1]
        stored(space, model, B)
        m = store.metrics()
        assert m.evictions["hot"] == 1 and m.evicted_bytes["hot"] == held > 0
        assert m.hot_nodes == 1 and m.hot_budget_bytes == nbytes + nbytes // 2
        path = node_file(store, space, B)[1]
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 7] ^= 0x01  # a data byte: fails its checksum
    path.write_bytes(bytes(raw))
    with PromptStore.open(tmp_path, warm_start=False) as store:
        space = store.bind(model, model_id="m")
        assert space.fetch(B).length == 0
        m = store.metrics()
    assert m.quarantined_files == 1 and m.models["m"].fetches == 1 and m.models["m"].hits == 0


def test_warm_start_progress_and_tenants_counted_under_their_model(tmp_path):
    model = _model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store:
        for salt in ("salt-one", "salt-two"):
            stored(store.bind(model, model_id="m", salt=salt), model, A)
    with PromptStore.open(tmp_path, warm_start=True) as store:
        assert store.warming.wait(60)
        warm = store.metrics().warm_start
        assert warm.done and warm.nodes == warm.planned_nodes == 2 and warm.bytes == warm.planned_bytes > 0
        for salt in ("salt-one", "salt-two"):
            assert store.bind(model, model_id="m", salt=salt).fetch(A).length == len(A) - 1
        m = store.metrics()
    # Counters name the model, never a tenant: both tenants' fetches are one model's.
    assert list(m.models) == ["m"] and m.models["m"].fetches == 2
    assert m.models["m"].restored_tokens["hot"] == 2 * (len(A) - 1)


def test_an_empty_model_metrics_has_every_tier():
    empty = ModelMetrics()
    assert empty.hit_rate == 0.0 and empty.prefilled_tokens == 0
    assert set(empty.restored_tokens) == {"hot", "cold", "remote", "computed"}


def test_counters_are_written_off_the_request_path(tmp_path, monkeypatch, caplog):
    """Once a second (or every 64 nodes) the gathered counters are written, on
    the stats thread, not in the fetch that gathered them; flush_stats waits for
    that write and adds the rest, so nothing is lost or counted twice. A write
    the index refuses on the stats thread is logged, not raised into a fetch."""
    import threading

    from promptstore.errors import IndexStoreError

    model = _model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        stored(space, model, A)
        writers, real_bump = [], store.index.bump

        def bump(ns, **deltas):
            writers.append(threading.current_thread().name)
            return real_bump(ns, **deltas)

        monkeypatch.setattr(store.index, "bump", bump)
        space.flush_stats()
        writers.clear()
        monkeypatch.setattr(space, "_flushed", 0.0)  # a second has passed
        assert space.fetch(A).length == len(A) - 1
        space.fetch(A)
        space.flush_stats()
        assert writers[0].startswith("promptstore-stats") and writers[-1] == threading.current_thread().name
        counts = store.index.counters(space.namespace)
        assert counts["hits"] == 2

        def refused(ns, **deltas):
            raise IndexStoreError("the index is full")

        monkeypatch.setattr(store.index, "bump", refused)
        monkeypatch.setattr(space, "_flushed", 0.0)
        with caplog.at_level("WARNING", logger="promptstore.store"):
            assert space.fetch(A).length == len(A) - 1  # the fetch is served
            space._stats_write.result()  # the refusal stayed on the stats thread
        assert "advisory counters not written: the index is full" in caplog.text
        monkeypatch.setattr(store.index, "bump", bump)


def test_last_hit_keeps_figures_not_the_restored_memory(tmp_path):
    """A cold hit's arrays are freed when the caller lets its cache go: last_hit
    holds the hit's figures, not its cache (which held a restore's memory until
    the next fetch, and made that fetch's restore allocate beside it)."""
    import gc

    model = _model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store:
        stored(store.bind(model, model_id="m"), model, A)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        longer = mx.concatenate([A, prompt_tokens(3, seed=305)])
        del space.fetch(longer).cache  # kernels, buffers and rates of a first fetch
        gc.collect()
        before = mx.get_active_memory()
        hit = space.fetch(longer)
        mx.eval([c.state for c in hit.cache])
        assert hit.length == len(A) and hit.cold_tokens == len(A)
        held = mx.get_active_memory() - before
        arrays = [a for _, a in tree_flatten([c.state for c in hit.cache]) if isinstance(a, mx.array)]
        assert held >= sum(a.nbytes for a in arrays) > 0
        del arrays
        del hit
        gc.collect()
        assert mx.get_active_memory() == before
        assert space.last_hit.length == space.last_hit.cold_tokens == len(A) and space.last_hit.cache == []


def test_insert_phases_are_the_inserts_own_and_per_thread(tmp_path):
    """last_insert_phases(): where the last insert on this thread spent its time.
    An insert that stores a span plans, snapshots, commits and holds it, within its
    own wall time; one that stores nothing only plans; another thread's inserts
    leave this thread's figures as they were."""
    import threading
    import time

    model = _model("llama")
    with PromptStore.open(tmp_path, durability="write_back") as store:
        space = store.bind(model, model_id="m")
        assert space.last_insert_phases() == {}
        cache = fresh_cache(model)
        forward(model, cache, A)
        started = time.perf_counter()
        assert space.insert(A, cache) == len(A)
        wall = time.perf_counter() - started
        phases = space.last_insert_phases()
        assert set(phases) == {"plan", "snapshot", "index", "hold"}
        assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= wall

        assert space.insert(A, cache) == 0  # all stored: nothing to snapshot or commit
        assert set(space.last_insert_phases()) == {"plan"}

        other = {}

        def insert_b():
            stored(space, model, B)
            other.update(space.last_insert_phases())

        thread = threading.Thread(target=insert_b)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive() and set(other) == {"plan", "snapshot", "index", "hold"}
        assert set(space.last_insert_phases()) == {"plan"}  # this thread's last insert, still
