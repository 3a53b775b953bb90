"""Several processes on one store, each a random mix of fetch / insert / compact /
reopen (tests/reliability/_mixed_worker.py): the goal is 0 errors and 0 unverified
hits (a hit whose continuation differs from a full prefill by 1e-4 or more).

Below the load tests, one deterministic test per defect those runs turned up:
each replays the interleaving that breaks, in one process, with a second store
object on the same path standing in for the other process (it shares the LMDB
environment, as two processes share the file, and has tiers of its own).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.identity import NodeId
from promptstore.index import NodeRecord
from promptstore.snapshots.cold import TEMP_MARK
from promptstore.store.compact import compact

from ..conftest import _model, forward, fresh_cache, prompt_tokens
from ._mixed_worker import MODEL_ID, sequences
from ._util import TOL, continuation_error, prefill_insert

WORKER = Path(__file__).with_name("_mixed_worker.py")
DURABILITIES = ["write_through", "sync", "write_back", "write_through"]


def run_workers(root: Path, ops: int, procs: int = 4, seed: int = 1, timeout: float = 600, extra=()) -> dict:
    """Run `procs` workers at once; returns totals plus each worker's result."""
    started = time.monotonic()
    running = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(root),
                str(seed * 100 + i),
                str(ops),
                "--durability",
                DURABILITIES[i % len(DURABILITIES)],
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(procs)
    ]
    results = []
    for p in running:
        out, err = p.communicate(timeout=timeout)
        line = next((x for x in out.splitlines() if x.startswith("result ")), None)
        if line is None:
            results.append(
                {
                    "errors": [f"worker exited {p.returncode} without a result: {err[-1500:]}"],
                    "unverified": [],
                    "reports": {},
                }
            )
        else:
            results.append(json.loads(line[len("result ") :]))
    totals: Counter = Counter()
    for r in results:
        for k, v in r.items():
            if isinstance(v, (int, float)):
                totals[k] += v
        totals["errors"] += len(r["errors"])
        totals["unverified"] += len(r["unverified"])
    totals["seconds"] = round(totals.get("seconds", 0), 1)
    return {"totals": dict(totals), "workers": results, "seconds": round(time.monotonic() - started, 1)}


