"""`tools/compact` as the README shows it and cron runs it: from a clone, with no
environment activated and only PATH=/usr/bin:/bin, after `make setup`; its exit
status over a table of stores, each made with the library."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from promptstore import PromptStore
from promptstore.store.compact import compact

from ..conftest import _model, forward, prompt_tokens
from .conftest import REPO

TOOL = REPO / "tools" / "compact"
BARE = {"PATH": "/usr/bin:/bin"}  # what `env -i PATH=/usr/bin:/bin` leaves
needs_venv = pytest.mark.skipif(
    not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the clone's .venv (make setup)"
)
TURNS = (24, 48, 68)  # a conversation inserted turn by turn: a chain of three nodes


def bare(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=BARE, timeout=120)


def build(root: Path) -> Path:
    """A store as a session leaves it: one conversation stored turn by turn, closed cleanly."""
    model, tokens = _model("llama"), prompt_tokens(TURNS[-1], seed=90)
    with PromptStore.open(root, durability="sync") as store:
        space = store.bind(model, model_id="m")
        hit, done = space.fetch(tokens), 0
        for end in TURNS:
            forward(model, hit.cache, tokens[done:end])
            space.insert(tokens[:end], hit.cache)
            done = end
    return root


def snapshot_files(root: Path) -> list[Path]:
    return sorted((root / "cold" / "files").rglob("*.safetensors"))


def digest(root: Path) -> dict[str, str]:
    """Every entry under `root`, by kind, mode and content. Not LMDB's lock file: every
    reader of the index (a read-only one too) writes its slot there."""
    out = {}
    for path in sorted(root.rglob("*")) if root.exists() else []:
        rel, info = str(path.relative_to(root)), path.lstat()
        if rel == "index/lock.mdb":
            continue
        content = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(info.st_mode) else ""
        out[rel] = f"{stat.filemode(info.st_mode)} {content}"
    return out


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("template") / "store")


# --- what each case does to a fresh copy of the template --------------------------------


def compacted_once(root: Path) -> None:
    compact(root, max_bytes=1 << 30)  # merged and compacted: nothing left to do


def orphans(root: Path) -> None:
    """What crashes leave: a file no index entry names, a dead writer's temporary file."""
    named = snapshot_files(root)[0]
    shutil.copy(named, named.with_name("ff" * 16 + "-0-5.safetensors"))
    named.with_name(named.stem + ".tmp-999999999-ab.safetensors").write_bytes(b"partial")


def corrupt_file(root: Path) -> None:
    victim = snapshot_files(root)[0]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))


def planted_directory(root: Path) -> None:
    """A directory where a snapshot file belongs (never read, followed or deleted)."""
    planted = snapshot_files(root)[0].with_name("ab" * 16 + "-0123abcd.safetensors")
    planted.mkdir()
    (planted / "inside").write_text("x")


def missing_file(root: Path) -> None:
    """An index entry whose file is gone: its data is nowhere."""
    with PromptStore.open(root, hot_bytes=0) as store:
        leaf = max((n for ns in store.index.namespaces() for n in store.index.iter_nodes(ns)), key=lambda n: n.end)
    (root / "cold" / leaf.record.file).unlink()


def not_a_store(root: Path) -> None:
    shutil.rmtree(root)
    root.mkdir()
    (root / "notes.txt").write_text("mine")


@dataclass(frozen=True)
class Case:
    name: str
    make: object  # what it does to a copy of the template
    status: int  # of the dry run and of the run: 0 healthy, 1 damage found (and repaired), 2 failed
    reasons: frozenset = frozenset()  # of the actions the run's --json lists
    damage: frozenset = frozenset()  # those that are damage
    verify: bool = False


TABLE = [
    Case("clean store", compacted_once, 0, frozenset({"LMDB space"})),  # the compacting copy, every run
    Case("routine merges only", lambda root: None, 0, frozenset({"merged chains", "LMDB space"})),
    Case("orphan files", orphans, 0, frozenset({"orphan files", "temporary files", "merged chains", "LMDB space"})),
    Case(
        "a corrupt file, with --verify",
        corrupt_file,
        1,
        frozenset({"failed verify (checksum)", "merged chains", "LMDB space"}),
        frozenset({"failed verify (checksum)"}),
        verify=True,
    ),
    Case(  # merging reads the files of a chain, and finds the bad one
        "a corrupt file, without --verify",
        corrupt_file,
        1,
        frozenset({"failed verify (checksum)", "merged chains", "LMDB space"}),
        frozenset({"failed verify (checksum)"}),
    ),
    Case(
        "a planted directory",
        planted_directory,
        1,
        frozenset({"stray directory", "merged chains", "LMDB space"}),
        frozenset({"stray directory"}),
    ),
    Case(
        "an index entry without its file",
        missing_file,
        1,
        frozenset({"missing files", "nodes without data", "merged chains", "LMDB space"}),
        frozenset({"missing files", "nodes without data"}),
    ),
    Case("not a store", not_a_store, 2),
]


