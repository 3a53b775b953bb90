"""Trie operations one at a time: shared prefixes, splits, restorable positions,
stale plans, removal, access order and counters."""

from __future__ import annotations

import numpy as np
import pytest

from promptstore.errors import (
    NodeHasChildrenError,
    NodeNotFoundError,
    RecordLayoutError,
    StaleInsertError,
    UnknownNamespaceError,
)
from promptstore.index import Namespace, NodeRecord, prefix_key

from .conftest import SPECS, branch, full


def test_shared_prefix_is_stored_once(index, spaces):
    kv = spaces[0]
    index.insert(kv, range(100), full(kv))
    result = index.insert(kv, list(range(100)) + [7, 8], full(kv))
    assert result.stored == 2 and result.split is None
    match = index.lookup(kv, list(range(100)) + [7, 8, 9])
    assert [(n.start, n.end) for n in match.path] == [(0, 100), (100, 102)]
    assert index.counters(kv)["tokens_stored"] == 102


def test_split_keeps_the_lower_key_and_rekeys_nothing(index, spaces):
    kv = spaces[0]
    first = index.insert(kv, [1, 2, 3, 4, 5, 6], full(kv, 60))
    plan = index.plan_insert(kv, [1, 2, 3, 9])
    assert (plan.split.start, plan.split.at, plan.split.end) == (0, 3, 6)
    assert plan.span == (3, 4)
    result = index.commit_insert(plan, full(kv, 10), (full(kv, 30), full(kv, 30)))
    assert result.split == prefix_key(kv.key, [1, 2, 3])
    lower = index.get(first.key)
    assert (lower.start, lower.end, lower.parent) == (3, 6, result.split)
    assert lower.tokens.tolist() == [4, 5, 6]
    assert index.counters(kv)["nbytes"] == 70 and index.counters(kv)["nodes"] == 3


def test_sequence_ending_inside_an_edge_only_splits(index, spaces):
    kv = spaces[0]
    index.insert(kv, [1, 2, 3, 4], full(kv))
    plan = index.plan_insert(kv, [1, 2])
    assert plan.leaf_key is None and plan.span == (2, 2) and plan.split.at == 2
    result = index.commit_insert(plan, split_records=(full(kv), full(kv)))
    assert result.key == result.split == prefix_key(kv.key, [1, 2])
    assert index.plan_insert(kv, [1, 2]).changes_nothing


def test_state_layers_restore_only_at_checkpointed_ends(index, spaces):
    hybrid = spaces[3]
    index.insert(hybrid, [1, 2, 3, 4, 5, 6], full(hybrid))
    index.insert(hybrid, [1, 2, 3, 9], full(hybrid), split_records=(branch(hybrid), full(hybrid)))
    # The branch point at 3 has no recurrent state yet: diverging there restores nothing.
    match = index.lookup(hybrid, [1, 2, 3, 7])
    assert (match.matched, match.restorable, match.restorable_depth) == (3, 0, -1)
    assert match.checkpoints == (3,)
    # The full path is restorable at the end of the last node.
    match = index.lookup(hybrid, [1, 2, 3, 4, 5, 6, 7])
    assert (match.matched, match.restorable, match.restorable_depth) == (6, 6, 1)
    # Ending inside an edge: only the node ends count, and matched is a checkpoint hint.
    match = index.lookup(hybrid, [1, 2, 3, 4, 5])
    assert (match.matched, match.restorable, match.checkpoints) == (5, 0, (3, 5))
    # A checkpoint fills the state layer at 3.
    index.update_record(match.path[0].key, full(hybrid))
    assert index.lookup(hybrid, [1, 2, 3, 7]).restorable == 3


def test_window_layers_are_left_to_the_store(index, spaces):
    """The index cannot see which positions a window layer holds: it offers what the
    range layers reach, and a branch point inside a node as a checkpoint."""
    hybrid = spaces[1]
    index.insert(hybrid, [1, 2, 3, 4, 5, 6], full(hybrid))
    index.insert(hybrid, [1, 2, 3, 9], full(hybrid), split_records=(branch(hybrid), full(hybrid)))
    match = index.lookup(hybrid, [1, 2, 3, 7])
    assert (match.matched, match.restorable, match.restorable_depth) == (3, 3, 0)
    match = index.lookup(hybrid, [1, 2, 3, 4, 5])
    assert (match.matched, match.restorable, match.checkpoints) == (5, 5, (5,))


def test_range_layers_restore_inside_spans(index, spaces):
    kv = spaces[0]
    index.insert(kv, list(range(10)), full(kv))
    match = index.lookup(kv, [0, 1, 2, 3, 99])
    assert (match.matched, match.restorable, match.restorable_depth) == (4, 4, 0)
    index.update_record(match.path[0].key, NodeRecord.blank(kv, present=[True, False]))
    assert index.lookup(kv, [0, 1, 2, 3, 99]).restorable == 0


def test_stale_plan_is_refused_and_changes_nothing(index, spaces):
    kv = spaces[0]
    index.insert(kv, [1, 2, 3], full(kv))
    plan = index.plan_insert(kv, [1, 2, 3, 4, 5])
    index.insert(kv, [1, 2, 3, 4], full(kv))  # another writer gets there first
    before = index.counters(kv)
    with pytest.raises(StaleInsertError):
        index.commit_insert(plan, full(kv))
    assert index.counters(kv) == before
    # A change elsewhere in the trie does not make the plan stale.
    plan = index.plan_insert(kv, [1, 2, 3, 4, 5])
    index.insert(kv, [8, 8], full(kv))
    assert index.commit_insert(plan, full(kv)).stored == 1


