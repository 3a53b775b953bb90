"""tools/compact: each kind of damage is repaired, after which every hit is
verified and fidelity holds; a second run changes nothing."""

import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.store.compact import compact

from ..conftest import forward, fresh_cache, prompt_tokens


def build(path, model, sequences, points=(24, 48), **settings):
    settings.setdefault("durability", "sync")
    with PromptStore.open(path, **settings) as store:
        space = store.bind(model, model_id="m")
        for tokens in sequences:
            hit = space.fetch(tokens)
            pos = hit.length
            for p in [p for p in points if p > pos] + [len(tokens)]:
                forward(model, hit.cache, tokens[pos:p])
                space.insert(tokens[:p], hit.cache)
                pos = p


def files(path):
    return sorted(p for p in (Path(path) / "cold" / "files").rglob("*.safetensors") if ".tmp-" not in p.name)


def assert_serves(path, model, sequences):
    """Every hit is verified and continues exactly like a full prefill."""
    with PromptStore.open(path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        for tokens in sequences:
            hit = space.fetch(tokens)
            want = forward(model, fresh_cache(model), tokens)
            got = forward(model, hit.cache, tokens[hit.length :])
            assert mx.abs(want - got).max().item() < 1e-4
        assert not store.reports, list(store.reports)


@pytest.fixture
def seqs():
    base = prompt_tokens(48, seed=30)
    return [mx.concatenate([base, prompt_tokens(20, seed=31 + i)]) for i in range(3)]


def test_a_healthy_store_is_clean_and_stays_so(tmp_path, model_of, seqs):
    model = model_of("llama")
    build(tmp_path, model, seqs)
    first = compact(tmp_path, max_bytes=10**9)
    assert first.status == "clean", first.log  # merging and compacting are routine upkeep
    second = compact(tmp_path, max_bytes=10**9)
    assert second.status == "clean", second.actions
    assert_serves(tmp_path, model, seqs)


def test_crash_leftovers_are_reclaimed(tmp_path, model_of, seqs):
    model = model_of("llama")
    build(tmp_path, model, seqs)
    victims = files(tmp_path)
    # A temp file of a dead writer, an orphan file, and an entry whose file is gone.
    dead_pid = 2**22 + 12345
    temp = victims[0].with_name(victims[0].stem + f".tmp-{dead_pid}-abcd.safetensors")
    temp.write_bytes(b"partial")
    orphan = victims[0].with_name("ff" * 16 + "-0-5.safetensors")
    orphan.write_bytes(victims[0].read_bytes())
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    victims[-1].unlink()
    report = compact(tmp_path, max_bytes=10**9)
    assert report.status == "repaired"  # the entry without data; the files are routine leftovers
    damage = {a.reason for a in report.log if a.damage}
    assert "missing files" in damage and damage <= {"missing files", "nodes without data"}, report.log
    assert report.actions["temporary files"]["files"] == 1
    assert report.actions["orphan files"]["files"] == 1
    assert report.actions["missing files"]["nodes"] == 1
    assert not temp.exists() and not orphan.exists()
    assert compact(tmp_path, max_bytes=10**9).status == "clean"
    assert_serves(tmp_path, model, seqs)


def test_verify_quarantines_corrupt_files(tmp_path, model_of, seqs):
    model = model_of("llama")
    build(tmp_path, model, seqs)
    bad = files(tmp_path)[1]
    data = bytearray(bad.read_bytes())
    data[-5] ^= 0xFF
    bad.write_bytes(bytes(data))
    dry = compact(tmp_path, verify=True, dry_run=True, max_bytes=10**9)
    assert dry.status == "repaired" and bad.exists()  # a dry run changes nothing
    report = compact(tmp_path, verify=True, max_bytes=10**9)
    assert any(k.startswith("failed verify") for k in report.actions)
    assert not bad.exists() and list((tmp_path / "cold" / "quarantine").iterdir())
    assert compact(tmp_path, verify=True, max_bytes=10**9).status == "clean"
    assert_serves(tmp_path, model, seqs)


def test_over_budget_store_is_evicted_leaves_first(tmp_path, model_of, seqs):
    model = model_of("llama")
    build(tmp_path, model, seqs)
    total = sum(p.stat().st_size for p in files(tmp_path))
    report = compact(tmp_path, max_bytes=total // 2)
    assert report.actions["over budget"]["nodes"] >= 1
    assert report.status == "clean"  # evicting is upkeep, not a repair
    with PromptStore.open(tmp_path) as store:
        assert store.cold_bytes() <= total // 2
    assert compact(tmp_path, max_bytes=total // 2).status == "clean"
    assert_serves(tmp_path, model, seqs)


def test_compact_runs_while_another_process_uses_the_store(tmp_path, model_of, seqs):
    model = model_of("llama")
    build(tmp_path, model, seqs)
    worker = Path(__file__).with_name("_two_process_worker.py")
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(tmp_path), "5", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    reports = []
    while proc.poll() is None:
        reports.append(compact(tmp_path, max_bytes=10**9))
    out, err = proc.communicate()
    assert proc.returncode == 0 and "bad=0" in out, err[-2000:]
    assert reports and all(r.status != "failed" for r in reports)
    # While in use, compact left the LMDB copy and in-memory nodes alone.
    assert any("in use" in s for r in reports for s in r.skipped)
    assert_serves(tmp_path, model, seqs)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "falcon_h1"])
def test_chains_merge_into_one_node(tmp_path, model_of, family):
    """A conversation inserted turn by turn becomes one node; fetch reads one file."""
    model = model_of(family)
    tokens = prompt_tokens(90, seed=40)
    build(tmp_path, model, [tokens], points=(15, 30, 45, 60, 75))
    other = mx.concatenate([tokens[:30], prompt_tokens(20, seed=41)])
    build(tmp_path, model, [other], points=())  # a branch point at 30 that must stay
    with PromptStore.open(tmp_path) as store:
        before = sum(1 for ns in store.index.namespaces() for _ in store.index.iter_nodes(ns))
    report = compact(tmp_path, max_bytes=10**9)
    assert report.actions["merged chains"]["nodes"] >= 3 and report.status == "clean"
    assert compact(tmp_path, max_bytes=10**9).status == "clean"  # twice in a row: nothing more
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        nodes = list(store.index.iter_nodes(space.namespace))
        assert len(nodes) < before
        assert any(n.end == 30 for n in nodes)  # the branch point was not merged away
        # The next turn extends the conversation: it restores all of it from two files.
        hit = space.fetch(mx.concatenate([tokens, prompt_tokens(5, seed=42)]))
        assert hit.length == len(tokens) and hit.nodes == 2
    assert_serves(tmp_path, model, [tokens, other])


def test_a_corrupt_index_record_is_dropped_with_its_subtree(tmp_path, model_of, seqs):
    """A damaged record blocks inserts through it; compact removes it and what
    hangs below, after which the prefix can be stored and served again."""
    import lmdb

    model = model_of("llama")
    build(tmp_path, model, seqs)
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="m")
        victim = next(n for n in store.index.iter_nodes(space.namespace) if n.end == 24)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=16)
    nodes = env.open_db(b"nodes")
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(victim.key, db=nodes))
        raw[-3] ^= 0xFF
        txn.put(victim.key, bytes(raw), db=nodes)
    env.close()
    report = compact(tmp_path, max_bytes=10**9)
    assert report.actions["corrupt index records"]["nodes"] >= 2  # the node and its subtree
    assert compact(tmp_path, max_bytes=10**9).status == "clean"
    build(tmp_path, model, seqs)  # stores the lost nodes again
    assert_serves(tmp_path, model, seqs)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        assert store.bind(model, model_id="m").fetch(seqs[0]).length == len(seqs[0]) - 1
