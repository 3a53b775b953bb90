"""Damaged files and index records, seen through the store: every one is a miss
(or a shorter hit) plus a report, the bad file is quarantined, nothing raises out
of fetch, and whatever is served generates exactly what a full prefill does."""

from __future__ import annotations

import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import lmdb
import mlx.core as mx
import numpy as np
import pytest

from promptstore.index import records
from promptstore.snapshots.cold import TEMP_MARK
from promptstore.store import PromptStore

from ..conftest import _model, forward, fresh_cache, insert_following_checkpoints, prompt_tokens

TOKENS = prompt_tokens(80, seed=11)
SHALLOW, DEEP = 30, 60  # two nodes: [0, 30) and [30, 60)
TOL = 1e-4


@dataclass
class Stored:
    root: Path
    family: str
    nodes: dict  # end -> (key, rel)

    @property
    def model(self):
        return _model(self.family)

    def path(self, end: int) -> Path:
        return self.root / "cold" / self.nodes[end][1]

    def key(self, end: int) -> bytes:
        return self.nodes[end][0]


def insert_chain(space, model, ends=(SHALLOW, DEEP)):
    for n in ends:
        hit = space.fetch(TOKENS[: n + 1])
        if hit.length < n:
            forward(model, hit.cache, TOKENS[hit.length : n])
        space.insert(TOKENS[:n], hit.cache)


def build(root: Path, family: str = "llama", model_id: str = "m") -> Stored:
    model = _model(family)
    with PromptStore.open(root, durability="sync") as store:
        space = store.bind(model, model_id=model_id)
        insert_chain(space, model)
        nodes = {n.end: (n.key, n.record.file) for n in store.index.iter_nodes(space.namespace)}
    assert sorted(nodes) == [SHALLOW, DEEP] and all(rel for _, rel in nodes.values())
    return Stored(root, family, nodes)


@pytest.fixture
def stored(tmp_path):
    return build(tmp_path / "store")


def full_prefill(model):
    return forward(model, fresh_cache(model), TOKENS)


def fetch_and_check(stored: Stored, model_id: str = "m", report_once: bool = True):
    """Reopen (nothing hot), fetch twice; checks fidelity; returns (length, reports, counts)."""
    model = stored.model
    with PromptStore.open(stored.root, hot_bytes=0) as store:
        space = store.bind(model, model_id=model_id)
        hit = space.fetch(TOKENS)
        reports = list(store.reports)
        counts = dict(store.counts)
        got = forward(model, hit.cache, TOKENS[hit.length :])
        assert mx.abs(got - full_prefill(model)).max().item() < TOL
        again = space.fetch(TOKENS)  # the bad file is not tried again
        assert again.length == hit.length
        if report_once:
            assert len(store.reports) == len(reports)
    return hit.length, reports, counts


def quarantined(stored: Stored) -> list[str]:
    return sorted(p.name for p in (stored.root / "cold" / "quarantine").iterdir())


# --- how to damage a file -------------------------------------------------------------


def flip(path: Path, where, mask: int = 0x01) -> None:
    raw = path.read_bytes()
    i = where(raw)
    path.write_bytes(raw[:i] + bytes([raw[i] ^ mask]) + raw[i + 1 :])


def header_end(raw: bytes) -> int:
    return 8 + struct.unpack("<Q", raw[:8])[0]


def other_namespace_file(stored: Stored, end: int) -> Path:
    """The same tokens stored under another model id: same span, another namespace."""
    other = build(stored.root.parent / "other-store", stored.family, model_id="other")
    return other.path(end)


