"""Bad input: a typed error from promptstore.errors, and the cache unchanged."""

import json

import mlx.core as mx
import pytest

from promptstore import caches as C
from promptstore.errors import (
    CacheShapeError,
    PromptStoreError,
    SnapshotFormatError,
    SnapshotKindError,
    SnapshotRangeError,
    UnknownKindError,
    UnsupportedCacheError,
)

from .drivers import kv_rows


def kv_cache(n=10, heads=2, dim=32):
    cache = C.KVCache()
    k = mx.random.normal((1, heads, n, dim))
    cache.update_and_fetch(k, -k)
    return cache


def state(cache):
    return cache.offset, None if cache.keys is None else mx.array(cache.keys)


def unchanged(cache, before):
    offset, keys = state(cache)
    return (
        offset == before[0]
        and (keys is None) == (before[1] is None)
        and (keys is None or (keys.shape == before[1].shape and mx.array_equal(keys, before[1]).item()))
    )


def snap(**changes):
    base = kv_cache(6).snapshot(0)
    fields = dict(
        kind=base.kind,
        start=base.start,
        end=base.end,
        whole=base.whole,
        arrays=dict(base.arrays),
        scalars=dict(base.scalars),
    )
    fields.update(changes)
    return C.Snapshot(**fields)


BAD_RESTORES = {
    "wrong rank": (snap(arrays={"keys": mx.zeros((2, 6, 32)), "values": mx.zeros((2, 6, 32))}), 6, CacheShapeError),
    "wrong head count": (
        snap(arrays={"keys": mx.zeros((1, 3, 6, 32)), "values": mx.zeros((1, 3, 6, 32))}),
        6,
        CacheShapeError,
    ),
    "mismatched keys/values": (
        snap(arrays={"keys": mx.zeros((1, 2, 6, 32)), "values": mx.zeros((1, 2, 5, 32))}),
        6,
        CacheShapeError,
    ),
    "keys/values dtypes differ": (
        snap(arrays={"keys": mx.zeros((1, 2, 6, 32)), "values": mx.zeros((1, 2, 6, 32), dtype=mx.float16)}),
        6,
        CacheShapeError,
    ),
    "missing values": (snap(arrays={"keys": mx.zeros((1, 2, 6, 32))}), 6, SnapshotFormatError),
    "negative target": (snap(), -1, SnapshotRangeError),
    "target past the end": (snap(), 7, SnapshotRangeError),
    "target not an int": (snap(), 2.5, SnapshotRangeError),
    "another kind": (C.RotatingKVCache(8).snapshot(0), 0, SnapshotKindError),
    "not a snapshot": ("keys", 3, SnapshotKindError),
    "reversed span": (snap(start=6, end=0), 0, SnapshotRangeError),
}


@pytest.mark.parametrize("case", sorted(BAD_RESTORES))
def test_bad_restore_raises_and_changes_nothing(case):
    bad, target, error = BAD_RESTORES[case]
    cache = kv_cache(10)
    before = state(cache)
    with pytest.raises(error):
        cache.restore(bad, target)
    assert unchanged(cache, before)


def test_restore_from_another_layout_raises():
    rot = C.RotatingKVCache(max_size=8, keep=0)
    rot.update_and_fetch(*kv_rows(0, 5))
    other = C.RotatingKVCache(max_size=16, keep=0)
    with pytest.raises(SnapshotKindError):
        other.restore(rot.snapshot(0), 5)
    q = C.QuantizedKVCache(group_size=32, bits=8)
    q.update_and_fetch(*kv_rows(0, 4))
    with pytest.raises(SnapshotKindError):
        C.QuantizedKVCache(group_size=32, bits=4).restore(q.snapshot(0), 4)


def test_a_model_restore_fails_whole_when_one_layer_cannot():
    caches = [kv_cache(10), C.ArraysCache(2)]
    caches[1][0] = mx.zeros((1, 4))
    caches[1].advance(10)
    snaps = C.snapshot_prompt_cache(caches, 0)
    fresh = [C.KVCache(), C.ArraysCache(2)]
    assert not C.restore_prompt_cache(fresh, snaps, 5)  # the recurrence exists only at 10
    assert fresh[0].keys is None and fresh[1].cache == [None, None]
    with pytest.raises(CacheShapeError):
        C.restore_prompt_cache(fresh, snaps[:1], 10)  # wrong layer count
    assert C.restore_prompt_cache(fresh, snaps, 10)


def test_bad_snapshot_and_split_offsets():
    cache = kv_cache(10)
    with pytest.raises(SnapshotRangeError):
        cache.snapshot(11)
    with pytest.raises(SnapshotRangeError):
        cache.snapshot(-2)
    with pytest.raises(SnapshotRangeError):
        C.split_snapshot(cache.snapshot(0), -1)
    with pytest.raises(SnapshotRangeError):
        C.merge_snapshots(cache.snapshot(0), cache.snapshot(3))  # not consecutive


def _flat():
    return C.to_flat([kv_cache(4).snapshot(0), C.RotatingKVCache(8).snapshot(0)])


def _meta_with(edit):
    arrays, meta = _flat()
    record = json.loads(meta["promptstore.snapshots"])
    edit(record)
    return arrays, {"promptstore.snapshots": json.dumps(record)}


BAD_FILES = {
    "no metadata": lambda: (_flat()[0], {}),
    "not json": lambda: (_flat()[0], {"promptstore.snapshots": "{nope"}),
    "newer format": lambda: _meta_with(lambda r: r.update(format_version=99)),
    "unknown kind": lambda: _meta_with(lambda r: r["layers"][0].update(kind="os.system")),
    "extra field": lambda: _meta_with(lambda r: r["layers"][0].update(code="print(1)")),
    "shape lies": lambda: _meta_with(lambda r: r["layers"][0]["arrays"][0].update(shape=[1, 2, 5, 32])),
    "dtype lies": lambda: _meta_with(lambda r: r["layers"][0]["arrays"][0].update(dtype="int8")),
    "path-like name": lambda: _meta_with(lambda r: r["layers"][0]["arrays"][0].update(name="../../etc")),
    "missing array": lambda: (dict(list(_flat()[0].items())[1:]), _flat()[1]),
    "extra array": lambda: ({**_flat()[0], "L9/keys": mx.zeros(3)}, _flat()[1]),
    "negative span": lambda: _meta_with(lambda r: r["layers"][0].update(start=-3)),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_malformed_serialized_snapshots_are_refused(case):
    arrays, meta = BAD_FILES[case]()
    with pytest.raises(SnapshotFormatError):
        C.from_flat(arrays, meta)


def test_unknown_kind_is_a_typed_error():
    with pytest.raises(UnknownKindError):
        C.kind_class("KVCache; import os")
    with pytest.raises(UnsupportedCacheError):
        C.adopt(object())
    assert issubclass(UnknownKindError, PromptStoreError)
