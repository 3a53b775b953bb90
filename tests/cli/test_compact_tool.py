"""`tools/compact` as the README shows it: from a clone, with no environment
activated and only PATH=/usr/bin:/bin, after `make setup`."""

from __future__ import annotations

import json
import shutil
import subprocess

import mlx.core as mx
import pytest

from promptstore import PromptStore

from .conftest import REPO

TOOL = REPO / "tools" / "compact"
BARE = {"PATH": "/usr/bin:/bin"}  # what `env -i PATH=/usr/bin:/bin` leaves


def bare(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=BARE, timeout=120)


@pytest.fixture
def store(tmp_path, model_of):
    model = model_of("llama")
    tokens = list(range(1, 65))
    with PromptStore.open(tmp_path / "s", durability="sync") as s:
        space = s.bind(model, model_id="m")
        cache = space.new_cache()
        model(mx.array(tokens)[None], cache=cache)
        space.insert(tokens, cache)
    return tmp_path / "s"


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the clone's .venv (make setup)")
def test_runs_from_a_bare_environment(store):
    first = bare(str(TOOL), "--store", str(store), "--json")
    assert first.returncode in (0, 1), first.stderr  # the first run may merge or recount
    assert json.loads(first.stdout)["after"]["nodes"] == 1
    snapshot = next((store / "cold").rglob("*.safetensors"))
    snapshot.with_name("x.tmp-999999999-ab.safetensors").write_bytes(b"x")  # a dead writer's temporary file
    repaired = bare(str(TOOL), "--store", str(store))
    assert repaired.returncode == 1, repaired.stderr
    assert "temporary files" in repaired.stdout and repaired.stdout.rstrip().splitlines()[-1].startswith("repaired in")
    clean = bare("/bin/sh", "-c", f"cd {REPO} && tools/compact --store {store} --json")
    assert clean.returncode == 0 and json.loads(clean.stdout)["status"] == "clean"


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
