"""Forced key collisions: lookups stay correct (only misses), inserts refuse cleanly."""

from __future__ import annotations

import random

import pytest

from promptstore.errors import KeyCollisionError
from promptstore.index import keys

from .conftest import full
from .reference import lcp


@pytest.fixture
def every_key_collides(monkeypatch):
    monkeypatch.setattr(keys, "digest", lambda hasher: b"\x42" * 16)


@pytest.fixture
def keys_collide_often(monkeypatch):
    real = keys.digest
    monkeypatch.setattr(keys, "digest", lambda hasher: real(hasher)[:1] * 16)  # 256 keys


def test_every_key_collides(index, spaces, every_key_collides):
    kv, hybrid = spaces[0], spaces[1]
    first = index.insert(kv, [1, 2, 3], full(kv))
    before = index.stats()
    plan = index.plan_insert(kv, [1, 2, 3, 4])
    assert plan.collision == first.key
    for ns, seq in ((kv, [1, 2, 3, 4]), (kv, [5]), (kv, [1, 9]), (hybrid, [1, 2, 3])):
        with pytest.raises(KeyCollisionError):
            index.insert(ns, seq, full(ns), split_records=(full(ns), full(ns)))
    assert index.stats() == before
    assert index.lookup(kv, [1, 2, 3, 4]).matched == 3
    assert index.lookup(kv, [5]).matched == 0
    assert index.lookup(hybrid, [1, 2, 3]).matched == 0


def test_frequent_collisions_never_serve_a_wrong_prefix(index, spaces, keys_collide_often):
    rng = random.Random(7)
    kv, other = spaces[0], spaces[2]
    accepted, refused = [], 0
    for _ in range(400):
        ns = kv if rng.random() < 0.8 else other
        seq = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 10)))
        try:
            index.insert(ns, seq, full(ns), split_records=(full(ns), full(ns)))
            if ns is kv:
                accepted.append(seq)
        except KeyCollisionError:
            refused += 1
    assert refused > 50 and len(accepted) > 20  # the test is exercising both outcomes
    for _ in range(300):
        query = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 12)))
        match = index.lookup(kv, query)
        assert match.matched == max((lcp(query, s) for s in accepted), default=0)
        assert all(node.namespace == kv.key for node in match.path)
        got = tuple(int(t) for node in match.path for t in node.tokens)
        assert got[: match.matched] == query[: match.matched]
        assert not match.corrupt
