"""Tiers: budgets, durability settings, eviction order, and a disk that refuses writes."""

import os
import stat

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptstore import PromptStore
from promptstore import caches as C
from promptstore.errors import DiskWriteError
from promptstore.snapshots import HotTier

from ..caches.drivers import kv_rows
from ..conftest import forward, fresh_cache, prompt_tokens


def kv_snapshots(n_tokens: int):
    cache = C.KVCache()
    cache.update_and_fetch(*kv_rows(0, n_tokens))
    return [cache.snapshot(0).eval()]


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["put", "get", "pin"]), st.integers(0, 9), st.integers(1, 40)), max_size=60),
    budget=st.integers(0, 40 * 2 * 2 * 32 * 4 * 3),
)
def test_hot_budget_holds_within_one_entry(ops, budget):
    hot = HotTier(budget)
    largest = 0
    for op, key, n in ops:
        k = bytes([key]) * 16
        if op == "put":
            snaps = kv_snapshots(n)
            largest = max(largest, snaps[0].nbytes)
            hot.put(k, snaps)
        elif op == "get":
            hot.get(k)
        else:
            was_there = k in hot
            with hot.pinned([k]):
                hot.put(bytes([key + 100]) * 16, kv_snapshots(n))
                assert (k in hot) == was_there  # a pinned entry is never evicted
        assert hot.nbytes == sum(e.nbytes for e in hot.entries.values())
        if not any(e.pins for e in hot.entries.values()):
            assert hot.nbytes <= budget + largest


def test_pinned_entries_survive_eviction():
    hot = HotTier(10**9)
    hot.put(b"a" * 16, kv_snapshots(4))
    hot.budget = 1
    with hot.pinned([b"a" * 16]):
        evicted = hot.put(b"b" * 16, kv_snapshots(4))
        assert b"a" * 16 in hot and [e.key for e in evicted] == [b"b" * 16]
    assert [e.key for e in hot.evict()] == [b"a" * 16]


def test_least_valuable_leaves_first():
    hot = HotTier(10**9)
    hot.put(b"cheap" + b"." * 11, kv_snapshots(8), prefill_seconds=0.001)
    hot.put(b"dear." + b"." * 11, kv_snapshots(8), prefill_seconds=1.0)
    hot.budget = hot.entries[b"dear." + b"." * 11].nbytes
    assert [e.key for e in hot.evict()] == [b"cheap" + b"." * 11]


def _fill(store, model, tokens, points):
    space = store.bind(model, model_id="m")
    hit = space.fetch(tokens)
    pos = hit.length
    for p in points:
        forward(model, hit.cache, tokens[pos:p])
        space.insert(tokens[:p], hit.cache)
        pos = p
    return space


def _files(path):
    return [p for p in (path / "cold" / "files").rglob("*.safetensors") if ".tmp-" not in p.name]


@pytest.mark.parametrize(
    "durability,on_disk_before_close", [("sync", True), ("write_through", True), ("write_back", False)]
)
def test_durability_settings(tmp_path, model_of, durability, on_disk_before_close):
    model = model_of("llama")
    store = PromptStore.open(tmp_path, durability=durability)
    _fill(store, model, prompt_tokens(60), [20, 40, 59])
    if durability == "write_through":
        store.flush()
    assert (len(_files(tmp_path)) == 3) == on_disk_before_close
    store.close()
    assert len(_files(tmp_path)) == 3  # after a clean close, everything is on disk


def test_store_files_are_private(tmp_path, model_of):
    root = tmp_path / "store"
    with PromptStore.open(root, durability="sync") as store:
        _fill(store, model_of("llama"), prompt_tokens(30), [29])
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in _files(root))


