"""Defects the corruption fuzz of tools/soak.py turned up, each replayed
deterministically. (Damaged snapshot files, node, edge and children records are
covered by tests/store/test_corruption.py and tests/index/test_bad_input.py; the
fuzz found nothing new there.)"""

from __future__ import annotations

import contextlib

import lmdb
import pytest

from promptstore import PromptStore
from promptstore.store.compact import compact

from ..conftest import _model, prompt_tokens
from ._util import TOL, continuation_error, prefill_insert


def damage_counters(root, value: bytes = b"xyz") -> int:
    """Replace every counter value of the store with `value` (not an 8-byte integer)."""
    env = lmdb.open(str(root / "index"), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"counters", txn=txn)
            keys = [bytes(k) for k, _ in txn.cursor(db=db)]
            for k in keys:
                txn.put(k, value, db=db)
    finally:
        env.close()
    return len(keys)


def test_a_damaged_counter_never_breaks_fetch_close_or_compact(tmp_path):
    model = _model("llama")
    tokens = prompt_tokens(30, seed=40)
    with PromptStore.open(tmp_path, durability="sync") as store:
        prefill_insert(store.bind(model, model_id="m"), model, tokens)
    assert damage_counters(tmp_path) > 0
    store = PromptStore.open(tmp_path, hot_bytes=0)
    space = store.bind(model, model_id="m")
    for _ in range(3):
        length, err = continuation_error(space, model, tokens)  # a hit
        assert length == len(tokens) - 1 and err < TOL
        assert space.fetch(prompt_tokens(30, seed=41)).length == 0  # a miss
    store.close()
    report = compact(tmp_path, max_bytes=1 << 30)
    assert report.status != "failed", report.errors
    with PromptStore.open(tmp_path) as store:
        assert store.index.counters(store.bind(model, model_id="m").namespace)["nodes"] == 1


def test_a_failing_close_still_releases_the_store(tmp_path):
    model = _model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store:
        prefill_insert(store.bind(model, model_id="m"), model, prompt_tokens(30, seed=40))
    damage_counters(tmp_path)  # the known way to make close() fail today (see the test above)
    store = PromptStore.open(tmp_path, hot_bytes=0)
    store.bind(model, model_id="m").fetch(prompt_tokens(30, seed=41))
    with contextlib.suppress(Exception):  # the point is what close() leaves behind when it fails
        store.close()
    with PromptStore.lock(tmp_path, exclusive=True, blocking=False) as idle:
        assert idle, "the closed store still holds the store's lock"


def damage_children(root, value: bytes) -> None:
    env = lmdb.open(str(root / "index"), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"children", txn=txn)
            for k, _ in list(txn.cursor(db=db)):
                txn.put(bytes(k), value, db=db)
    finally:
        env.close()


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"\x01\x02",
    ],
    ids=["empty", "two bytes"],
)
def test_a_damaged_children_entry_is_a_miss(tmp_path, value):
    model = _model("llama")
    tokens = prompt_tokens(30, seed=40)
    with PromptStore.open(tmp_path, durability="sync") as store:
        prefill_insert(store.bind(model, model_id="m"), model, tokens)
    damage_children(tmp_path, value)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        length, err = continuation_error(space, model, tokens)
        assert length == 0 and err < TOL
    assert compact(tmp_path, max_bytes=1 << 30).status != "failed"


def test_a_mislinked_children_entry_does_not_fail_every_compact(tmp_path):
    model = _model("llama")
    base = prompt_tokens(63, seed=70)
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        for n in (24, 40, 63):
            prefill_insert(space, model, base[:n])  # a chain [0, 24) -> [24, 40) -> [40, 63)
        nodes = {n.end: n for n in store.index.iter_nodes(space.namespace)}
    env = lmdb.open(str(tmp_path / "index"), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"children", txn=txn)
            entry = nodes[24].key + int(base[24].item()).to_bytes(4, "big")
            assert txn.get(entry, db=db) == nodes[40].key
            txn.put(entry, nodes[63].key, db=db)  # [0, 24)'s child entry now names [40, 63)
    finally:
        env.close()
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        length, err = continuation_error(store.bind(model, model_id="m"), model, base)
        assert length == 24 and err < TOL  # fetch already copes
    for run in range(2):  # not just once: every later run hit the same entry
        report = compact(tmp_path, max_bytes=1 << 30)
        assert report.status != "failed", (run, report.errors)