@needs_venv
@pytest.mark.parametrize("case", TABLE, ids=[c.name for c in TABLE])
def test_exit_status_over_a_table_of_stores(tmp_path, template, case):
    """The dry run changes nothing and has the run's status; the run's --json lists
    every action with its reason; after the run the store is healthy (0)."""
    root = tmp_path / "store"
    shutil.copytree(template, root)
    case.make(root)
    args = [str(TOOL), "--store", str(root), "--max-bytes", str(1 << 30), "--json"] + ["--verify"] * case.verify
    before = digest(root)

    dry = bare(*args, "--dry-run")
    assert dry.returncode == case.status, dry.stderr
    assert digest(root) == before  # nothing changed, nor created
    if case.status == 2:
        assert dry.stdout == "" and len(dry.stderr.splitlines()) == 1 and "no store at" in dry.stderr
        run = bare(*args)
        assert (run.returncode, run.stdout, run.stderr) == (2, "", dry.stderr)
        assert digest(root) == before
        return
    would = json.loads(dry.stdout)
    assert would["status"] == ("clean", "repaired")[case.status] and would["dry_run"]
    assert not any(a["done"] for a in would["log"])

    run = bare(*args)
    assert run.returncode == case.status, run.stderr
    report = json.loads(run.stdout)
    assert report["status"] == would["status"]
    assert all(a["done"] for a in report["log"])
    assert {a["reason"] for a in report["log"]} == case.reasons, report["log"]
    assert {a["reason"] for a in report["log"] if a["damage"]} == case.damage
    assert all(a["kind"] and a["target"] for a in report["log"])
    # The dry run foresaw the same repairs (merges it counts pair by pair, and LMDB
    # space it cannot know without the copy).
    assert {a["reason"] for a in would["log"] if a["damage"]} == case.damage

    again = bare(*args)
    assert again.returncode == 0 and json.loads(again.stdout)["status"] == "clean", again.stdout


@needs_venv
def test_runs_from_a_bare_environment_and_says_would_in_a_dry_run(tmp_path, template):
    root = tmp_path / "store"
    shutil.copytree(template, root)
    planted_directory(root)
    dry = bare(str(TOOL), "--store", str(root), "--dry-run")
    assert dry.returncode == 1, dry.stderr
    lines = dry.stdout.rstrip().splitlines()
    assert "nothing changed" in dry.stdout and "merged chains" in dry.stdout
    assert any(line.startswith("would quarantine: cold/files/") and "(stray directory)" in line for line in lines)
    assert lines[-1].startswith("would repair (dry run, nothing changed; status 1) in ")
    repaired = bare(str(TOOL), "--store", str(root))
    assert repaired.returncode == 1, repaired.stderr
    lines = repaired.stdout.rstrip().splitlines()
    assert any(line.startswith("quarantine: cold/files/") for line in lines)
    assert lines[-1].startswith("repaired in ") and lines[-1].endswith("damage found and repaired")
    clean = bare("/bin/sh", "-c", f"cd {REPO} && tools/compact --store {root}")
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.rstrip().splitlines()[-1].endswith("healthy, nothing to do")


@needs_venv
@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_wherever_it_stands(tmp_path, where):
    nowhere = tmp_path / "nowhere"
    args = ["--store", str(nowhere)]
    proc = bare(str(TOOL), *(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "StoreDirectoryError" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"tools/compact: error: no store at {nowhere}")
    assert not nowhere.exists()


def test_the_library_refuses_a_path_that_is_not_a_store_and_creates_nothing(tmp_path):
    from promptstore.errors import StoreDirectoryError

    (tmp_path / "plain").mkdir()
    (tmp_path / "a-file").write_text("x")
    for path, expected in (
        (tmp_path / "missing", "no store at"),
        (tmp_path / "plain", "no store at"),
        (tmp_path / "a-file", "is a file; expected a store directory"),
    ):
        before = digest(tmp_path)
        for reset_index in (False, True):
            with pytest.raises(StoreDirectoryError, match=expected):
                compact(path, dry_run=False, reset_index=reset_index)
        assert digest(tmp_path) == before
        assert os.path.lexists(path) == (path.name != "missing")


def test_without_a_python_that_has_promptstore_it_says_to_run_make_setup(tmp_path):
    clone = tmp_path / "clone"
    (clone / "tools").mkdir(parents=True)
    shutil.copy(TOOL, clone / "tools" / "compact")  # a clone where `make setup` never ran
    proc = bare(str(clone / "tools" / "compact"), "--store", str(tmp_path))
    assert proc.returncode == 2  # compact's "failed", never "repaired"
    assert proc.stdout == ""
    assert proc.stderr == (
        f"tools/compact: promptstore is not installed for /usr/bin/python3; run `make setup` in {clone}\n"
    )