def _data_byte(s, end):
    flip(s.path(end), lambda raw: (header_end(raw) + len(raw)) // 2)


def _header_byte(s, end):
    flip(s.path(end), lambda raw: 8)


def _truncated(s, end):
    raw = s.path(end).read_bytes()
    s.path(end).write_bytes(raw[: len(raw) * 2 // 3])


def _other_node(s, end):
    other = DEEP if end == SHALLOW else SHALLOW
    shutil.copyfile(s.path(other), s.path(end))


def _other_namespace(s, end):
    shutil.copyfile(other_namespace_file(s, end), s.path(end))


def _missing(s, end):
    s.path(end).unlink()


def _temp_only(s, end):
    path = s.path(end)
    os.replace(path, path.with_name(f"{path.stem}{TEMP_MARK}999-0badf00d{path.suffix}"))


def _directory(s, end):
    s.path(end).unlink()
    s.path(end).mkdir()


DAMAGE = {
    "data byte": (_data_byte, {"checksum"}),
    "header byte": (_header_byte, {"header"}),
    "truncated": (_truncated, {"header"}),
    "other node's file": (_other_node, {"identity"}),
    "other namespace's file": (_other_namespace, {"identity"}),
    "missing": (_missing, {"missing"}),
    "temp name only": (_temp_only, {"missing"}),
    "directory in its place": (_directory, {"not a file"}),
}


def test_undamaged_store_hits_from_files(stored):
    model = stored.model
    with PromptStore.open(stored.root, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        hit = space.fetch(TOKENS)
        assert (hit.length, hit.cold_nodes) == (DEEP, 2)
        got = forward(model, hit.cache, TOKENS[DEEP:])
        assert mx.abs(got - full_prefill(model)).max().item() < TOL
        assert not store.reports


@pytest.mark.parametrize("how", sorted(DAMAGE))
@pytest.mark.parametrize("which", ["deep", "shallow"])
def test_damaged_file_is_a_reported_quarantined_miss(stored, how, which):
    end = DEEP if which == "deep" else SHALLOW
    damage, reasons = DAMAGE[how]
    damage(stored, end)
    length, reports, counts = fetch_and_check(stored)
    # A damaged deep node leaves the shallow hit; a damaged root leaves nothing.
    assert length == (SHALLOW if end == DEEP else 0)
    assert [r.reason for r in reports] == [reports[0].reason] and reports[0].reason in reasons, reports
    assert reports[0].key == stored.key(end).hex()
    assert counts.get(f"miss_{reports[0].reason}") == 1
    if reports[0].reason == "missing":
        assert quarantined(stored) == []  # nothing to move aside
    else:  # a directory in its place is moved aside too (issue 16)
        assert not stored.path(end).exists()
        assert [n.split(".safetensors.")[0] for n in quarantined(stored)] == [stored.path(end).stem]
    # A later store does not try the bad file again and still serves what is intact.
    length2, reports2, _ = fetch_and_check(stored)
    assert (length2, reports2) == (length, [])


# --- header flips that get past the file checks ---------------------------------------


def digit_flip(needle: bytes, offset: int, mask: int = 0x01):
    def damage(s: Stored, end: int):
        def where(raw):
            i = raw.index(needle, 0, header_end(raw)) + offset
            assert chr(raw[i]).isdigit() and chr(raw[i] ^ mask).isdigit()
            return i

        flip(s.path(end), where, mask)

    return damage


def letter_flip(needle: bytes, offset: int):
    def damage(s: Stored, end: int):
        flip(s.path(end), lambda raw: raw.index(needle, 0, header_end(raw)) + offset)

    return damage


ESCAPES = {
    # family, damage, what escaped before the snapshot record was checksummed
    "rotating keep 0->1": ("gemma3_text", digit_flip(b'keep\\":0', 7), "SnapshotKindError from restore"),
    "rotating max_size 16->17": ("gemma3_text", digit_flip(b'max_size\\":16', 12), "SnapshotKindError"),
    "chunk_size 16->14": ("llama4", digit_flip(b'chunk_size\\":16', 14, 0x02), "SnapshotKindError"),
    "dtype name float32->gloat32": ("llama", letter_flip(b'dtype\\":\\"float32', 10), "TypeError"),
    "snapshot end 60->61": ("llama", digit_flip(b'end\\":60,\\"whole', 7), "CacheShapeError"),
}


# Regression (was a defect): the snapshot metadata in a cold file is not covered by any checksum
# (cold.py NodeFileMeta.checksums covers arrays only), and cold.load / Space._restore let
# TypeError, CacheShapeError and SnapshotKindError out: fetch raises
@pytest.mark.parametrize("what", sorted(ESCAPES))
def test_flipped_snapshot_metadata_is_a_miss_not_an_exception(tmp_path, what):
    family, damage, _ = ESCAPES[what]
    stored = build(tmp_path / "store", family)
    damage(stored, DEEP)
    length, reports, _ = fetch_and_check(stored)
    assert length == SHALLOW and reports


# --- index records that point at the wrong path ----------------------------------------


def point_record_at(stored: Stored, end: int, rel: str) -> None:
    with PromptStore.open(stored.root, hot_bytes=0) as store:
        node = store.index.get(stored.key(end))
        store.index.update_record(node.key, node.record.model_copy(update={"file": rel}))


# Regression (was a defect): tiers._bad_file quarantines the path the record names, not the node's
# own file name: an identity miss on a record naming another node's (good) file moves that file
# away, and the other node misses from then on
def test_record_pointing_at_another_nodes_file(stored):
    point_record_at(stored, DEEP, stored.nodes[SHALLOW][1])
    length, reports, _ = fetch_and_check(stored)
    assert length == SHALLOW and [r.reason for r in reports] == ["identity"]


# Regression (was a defect): tiers._bad_file quarantines error.path whatever the reason: for a
# 'path' error (a record naming a file outside cold/files) cold.quarantine os.replace()s that
# outside file, here the LMDB data file, into quarantine/
@pytest.mark.parametrize("rel", ["../index/data.mdb", "../../victim.txt"])
def test_record_pointing_outside_the_tier_moves_nothing(stored, rel):
    victim = stored.root.parent / "victim.txt"
    victim.write_text("precious")
    data = stored.root / "index" / "data.mdb"
    before = data.stat().st_size
    point_record_at(stored, DEEP, rel)
    length, reports, _ = fetch_and_check(stored)
    assert length == SHALLOW and [r.reason for r in reports] == ["path"]
    assert victim.read_text() == "precious"
    assert data.exists() and data.stat().st_size >= before
    assert quarantined(stored) == []


# Regression (was a defect): a record naming a directory inside the tier: load reports
# 'unreadable' and cold.quarantine moves the whole directory (every node's files) into quarantine/
def test_record_pointing_at_a_directory_moves_nothing_else(stored):
    point_record_at(stored, DEEP, "files")
    length, reports, _ = fetch_and_check(stored)
    assert length == SHALLOW and reports
    assert stored.path(SHALLOW).exists()
    length2, _, _ = fetch_and_check(stored)  # the intact node still serves after a restart
    assert length2 == SHALLOW


# Regression (was a defect): cold.quarantine re-raises any OSError but EXDEV: a record naming
# 'quarantine' or '.' makes os.replace fail with EINVAL and the OSError escapes fetch
@pytest.mark.parametrize("rel", ["quarantine", "."])
def test_record_pointing_at_the_quarantine_does_not_raise(stored, rel):
    point_record_at(stored, DEEP, rel)
    length, reports, _ = fetch_and_check(stored)
    assert length == SHALLOW and reports


# --- after a miss ------------------------------------------------------------------------


# Regression (was a defect): after a bad file is quarantined the node keeps its 'present' layers
# and file=None, so plan_insert finds the tokens stored and Space._commit stores nothing: the
# prefix (and everything inserted below it) is a miss for ever
def test_reinserting_after_a_quarantine_serves_again(stored):
    _data_byte(stored, SHALLOW)
    model = stored.model
    with PromptStore.open(stored.root, durability="sync", hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        assert space.fetch(TOKENS).length == 0
        insert_chain(space, model)
    length, _, _ = fetch_and_check(stored)
    assert length == DEEP


# Regression (was a defect): space.split_for_edge gave a cache-list layer split where its
# recurrent child has no state the upper part None, dropping the KV child's range [start, at)
# too, so every chain through that node lacked those positions (falcon_h1 "shallow" failed).
# The upper part now keeps the range children, with None for the recurrent one.
HEAL_CASES = [
    (family, which) for family in ["llama", "gemma3_text", "qwen3_next", "falcon_h1"] for which in ["deep", "shallow"]
]


@pytest.mark.parametrize("family,which", HEAL_CASES)
def test_one_full_insert_heals_a_quarantined_node(tmp_path, family, which):
    """A prompt that runs through a quarantined node, prefilled in full and inserted
    once, makes the whole stored prefix serve again (for hybrid models, through the
    whole-state snapshot the deep node still holds)."""
    stored = build(tmp_path / "store", family)
    end = DEEP if which == "deep" else SHALLOW
    _data_byte(stored, end)
    model = stored.model
    with PromptStore.open(stored.root, durability="sync", hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        hit = space.fetch(TOKENS[: DEEP + 1])
        assert hit.length == (SHALLOW if end == DEEP else 0)
        forward(model, hit.cache, TOKENS[hit.length : DEEP])
        space.insert(TOKENS[:DEEP], hit.cache)
    length, reports, _ = fetch_and_check(stored)
    assert (length, reports) == (DEEP, [])


# --- forks (found while testing healing: the same split path) -------------------------------


FORK_CASES = ["llama", "gemma3_text", "qwen3_next", "falcon_h1"]


@pytest.mark.parametrize("family", FORK_CASES)
def test_fork_at_a_checkpoint_keeps_every_branch_servable(tmp_path, family):
    """A stores 60 tokens; B shares its first 30 and, following hit.checkpoints, inserts at
    30 then at 70. After a restart A hits 60, B (extended) hits 70, and a third prompt that
    diverges at 30 hits 30, each generating like a full prefill."""
    model = _model(family)
    a = TOKENS[:60]
    b = mx.concatenate([TOKENS[:SHALLOW], prompt_tokens(40, seed=99)])
    c = mx.concatenate([TOKENS[:SHALLOW], prompt_tokens(20, seed=5)])
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        for seq in (a, b):
            insert_following_checkpoints(space, model, seq)
    got = {}
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        for name, seq in (("a", TOKENS), ("b", mx.concatenate([b, TOKENS[:5]])), ("c", c)):
            hit = space.fetch(seq)
            got[name] = hit.length
            logits = forward(model, hit.cache, seq[hit.length :])
            assert mx.abs(logits - forward(model, fresh_cache(model), seq)).max().item() < TOL
    assert got == {"a": 60, "b": 70, "c": SHALLOW}


# --- damaged index records ----------------------------------------------------------------


def damage_db(stored: Stored, db: bytes, key: bytes, change) -> None:
    env = lmdb.open(str(stored.root / "index"), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            handle = env.open_db(db, txn=txn)
            value = txn.get(key, db=handle)
            assert value is not None
            if change is None:
                txn.delete(key, db=handle)
            else:
                txn.put(key, change(bytes(value)), db=handle)
    finally:
        env.close()


def _bit(value: bytes) -> bytes:
    i = len(value) // 2
    return value[:i] + bytes([value[i] ^ 0x01]) + value[i + 1 :]


def _revalidated_bad_json(edge_tokens):
    """A record that passes the index checksum but not the schema (a foreign writer)."""

    def change(value: bytes) -> bytes:
        n_layers = struct.unpack_from("<I", value, records._HEADER.size - 16)[0]
        body_at = records._HEADER.size + (n_layers + 7) // 8
        body = value[body_at:].replace(b'"tier":"cold"', b'"tier":"odd"').replace(b'"tier":"both"', b'"tier":"odd"')
        assert body != value[body_at:]
        head = value[8:body_at]
        head = head[: records._HEADER.size - 12] + struct.pack("<I", len(body)) + head[records._HEADER.size - 8 :]
        unsummed = head + body
        return struct.pack("<Q", records._checksum(unsummed, edge_tokens)) + unsummed

    return change


RECORD_DAMAGE = {
    "node bit": (b"nodes", _bit),
    "node truncated": (b"nodes", lambda v: v[:20]),
    "node garbage": (b"nodes", lambda v: b"\xde\xad\xbe\xef" * 9),
    "edge bit": (b"edges", _bit),
    "edge missing": (b"edges", None),
    "node missing": (b"nodes", None),
}


@pytest.mark.parametrize("how", sorted(RECORD_DAMAGE))
def test_damaged_index_record_is_a_logged_miss(stored, caplog, how):
    db, change = RECORD_DAMAGE[how]
    damage_db(stored, db, stored.key(DEEP), change)
    with caplog.at_level(logging.WARNING, "promptstore"):
        # The damaged record stays in the index (only a repair removes it): each fetch reports it.
        length, reports, _ = fetch_and_check(stored, report_once=False)
    assert length == SHALLOW
    assert [r.reason for r in reports] == ["record"]
    assert stored.key(DEEP).hex() in caplog.text


# Regression (was a defect): Space.fetch drops IndexMatch.corrupt: a damaged index record is only
# logged by promptstore.index, never added to store.reports / counts
def test_damaged_index_record_is_reported_by_the_store(stored):
    damage_db(stored, b"nodes", stored.key(DEEP), _bit)
    length, reports, counts = fetch_and_check(stored, report_once=False)
    assert length == SHALLOW
    assert [(r.reason, r.key) for r in reports] == [("record", stored.key(DEEP).hex())]
    assert counts.get("miss_record") == 1


def test_record_that_verifies_but_does_not_validate(stored):
    edge = np.array(TOKENS[SHALLOW:DEEP]).astype("<u4").tobytes()
    damage_db(stored, b"nodes", stored.key(DEEP), _revalidated_bad_json(edge))
    # The record stays in the index, so each fetch reports it again.
    length, reports, _ = fetch_and_check(stored, report_once=False)
    assert length == SHALLOW
    assert [r.reason for r in reports] == ["record"]