def test_disk_budget_evicts_leaves_entry_first(tmp_path, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(90)
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = _fill(store, model, tokens, [30, 60, 89])
        sizes = [n.record.nbytes for n in store.index.iter_nodes(space.namespace)]
        budget = sum(sizes) - 1  # one node must go
        removed, freed = store.evict_cold(budget)
        assert removed == 1 and store.cold_bytes() <= budget
        # The leaf went (its prefix still hits); the index and the files agree.
        assert space.fetch(tokens).length == 60
        assert len(_files(tmp_path)) == 2
        removed, _ = store.evict_cold(0)
        assert removed == 2 and _files(tmp_path) == []


def test_a_disk_that_refuses_writes_keeps_the_store_working(tmp_path, model_of, monkeypatch):
    model = model_of("llama")
    tokens = prompt_tokens(70)
    with PromptStore.open(tmp_path, durability="sync") as store:
        _fill(store, model, tokens, [30])
        before = sorted(p.read_bytes() for p in _files(tmp_path))

        def full(*args, **kwargs):
            raise DiskWriteError("No space left on device")

        monkeypatch.setattr(store.tiers.cold, "write", full)
        space = _fill(store, model, tokens, [50, 69])  # inserts still work, from memory
        # Refused, not missed: the store is degraded and says so once, not per node.
        assert store.counts["spills_refused"] >= 2 and not any(r.reason == "disk" for r in store.reports)
        disk = store.disk()
        assert disk.refusing and disk.reason == "No space left on device" and disk.unwritten_nodes >= 1
        hit = space.fetch(tokens)
        assert hit.length == 69
        want = forward(model, fresh_cache(model), tokens)
        got = forward(model, hit.cache, tokens[69:])
        assert mx.abs(want - got).max().item() < 1e-4
        monkeypatch.undo()
    # Nothing that was stored was damaged; the refused nodes were written at close.
    after = [p.read_bytes() for p in _files(tmp_path)]
    assert all(b in after for b in before) and len(after) == 3
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        assert store.bind(model, model_id="m").fetch(tokens).length == 69


@pytest.fixture
def small_disk(tmp_path):
    """A store whose cold tier sits on a 64 KiB tmpfs (skipped where mounting is not allowed)."""
    import subprocess

    root = tmp_path / "store"
    (root / "cold").mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(root / "cold")], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    yield root
    subprocess.run(["umount", "-l", str(root / "cold")], capture_output=True)


