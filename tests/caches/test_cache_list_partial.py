"""Cache-list snapshots whose recurrent child has no state at their end.

split_for_edge makes them (a hybrid layer cut where only the attention child
can split); they must keep that child's range, serialize, merge back bit-exact
and never restore on their own.
"""

from __future__ import annotations

import pytest

from promptstore import caches as C
from promptstore.caches.node import split_for_edge
from promptstore.caches.serialize import from_flat, to_flat
from promptstore.errors import SnapshotFormatError

from ..conftest import _model, forward, fresh_cache, prompt_tokens

AT = 9


@pytest.fixture(scope="module", params=["falcon_h1", "baichuan_m1"])
def layer(request):
    model = _model(request.param)
    cache = fresh_cache(model)
    forward(model, cache, prompt_tokens(20, seed=5))
    i = next(i for i, c in enumerate(cache) if c.kind == "cache_list" and "kv" in c.layout()["kinds"])
    return model, cache, i, C.snapshot_prompt_cache(cache, 0)[i].eval()  # recurrent offsets synced


def test_the_upper_part_keeps_the_range_children(layer):
    _, _, _, snap = layer
    upper, lower = split_for_edge(snap, AT)
    assert (upper.start, upper.end, lower.start, lower.end) == (0, AT, AT, 20)
    for kind, u, lo in zip(snap.scalars["kinds"], upper.children, lower.children):
        whole = C.kind_class(kind).whole_state
        assert (u is None) == whole and lo is not None
    assert not upper.complete and lower.complete


def test_merging_the_parts_gives_back_the_snapshot(layer):
    _, _, _, snap = layer
    upper, lower = split_for_edge(snap, AT)
    cls = C.kind_class("cache_list")
    assert C.arrays_equal(cls.merge_chain([upper, lower]), snap)
    assert C.arrays_equal(C.merge_snapshots(upper, lower), snap)


def test_serialized_and_back_bit_exact(layer):
    _, _, _, snap = layer
    upper, _ = split_for_edge(snap, AT)
    arrays, metadata = to_flat([upper, None])
    (back, none) = from_flat(arrays, metadata)
    assert none is None and C.arrays_equal(back, upper) and not back.complete


def test_a_missing_range_child_is_refused(layer):
    _, _, _, snap = layer
    kinds = snap.scalars["kinds"]
    gone = tuple(None if not C.kind_class(k).whole_state else c for k, c in zip(kinds, snap.children))
    broken = C.Snapshot(snap.kind, snap.start, snap.end, snap.whole, {}, dict(snap.scalars), gone)
    with pytest.raises(SnapshotFormatError):
        C.kind_class("cache_list").validate_snapshot(broken)


def test_restores_only_through_a_chain_ending_in_a_complete_one(layer):
    model, cache, i, snap = layer
    upper, lower = split_for_edge(snap, AT)
    target = fresh_cache(model)[i]
    before = target.signature()
    assert target.restore(upper, AT) is False  # no recurrent state at AT
    assert target.signature() == before and target.position == 0  # unchanged
    assert target.restore([upper, lower], 20) is True
    assert C.arrays_equal(target.snapshot(0), snap)