def test_missing_or_mislaid_records_are_refused(index, spaces):
    kv, hybrid = spaces[0], spaces[1]
    with pytest.raises(RecordLayoutError):
        index.insert(kv, [1, 2], full(hybrid))
    index.insert(kv, [1, 2], full(kv))
    with pytest.raises(RecordLayoutError):
        index.insert(kv, [1, 3], full(kv))  # splits [1, 2] but no split_records
    with pytest.raises(RecordLayoutError):
        index.commit_insert(index.plan_insert(kv, [1, 2, 3]))
    assert index.counters(kv)["nodes"] == 1


def test_unregistered_namespace(index):
    ns = Namespace.of(SPECS[0].model_copy(update={"tenant": "00" * 16}))
    assert index.lookup(ns, [1]).matched == 0
    with pytest.raises(UnknownNamespaceError):
        index.insert(ns, [1], full(ns))
    with pytest.raises(UnknownNamespaceError):
        index.namespace(ns.key)


def test_remove_leaves_only(index, spaces):
    kv = spaces[0]
    a = index.insert(kv, [1, 2, 3], full(kv, 5))
    b = index.insert(kv, [1, 2, 3, 4], full(kv, 7))
    with pytest.raises(NodeHasChildrenError):
        index.remove(kv, a.key)
    with pytest.raises(NodeNotFoundError):
        index.remove(spaces[1], b.key)  # not in that namespace
    assert index.is_leaf(b.key) and not index.is_leaf(a.key)
    assert index.remove(kv, b.key).end == 4
    assert index.is_leaf(a.key)
    assert index.lookup(kv, [1, 2, 3, 4]).matched == 3
    counts = index.counters(kv)
    assert (counts["nodes"], counts["nbytes"], counts["tokens_stored"]) == (1, 5, 3)
    with pytest.raises(NodeNotFoundError):
        index.remove(kv, b.key)


def test_children_and_iteration(index, spaces):
    kv = spaces[0]
    for seq in ([1, 2], [1, 3], [4]):
        index.insert(kv, seq, full(kv), split_records=(full(kv), full(kv)))
    roots = index.children(kv.key)
    assert sorted(n.tokens.tolist() for n in roots) == [[1], [4]]
    assert sorted((n.start, n.end) for n in index.iter_nodes(kv)) == [
        (0, 1),
        (0, 1),
        (1, 2),
        (1, 2),
    ]
    assert list(index.iter_nodes(spaces[1])) == []


def test_access_order_is_oldest_first_and_touch_moves_to_the_end(index, spaces):
    kv, hybrid = spaces[0], spaces[1]
    a = index.insert(kv, [1], full(kv)).key
    b = index.insert(hybrid, [1], full(hybrid)).key
    c = index.insert(kv, [2], full(kv)).key
    assert [n.key for n in index.iter_by_access()] == [a, b, c]
    assert index.touch([a, b"\x00" * 16]) == 1  # unknown keys are skipped
    assert [n.key for n in index.iter_by_access()] == [b, c, a]
    assert [n.key for n in index.iter_by_access(kv)] == [c, a]


def test_iter_by_access_spans_batches(index, spaces):
    kv = spaces[0]
    items = [([i // 256, i % 256], full(kv)) for i in range(600)]
    index.insert_many(kv, items, split_records=lambda plan: (full(kv), full(kv)))
    nodes = list(index.iter_by_access(kv))
    assert len(nodes) == index.counters(kv)["nodes"] == 603
    assert len({n.key for n in nodes}) == 603


def test_counters_persist_and_reject_unknown_names(tmp_path):
    from promptstore.index import Index

    with Index.open(tmp_path / "index", sync=False) as ix:
        kv = ix.register_namespace(SPECS[0])
        ix.bump(kv, hits=2, misses=1, tokens_served=100)
        with pytest.raises(ValueError):
            ix.bump(kv, hitz=1)
    with Index.open(tmp_path / "index", sync=False) as ix:
        counts = ix.counters(ix.namespace(kv.hex))
        assert (counts["hits"], counts["misses"], counts["tokens_served"]) == (
            2,
            1,
            100,
        )
        assert ix.stats()["hits"] == 2


def test_numpy_and_list_tokens_agree(index, spaces):
    kv = spaces[0]
    seq = np.arange(1000, dtype=np.int64) * 7919 % 50000
    index.insert(kv, seq, full(kv))
    assert index.lookup(kv, seq.tolist()).matched == 1000
    assert index.lookup(kv, seq.astype(np.uint32)).matched == 1000
    assert index.lookup(kv, tuple(seq.tolist()[:10])).matched == 10


def test_records_are_decoded_on_demand(index, spaces):
    kv = spaces[0]
    record = full(kv, 123).model_copy(update={"tier": "cold", "file": "cold/ab.safetensors"})
    index.insert(kv, [5, 6], record)
    node = index.lookup(kv, [5, 6]).path[0]
    assert node.record == record and node.nbytes == 123


def test_insert_many_is_all_or_nothing(index, spaces):
    kv = spaces[0]
    items = [([1, 2, 3], full(kv)), ([4], full(kv)), ([1, 2, 9], full(kv))]
    # The third item splits [1, 2, 3] and no split_records were given.
    with pytest.raises(RecordLayoutError):
        index.insert_many(kv, items)
    assert index.counters(kv)["nodes"] == 0 and index.lookup(kv, [4]).matched == 0
    results = index.insert_many(kv, items, split_records=(full(kv), full(kv)))
    assert [r.stored for r in results] == [3, 1, 1]
    assert index.counters(kv)["nodes"] == 4