def test_a_full_disk_keeps_the_store_working(small_disk, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(200)
    with PromptStore.open(small_disk, durability="sync") as store:
        space = _fill(store, model, tokens, [20])
        first = [p.read_bytes() for p in _files(small_disk)]
        assert len(first) == 1
        space = _fill(store, model, tokens, [60, 120, 199])  # these no longer fit on disk
        assert store.counts["spills_refused"] >= 1 and store.disk().refused_writes >= 1
        assert not list(store.tiers.cold.iter_temp_files())  # no half-written file left
        hit = space.fetch(tokens)
        assert hit.length == 199
        want = forward(model, fresh_cache(model), tokens)
        got = forward(model, hit.cache, tokens[199:])
        assert mx.abs(want - got).max().item() < 1e-4
    # What was stored before the disk filled is intact.
    assert all(b in [p.read_bytes() for p in _files(small_disk)] for b in first)


def test_splitting_a_node_on_disk_leaves_no_orphan_file(tmp_path, model_of):
    model = model_of("llama")
    a = prompt_tokens(60, seed=50)
    b = mx.concatenate([a[:30], prompt_tokens(30, seed=51)])
    with PromptStore.open(tmp_path, durability="sync") as store:
        _fill(store, model, a, [60])
        _fill(store, model, b, [60])  # splits [0, 60) at 30
        space = store.bind(model, model_id="m")
        named = {n.record.file for n in store.index.iter_nodes(space.namespace)}
    on_disk = {str(p.relative_to(tmp_path / "cold")) for p in _files(tmp_path)}
    assert on_disk == named and len(named) == 3


def test_a_split_nodes_old_file_is_removed_off_the_inserting_thread(tmp_path, model_of):
    """Unlinking a large file the page cache holds takes a tenth of a second: the
    split node's old file goes once both halves have files of their own (under
    sync, within the insert), on the removing thread; the insert returns before
    it is removed, and flush and close wait for the removal."""
    import threading

    model = model_of("llama")
    a = prompt_tokens(60, seed=52)
    b = mx.concatenate([a[:30], prompt_tokens(30, seed=53)])
    with PromptStore.open(tmp_path, durability="sync") as store:
        _fill(store, model, a, [60])
        (old,) = _files(tmp_path)
        started, release, removers = threading.Event(), threading.Event(), []
        delete = store.tiers.cold.delete

        def slow_delete(rel):
            removers.append(threading.current_thread().name)
            started.set()
            assert release.wait(timeout=30)
            delete(rel)

        store.tiers.cold.delete = slow_delete
        _fill(store, model, b, [60])  # splits [0, 60) at 30: returns while the removal waits
        assert started.wait(timeout=30) and old.exists() and removers == ["promptstore-remove_0"]
        release.set()
        store.flush()
        assert not old.exists()
        space = store.bind(model, model_id="m")
        named = {n.record.file for n in store.index.iter_nodes(space.namespace)}
    assert {str(p.relative_to(tmp_path / "cold")) for p in _files(tmp_path)} == named and len(named) == 3


def test_a_path_of_cold_nodes_is_read_together_and_stops_at_a_bad_file(tmp_path, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(90)
    with PromptStore.open(tmp_path, durability="sync") as store:
        _fill(store, model, tokens, [30, 60, 89])
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        path = sorted(store.index.iter_nodes(space.namespace), key=lambda n: n.start)
        snaps, cold = store.tiers.read(path).snapshots()
        assert [n.key for n in cold] == [n.key for n in path] and len(snaps) == 3
        for node, got in zip(path, snaps):
            assert all(s.start == node.start and s.end == node.end for s in got)
        middle = tmp_path / "cold" / path[1].record.file
        raw = bytearray(middle.read_bytes())
        raw[-3] ^= 0x10
        middle.write_bytes(bytes(raw))
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        path = sorted(store.index.iter_nodes(space.namespace), key=lambda n: n.start)
        snaps, cold = store.tiers.read(path).snapshots()
        assert len(snaps) == 1 and [n.key for n in cold] == [path[0].key]
        assert [r.reason for r in store.reports] == ["checksum"]
        assert space.fetch(mx.concatenate([tokens, prompt_tokens(3, seed=9)])).length == 30


def test_disk_budget_evicts_the_least_valuable_leaf_first(tmp_path, model_of):
    model = model_of("llama")
    shared = prompt_tokens(20, seed=1)
    dear, cheap = (mx.concatenate([shared, prompt_tokens(20, seed=s)]) for s in (2, 3))
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        for tokens, seconds in ((dear, 10.0), (cheap, 0.001)):
            cache = fresh_cache(model)
            forward(model, cache, tokens)
            space.insert(tokens, cache, prefill_seconds=seconds)
        leaves = [n for n in store.index.iter_nodes(space.namespace) if store.index.is_leaf(n.key)]
        assert len(leaves) == 2
        total = store.cold_bytes()
        removed, freed = store.evict_cold(total - 1)
        assert removed == 1 and store.cold_bytes() <= total - 1
        assert space.fetch(mx.concatenate([dear, prompt_tokens(2)])).length == len(dear)
        assert space.fetch(mx.concatenate([cheap, prompt_tokens(2)])).length < len(cheap)


# Regression (was a defect): get_path looked each held node up twice, so every fetch
# counted two hot hits per node (hits weigh a node's value in eviction)
def test_a_fetch_counts_one_hot_hit_per_node(tmp_path, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(90)
    with PromptStore.open(tmp_path) as store:
        space = _fill(store, model, tokens, [30, 60, 89])
        keys = [n.key for n in store.index.iter_nodes(space.namespace)]
        before = {k: store.tiers.hot.entries[k].hits for k in keys}
        assert space.fetch(mx.concatenate([tokens, prompt_tokens(2, seed=7)])).length == 89
        assert {k: store.tiers.hot.entries[k].hits - before[k] for k in keys} == dict.fromkeys(keys, 1)


def test_each_group_keeps_its_own_budget_and_order():
    """Per tenant: a group is evicted against its own budget, by ages that count its own
    accesses only, so another group's puts and hits change nothing of it."""

    def group_a_after(b_activity: int) -> list[bytes]:
        hot = HotTier(3 * kv_snapshots(8)[0].nbytes)
        # Older but costlier against newer but cheap: the order between them depends on ages.
        hot.put(b"a-old" + b"." * 11, kv_snapshots(8), prefill_seconds=0.02, group="a")
        for i in range(b_activity):
            hot.put(bytes([i % 250]) * 16, kv_snapshots(8), group="b")
            hot.get(bytes([i % 250]) * 16)
        for i in range(3):
            hot.put(b"a-new" + bytes([i]) * 11, kv_snapshots(8), prefill_seconds=0.01, group="a")
        assert hot.used["a"] <= hot.budget and hot.used["b"] <= hot.budget
        return sorted(e.key for e in hot.entries.values() if e.group == "a")

    assert group_a_after(0) == group_a_after(600)