def check_store(root: Path) -> dict:
    """After the workers: every stored prefix serves verified state; compact finds nothing broken."""
    model = _model("llama")
    seqs = [mx.array(s, dtype=mx.uint32) for s in sequences()]
    out: Counter = Counter()
    with PromptStore.open(root, hot_bytes=0) as store:
        space = store.bind(model, model_id=MODEL_ID)
        for tokens in seqs:
            for n in (tokens.size, tokens.size // 2, 30):
                length, err = continuation_error(space, model, tokens[:n])
                out["fetches"] += 1
                out["hits"] += length > 0
                out["unverified"] += length > 0 and not err < TOL
    report = compact(root, verify=True, max_bytes=1 << 30)
    out["compact_failed"] = int(report.status == "failed")
    out["failed_verify"] = sum(v["nodes"] for k, v in report.actions.items() if k.startswith("failed verify"))
    out["quarantined"] = len(list((root / "cold" / "quarantine").iterdir()))
    return dict(out)


def summary(run: dict, final: dict) -> str:
    problems = [e for w in run["workers"] for e in w["errors"]][:5] + [
        u for w in run["workers"] for u in w["unverified"]
    ][:5]
    return f"{run['totals']} final={final} in {run['seconds']} s; first problems: {problems}"


def test_four_processes_mixed_operations(tmp_path, capsys):
    run = run_workers(tmp_path, ops=50)
    final = check_store(tmp_path)
    with capsys.disabled():
        print(f"\n[concurrency 4x50] {summary(run, final)}")
    assert run["totals"]["ops"] == 4 * 50
    assert run["totals"]["errors"] == 0 and run["totals"]["unverified"] == 0, summary(run, final)
    assert final["unverified"] == 0 and final["compact_failed"] == 0 and final["quarantined"] == 0, final


@pytest.mark.slow
def test_four_processes_mixed_operations_long(tmp_path, capsys):
    run = run_workers(tmp_path, ops=400, seed=2, timeout=1800)
    final = check_store(tmp_path)
    with capsys.disabled():
        print(f"\n[concurrency 4x400] {summary(run, final)}")
    assert run["totals"]["errors"] == 0 and run["totals"]["unverified"] == 0, summary(run, final)
    assert final["unverified"] == 0 and final["compact_failed"] == 0 and final["quarantined"] == 0, final


# --- the defects, one interleaving each --------------------------------------------------------

BASE = prompt_tokens(63, seed=70)


def test_heal_never_stores_another_prompts_state(tmp_path):
    model = _model("llama")
    other_prompt = mx.concatenate([BASE[:24], prompt_tokens(45, seed=71)])  # shares 24 tokens, longer than BASE
    query = mx.concatenate([BASE, prompt_tokens(4, seed=72)])
    # "Another process" stored BASE and holds it in memory only (write_back, large budget).
    with PromptStore.open(tmp_path, durability="write_back", hot_bytes=1 << 30) as other:
        prefill_insert(other.bind(model, model_id="m"), model, BASE)
        with PromptStore.open(tmp_path, durability="sync") as store:
            space = store.bind(model, model_id="m")
            prefill_insert(space, model, other_prompt)  # diverges inside BASE's node
            length, err = continuation_error(space, model, query)
            assert err < TOL, f"served {length} tokens of another prompt's state: |diff| {err:.3f}"
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        length, err = continuation_error(store.bind(model, model_id="m"), model, query)
        assert err < TOL, f"after a restart: {length} tokens, |diff| {err:.3f}"


def test_a_split_by_another_process_right_after_ours(tmp_path):
    model = _model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store, PromptStore.open(tmp_path, durability="sync") as other:
        space, theirs = store.bind(model, model_id="m"), other.bind(model, model_id="m")
        prefill_insert(space, model, BASE[:57])
        real = store.index.commit_insert
        raced = []

        def commit_then_the_other_process_splits(plan, *args, **kwargs):
            result = real(plan, *args, **kwargs)
            if not raced:
                raced.append(True)
                blank = NodeRecord.blank(theirs.namespace)  # its data follows its commit
                other.index.insert(theirs.namespace, BASE[:56], blank, (blank, blank))
            return result

        store.index.commit_insert = commit_then_the_other_process_splits
        prefill_insert(space, model, mx.concatenate([BASE[:40], prompt_tokens(10, seed=81)]))  # splits at 40
        store.index.commit_insert = real
        assert raced
        for node in store.index.iter_nodes(space.namespace):
            snaps = store.tiers.get(node)
            assert snaps is None or {(s.start, s.end) for s in snaps} == {(node.start, node.end)}, node
        prefill_insert(space, model, BASE[:60])
        _, err = continuation_error(space, model, BASE[:62])
        assert err < TOL


def _a_store_with_files(root, model):
    with PromptStore.open(root, durability="sync") as store:
        space = store.bind(model, model_id="m")
        for n in (24, 48, 63):
            prefill_insert(space, model, BASE[:n])


def test_compact_copes_with_files_vanishing_under_it(tmp_path, monkeypatch):
    model = _model("llama")
    _a_store_with_files(tmp_path, model)
    victim = min((tmp_path / "cold" / "files").rglob("*.safetensors"))
    real_rglob = pathlib.Path.rglob

    def listing_then_another_process_deletes(self, pattern):
        for path in real_rglob(self, pattern):
            if path == victim and path.exists():
                path.unlink()  # listed, then gone before compact looks at it
            yield path

    monkeypatch.setattr(pathlib.Path, "rglob", listing_then_another_process_deletes)
    report = compact(tmp_path, verify=True, max_bytes=1 << 30)
    monkeypatch.undo()
    assert report.status != "failed", report.errors
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        _, err = continuation_error(store.bind(model, model_id="m"), model, BASE)
        assert err < TOL


def test_compact_leaves_this_processs_inflight_spill_alone(tmp_path, monkeypatch):
    from promptstore.snapshots import cold

    model = _model("llama")
    real_write = cold.write_safetensors
    writing, go_on = threading.Event(), threading.Event()

    def slow_write(fd, named, metadata, **options):
        written = real_write(fd, named, metadata, **options)
        if not go_on.is_set():
            writing.set()  # the temp file is written; fsync and rename are next
            go_on.wait(30)
        return written

    monkeypatch.setattr(cold, "write_safetensors", slow_write)
    with PromptStore.open(tmp_path, durability="write_through") as store:
        space = store.bind(model, model_id="m")
        try:
            prefill_insert(space, model, BASE)
            assert writing.wait(30)
            assert list(tmp_path.rglob(f"*{TEMP_MARK}*")), "the spill's temporary file is on disk"
            report = compact(tmp_path, max_bytes=1 << 30)
        finally:
            go_on.set()
        store.flush()
        assert "temporary files" not in report.actions, report.actions
        assert store.counts["spills_refused"] == 0, list(store.reports)


def _chain_of_two(root):
    """A store holding the chain [0, 24) -> [24, 48) of BASE, on disk; returns the model."""
    model = _model("llama")
    with PromptStore.open(root, durability="sync") as store:
        space = store.bind(model, model_id="m")
        prefill_insert(space, model, BASE[:24])
        prefill_insert(space, model, BASE[:48])
    return model


def _assert_chain_serves_from_disk(root, model):
    with PromptStore.open(root, hot_bytes=0) as store:
        length, err = continuation_error(store.bind(model, model_id="m"), model, BASE[:50])
        assert (length, list(store.reports)) == (48, []) and err < TOL


def test_compact_joins_only_the_pair_it_merged(tmp_path, monkeypatch):
    from promptstore.index import Index

    model = _chain_of_two(tmp_path)
    real = Index.join_child
    with PromptStore.open(tmp_path, durability="sync") as other:
        theirs = other.bind(model, model_id="m")
        raced = []

        def another_process_splits_the_child_first(self, *args, **kwargs):
            if not raced:
                raced.append(True)
                prefill_insert(theirs, model, BASE[:36])  # [24, 48) -> [24, 36) + [36, 48)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Index, "join_child", another_process_splits_the_child_first)
        report = compact(tmp_path, max_bytes=1 << 30)
        monkeypatch.undo()
    assert raced and report.status != "failed", report.errors
    _assert_chain_serves_from_disk(tmp_path, model)


# Regression (was a defect): Compactor._join named the merged file after the child's key and
# the joined span, so two compacts merging the same chain wrote the same path, and the one
# whose join_child was refused deleted the file the winner's record names. Every cold write
# now names its file with a tag of its own (ColdTier.relative_path).
def test_two_compacts_merging_the_same_chain(tmp_path, monkeypatch):
    from promptstore.index import Index

    model = _chain_of_two(tmp_path)
    real = Index.join_child
    other_compact = []

    def another_process_compacts_first(self, *args, **kwargs):
        if not other_compact:
            other_compact.append(True)
            other_compact.append(compact(tmp_path, max_bytes=1 << 30))  # merges the same chain
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Index, "join_child", another_process_compacts_first)
    with PromptStore.open(tmp_path):  # a process using the store: neither compact runs alone
        report = compact(tmp_path, max_bytes=1 << 30)
    monkeypatch.undo()
    assert other_compact[1].actions.get("merged chains", {}).get("nodes") == 1
    assert report.status != "failed", report.errors
    _assert_chain_serves_from_disk(tmp_path, model)


def test_a_file_removed_right_after_its_rename_is_a_disk_write_error(tmp_path, monkeypatch):
    from promptstore.errors import DiskWriteError
    from promptstore.snapshots.cold import ColdTier

    model = _model("llama")
    cache = fresh_cache(model)
    forward(model, cache, BASE[:10])
    snaps = [c.snapshot(0) for c in cache]
    tier = ColdTier(tmp_path / "cold")
    real_sync_dir = ColdTier._sync_dir

    def renamed_then_removed_by_another_process(self, path):
        real_sync_dir(self, path)
        for f in path.glob("*.safetensors"):
            f.unlink()

    monkeypatch.setattr(ColdTier, "_sync_dir", renamed_then_removed_by_another_process)
    # Either the write reports success (the file was published; its later load is
    # a reported miss) or a DiskWriteError: never a bare FileNotFoundError.
    try:
        ref = tier.write(NodeId(b"k" * 16, b"n" * 16, 0, 10), snaps)
        assert ref.nbytes > 0
    except DiskWriteError:
        pass
