"""Property tests of the snapshot protocol, per kind, on random update sequences."""

from functools import reduce

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptstore import caches as C

from .drivers import (
    ArraysDriver,
    BatchKVDriver,
    BatchRotatingDriver,
    CacheListDriver,
    ChunkedDriver,
    KVDriver,
    QuantizedDriver,
    RotatingDriver,
    kv_rows,
    same,
)

DRIVERS = {
    "kv": KVDriver(),
    "quantized": QuantizedDriver(),
    "chunked": ChunkedDriver(),
    "rotating": RotatingDriver(max_size=12),
    "rotating_keep": RotatingDriver(max_size=10, keep=2),
    "arrays": ArraysDriver(),
    "cache_list_kv": CacheListDriver(KVDriver()),
    "cache_list_rotating": CacheListDriver(RotatingDriver(max_size=12)),
    "batch_kv": BatchKVDriver(),
    "batch_rotating": BatchRotatingDriver(max_size=12),
}

chunk_lists = st.lists(st.integers(1, 9), min_size=1, max_size=6)
PROPS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chain_of(driver, chunks):
    """Snapshots of each chunk's span, taken right after it was fed."""
    cache, pos, chain = driver.new(), 0, []
    for n in chunks:
        driver.update(cache, pos, pos + n)
        chain.append(cache.snapshot(pos).eval())
        pos += n
    return cache, chain


def reachable_expected(driver, full_cache, target, end):
    if target in (0, end):
        return True
    if isinstance(driver, (ArraysDriver, CacheListDriver)):
        return False  # recurrent state exists only where it was taken
    if driver.kind == "batch_rotating":
        # A window reaches earlier positions while it has dropped none.
        return driver.logical(full_cache)["k"].shape[2] == end
    return True


@pytest.mark.parametrize("name", sorted(DRIVERS))
@PROPS
@given(chunks=chunk_lists, data=st.data())
def test_split_then_merge_is_identity(name, chunks, data):
    driver = DRIVERS[name]
    _, chain = chain_of(driver, chunks)
    merged = reduce(C.merge_snapshots, chain)
    assert (merged.start, merged.end) == (0, sum(chunks))
    # The one-copy chain merge gives what the pairwise fold gives.
    assert C.arrays_equal(C.kind_class(merged.kind).merge_chain(chain), merged)
    at = data.draw(st.integers(0, sum(chunks) + 2))
    upper, lower = C.split_snapshot(merged, at)
    assert C.arrays_equal(C.merge_snapshots(upper, lower), merged)
    if upper is not None and lower is not None:
        assert (upper.end, lower.start) == (at, at)


@pytest.mark.parametrize("name", sorted(DRIVERS))
@PROPS
@given(chunks=chunk_lists)
def test_restore_to_every_target(name, chunks):
    driver = DRIVERS[name]
    full, chain = chain_of(driver, chunks)
    end = sum(chunks)
    merged = reduce(C.merge_snapshots, chain)
    for target in range(end + 1):
        expected = reachable_expected(driver, full, target, end)
        for source in (chain, merged):
            fresh = driver.new()
            before = driver.logical(fresh)
            ok = fresh.restore(source, target)
            assert ok == expected, (target, ok)
            if not ok:
                assert same(driver.logical(fresh), before)
                continue
            direct, _ = driver.build(chunks, target)
            assert same(driver.logical(fresh), driver.logical(direct)), target
            # The restored cache keeps working like the direct one.
            for n in (1, 3):
                pos = fresh.position
                driver.update(fresh, pos, pos + n)
                driver.update(direct, pos, pos + n)
                assert same(driver.logical(fresh), driver.logical(direct)), (target, n)


@pytest.mark.parametrize("name", ["kv", "quantized", "chunked", "batch_kv", "cache_list_kv"])
@PROPS
@given(chunks=st.lists(st.integers(1, 9), min_size=2, max_size=6))
def test_restore_chain_onto_a_prefix(name, chunks):
    """A range chain restores onto a cache that already holds its prefix."""
    driver = DRIVERS[name]
    _, chain = chain_of(driver, chunks)
    prefix, bounds = driver.build(chunks[:1])
    end = sum(chunks)
    if name == "cache_list_kv":
        # Its recurrent child holds only the state at the prefix's end.
        assert prefix.restore(chain[1:], end)
    else:
        assert prefix.restore(chain[1:], end - 1)
        end -= 1
    direct, _ = driver.build(chunks, end)
    assert same(driver.logical(prefix), driver.logical(direct))


@pytest.mark.parametrize("name", ["kv", "quantized", "chunked", "batch_kv"])
@PROPS
@given(chunks=chunk_lists, data=st.data())
def test_writes_into_a_restored_cache_never_reach_its_snapshots(name, chunks, data):
    """A restore from one snapshot hands its arrays over without a copy (from
    several, it joins them). Writes after a trim (in place) and past the end
    (growing) change the cache as they change a cache fed directly, and never
    the snapshots it was restored from."""
    driver = DRIVERS[name]
    end = sum(chunks)
    target = data.draw(st.integers(1, end))
    back = data.draw(st.integers(0, target))  # positions trimmed before writing
    n = data.draw(st.integers(1, 9))
    for merge in (True, False):
        _, chain = chain_of(driver, chunks)
        _, kept = chain_of(driver, chunks)  # an equal chain, built apart
        source = reduce(C.merge_snapshots, chain) if merge else chain
        cache = driver.new()
        assert cache.restore(source, target)
        direct, _ = driver.build(chunks, target)
        trimmed = cache.trim(back)
        assert trimmed == back or name == "chunked"  # a chunked cache holds only the last chunk's positions
        assert direct.trim(trimmed) == trimmed
        for c in (cache, direct):
            k, v = kv_rows(target - trimmed, target - trimmed + n, driver.batch)
            c.update_and_fetch(k * 0 + 7, v * 0 - 7)
        assert same(driver.logical(cache), driver.logical(direct)), (merge, target, back)
        if merge:
            assert C.arrays_equal(source, reduce(C.merge_snapshots, kept))
        else:
            assert all(C.arrays_equal(a, b) for a, b in zip(chain, kept))
        mx.eval([a for s in chain for a in s.arrays.values()])


@pytest.mark.parametrize("name", ["rotating", "arrays", "cache_list_rotating", "batch_rotating"])
@PROPS
@given(chunks=st.lists(st.integers(1, 9), min_size=3, max_size=6), data=st.data())
def test_unreachable_rewind_changes_nothing(name, chunks, data):
    driver = DRIVERS[name]
    full, _ = chain_of(driver, chunks)
    end = sum(chunks)
    target = data.draw(st.integers(0, end))
    before = driver.logical(full)
    ok = full.restore(None, target)
    if not ok:
        assert same(driver.logical(full), before)
    else:
        direct, _ = driver.build(chunks, target)
        assert same(driver.logical(full), driver.logical(direct))
