"""Bit flips in index/data.mdb itself, at the bytes a lookup reads (issue 16: the
probe's flips never touched what it read). Each flip lands in the LMDB leaf entry
of a record on the path of the probed prompt, every copy of it in the file (LMDB
leaves older copies on free pages): a node's header, its record, its edge tokens,
the children entry that leads to it, the namespace's spec. Each is a reported
miss from the damaged node on, or a typed error, never another exception and
never wrong state; and compact then leaves a store that serves exactly as well.
Each probe runs in a child process, so a signal would be a test failure."""

from __future__ import annotations

import lmdb
import pytest

from promptstore import PromptStore

from ..conftest import _model, child_failure, prompt_tokens, run_isolated
from ._util import prefill_insert

BASE = prompt_tokens(63, seed=70)
ENDS = (24, 40, 63)  # a chain [0, 24) -> [24, 40) -> [40, 63)

PROBE = """
import sys
import mlx.core as mx
from promptstore import PromptStore
from promptstore.errors import PromptStoreError
from promptstore.store.compact import compact
from tests.conftest import _model, forward, fresh_cache, prompt_tokens

model, base = _model("llama"), prompt_tokens(63, seed=70)
want = forward(model, fresh_cache(model), base)
for step in ("before", "after"):
    with PromptStore.open(sys.argv[1], hot_bytes=0) as store:
        try:
            hit = store.bind(model, model_id="m").fetch(base)
        except PromptStoreError as e:
            print(step, "typed", type(e).__name__)
        else:
            err = mx.abs(forward(model, hit.cache, base[hit.length:]) - want).max().item()
            reasons = sorted({r.reason for r in store.reports})
            print(step, "hit", hit.length, "ok" if err < 1e-4 else f"WRONG {err}", ",".join(reasons) or "-")
    if step == "before":
        report = compact(sys.argv[1], max_bytes=1 << 30, verify=True)
        print("compact", report.status)
"""


def build(root) -> dict:
    """The chain on disk; returns what a lookup of BASE reads, as (db, key, value) per name."""
    model = _model("llama")
    with PromptStore.open(root, durability="sync") as store:
        space = store.bind(model, model_id="m")
        for n in ENDS:
            prefill_insert(space, model, BASE[:n])
        nodes = {n.end: n for n in store.index.iter_nodes(space.namespace)}
        ns = space.namespace.key
    mid = nodes[40]
    entry = mid.parent + int(BASE[24].item()).to_bytes(4, "big")
    env = lmdb.open(str(root / "index"), max_dbs=16, readonly=True, lock=False)
    try:
        with env.begin() as txn:

            def get(db, key):
                return bytes(txn.get(key, db=env.open_db(db, txn=txn, create=False)))

            return {
                "node header": (mid.key, get(b"nodes", mid.key), 40),  # the span's end
                "node record": (mid.key, get(b"nodes", mid.key), -20),  # inside the record's JSON
                "edge tokens": (mid.key, get(b"edges", mid.key), 9),
                "children entry": (entry, get(b"children", entry), 3),
                "namespace spec": (ns, get(b"namespaces", ns), 30),
            }
    finally:
        env.close()


def flip_everywhere(path, key: bytes, value: bytes, at: int) -> int:
    """Flip one bit of `value` at offset `at` wherever key and value lie side by side
    (an LMDB leaf entry); returns how many copies were damaged."""
    raw = bytearray(path.read_bytes())
    needle, copies, start = key + value, 0, 0
    while (i := raw.find(needle, start)) >= 0:
        raw[i + len(key) + at % len(value)] ^= 0x04
        copies, start = copies + 1, i + 1
    path.write_bytes(bytes(raw))
    return copies


# Expected first line: the lookup stops at the damaged node, so the prefix before it is
# served. A spec must hash to its key: a damaged one is written again by the bind of
# the spec that does (it was a typed error at every bind, compact or not).
EXPECTED = {
    "node header": "before hit 24 ok record",
    "node record": "before hit 24 ok record",
    "edge tokens": "before hit 24 ok record",
    "children entry": "before hit 24 ok record",
    "namespace spec": "before hit 62 ok -",
}


AFTER_COMPACT = {
    "node header": "after hit 24 ok -",
    "node record": "after hit 24 ok -",
    "edge tokens": "after hit 24 ok -",
    "children entry": "after hit 62 ok -",
    "namespace spec": "after hit 62 ok -",
}


@pytest.mark.parametrize("what", list(EXPECTED))
def test_damage_a_lookup_reads_is_a_reported_miss_or_a_typed_error(tmp_path, what):
    root = tmp_path / "store"
    key, value, at = build(root)[what]
    assert flip_everywhere(root / "index" / "data.mdb", key, value, at) >= 1
    result = run_isolated(PROBE, str(root))
    assert child_failure(result) == ""
    lines = result.stdout.splitlines()
    assert lines[0] == EXPECTED[what], result.stdout
    assert lines[1] in ("compact repaired", "compact clean"), result.stdout
    # After compact: a damaged node is gone with what hung below it; a children entry
    # is rebuilt from the node it should lead to; what remains is served exactly.
    assert lines[2] == AFTER_COMPACT[what], result.stdout
