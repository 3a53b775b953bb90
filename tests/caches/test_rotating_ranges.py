"""Property tests of the range form of the rotating (sliding-window) kind.

A chain of snapshots taken node by node while a cache was fed in random chunks
must rebuild, at any position, the window a cache fed directly (in other chunks)
holds there, and keep behaving like it; so must the same chain merged, split,
serialized, cut to its tail, or mixed with first-format (whole-window) snapshots.
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptstore import caches as C
from promptstore.caches.serialize import from_flat, to_flat
from promptstore.caches.window import window_tail

from .drivers import RotatingDriver, same

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
chunks = st.lists(st.integers(1, 9), min_size=1, max_size=7)
layouts = st.tuples(st.integers(3, 12), st.integers(0, 2)).filter(lambda mk: mk[1] < mk[0])


def nodes_of(driver, parts):
    """Snapshots of each part's span, taken right after it was fed (as inserts make nodes)."""
    cache, pos, chain = driver.new(), 0, []
    for n in parts:
        driver.update(cache, pos, pos + n)
        chain.append(cache.snapshot(pos).eval())
        pos += n
    return chain


def direct(driver, parts, target):
    cache, _ = driver.build(parts, target)
    return cache


def restored(driver, source, target):
    cache = driver.new()
    assert cache.restore(source, target), target
    return cache


def keeps_up(driver, a, b, more):
    """a and b hold the same window now and after the same further updates."""
    assert same(driver.logical(a), driver.logical(b))
    for n in more:
        pos = a.offset
        driver.update(a, pos, pos + n)
        driver.update(b, pos, pos + n)
        assert same(driver.logical(a), driver.logical(b)), n


@PROPS
@given(layout=layouts, parts=chunks, other=chunks, data=st.data())
def test_windows_rebuilt_from_a_chain_equal_a_direct_cache(layout, parts, other, data):
    driver = RotatingDriver(*layout)
    chain = nodes_of(driver, parts)
    end = sum(parts)
    target = data.draw(st.integers(0, end))
    more = data.draw(st.lists(st.integers(1, 5), max_size=3))
    # The direct cache is fed in other chunks: the window must not depend on how.
    scale = max(1, -(-end // max(sum(other), 1)))
    keeps_up(driver, restored(driver, chain, target), direct(driver, other * scale, target), more)


@PROPS
@given(layout=layouts, parts=chunks, data=st.data())
def test_merged_split_and_serialized_chains_restore_the_same(layout, parts, data):
    driver = RotatingDriver(*layout)
    chain = nodes_of(driver, parts)
    end = sum(parts)
    merged = C.kind_class("rotating").merge_chain(chain)
    at = data.draw(st.integers(0, end))
    upper, lower = C.split_snapshot(merged, at)
    assert C.arrays_equal(C.merge_snapshots(upper, lower), merged)
    arrays, meta = to_flat(chain)
    back = from_flat(arrays, meta)
    target = data.draw(st.integers(0, end))
    want = direct(driver, parts, target)
    for source in (merged, [s for s in (upper, lower) if s is not None], back):
        assert same(driver.logical(restored(driver, source, target)), driver.logical(want))


@PROPS
@given(layout=layouts, parts=chunks)
def test_a_tail_restores_the_end_and_holds_at_most_a_window(layout, parts):
    driver = RotatingDriver(*layout)
    merged = C.kind_class("rotating").merge_chain(nodes_of(driver, parts))
    tail = window_tail(merged)
    held = tail.arrays["keys"].shape[2] if tail.arrays else 0
    assert held <= min(merged.length, layout[0])
    end = merged.end
    assert same(driver.logical(restored(driver, tail, end)), driver.logical(direct(driver, parts, end)))


@PROPS
@given(layout=layouts, parts=st.lists(st.integers(1, 9), min_size=2, max_size=6), data=st.data())
def test_first_format_windows_restore_in_chains(layout, parts, data):
    """A store of the first format holds whole windows at node ends; they restore
    alone, and below new range snapshots."""
    driver = RotatingDriver(*layout)
    cache, pos, chain = driver.new(), 0, []
    cut = data.draw(st.integers(1, len(parts) - 1))
    for i, n in enumerate(parts):
        driver.update(cache, pos, pos + n)
        if i < cut:
            k, v = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
            old = C.Snapshot("rotating", pos, pos + n, True, {"keys": mx.array(k), "values": mx.array(v)})
            old.scalars.update(cache.layout())
            chain.append(old)
        else:
            chain.append(cache.snapshot(pos))
        pos += n
    first_end = sum(parts[:cut])
    assert same(
        driver.logical(restored(driver, chain[cut - 1], first_end)),
        driver.logical(direct(driver, parts, first_end)),
    )
    assert same(driver.logical(restored(driver, chain, pos)), driver.logical(direct(driver, parts, pos)))
    old = chain[cut - 1]
    if old.length > 1:  # a split converts to the range form, and restores the same
        upper, lower = C.split_snapshot(old, old.start + 1)
        assert not upper.whole and not lower.whole
        assert same(
            driver.logical(restored(driver, chain[: cut - 1] + [upper, lower], first_end)),
            driver.logical(direct(driver, parts, first_end)),
        )


def test_a_chain_missing_a_needed_position_restores_nothing():
    driver = RotatingDriver(max_size=6)
    chain = nodes_of(driver, [5, 5, 5])
    gap = [chain[0], C.Snapshot("rotating", 5, 10, False, {}, {**chain[1].scalars, "data_start": 10, "head": 0})]
    cache = driver.new()
    assert not cache.restore(gap + [chain[2]], 12)  # needs [6, 12): 6..9 are stored nowhere
    assert cache.keys is None and cache.offset == 0
    assert not cache.restore(gap + [chain[2]], 15)  # needs [9, 15): 9 is stored nowhere
    assert cache.keys is None and cache.restore(chain, 15)
