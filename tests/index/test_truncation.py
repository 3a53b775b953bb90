"""A truncated index file (issue 16, defect 1). LMDB maps data.mdb and trusts its
meta pages, so before the fix a file cut short killed the opening process with
SIGBUS, and a file cut to 0 bytes opened as an empty store (after which compact
would delete every snapshot file as an orphan). Opening now refuses both with
IndexCorruptError and leaves the file as it was. Each case runs in a child process:
a signal is a test failure, not the end of the test run."""

from __future__ import annotations

import pytest

from promptstore.index import Index, NodeRecord

from ..conftest import child_failure, run_isolated
from .conftest import SPECS

OPEN_AND_READ = """
import sys
from promptstore.index import Index
try:
    with Index.open(sys.argv[1], readonly=sys.argv[2] == "readonly") as ix:
        nodes = sum(1 for ns in ix.namespaces() for _ in ix.iter_nodes(ns))
        print("opened", nodes)
except Exception as e:
    print(type(e).__name__, e)
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An index of 300 nodes (about 40 pages) and its data file's bytes."""
    path = tmp_path_factory.mktemp("truncation") / "index"
    with Index.open(path, sync=False) as ix:
        ns = ix.register_namespace(SPECS[0])
        for i in range(300):
            ix.insert(ns, [i, i + 1, 5], NodeRecord.blank(ns, nbytes=i))
    return path, (path / "data.mdb").read_bytes()


CUTS = {
    "0 bytes": lambda n: 0,
    "inside the first meta page": lambda n: 100,
    "between the meta pages": lambda n: 6000,
    "just the two meta pages": lambda n: 8192,
    "half": lambda n: n // 2,
    "one byte short": lambda n: n - 1,
}


@pytest.mark.parametrize("mode", ["writable", "readonly"])
@pytest.mark.parametrize("cut", list(CUTS))
def test_a_truncated_index_is_refused_not_a_signal(tmp_path, built, cut, mode):
    source, raw = built
    path = tmp_path / "index"
    path.mkdir(mode=0o700)
    damaged = raw[: CUTS[cut](len(raw))]
    (path / "data.mdb").write_bytes(damaged)
    result = run_isolated(OPEN_AND_READ, str(path), mode)
    assert child_failure(result) == ""
    assert result.stdout.startswith("IndexCorruptError"), result.stdout
    assert (path / "data.mdb").read_bytes() == damaged  # refused without a write


def test_the_whole_file_opens(tmp_path, built):
    source, raw = built
    path = tmp_path / "index"
    path.mkdir(mode=0o700)
    (path / "data.mdb").write_bytes(raw)
    result = run_isolated(OPEN_AND_READ, str(path), "writable")
    assert child_failure(result) == ""
    assert result.stdout.split() == ["opened", "300"]


STORE_OPEN = """
import sys
from promptstore import PromptStore
try:
    PromptStore.open(sys.argv[1]).close()
    print("opened")
except Exception as e:
    print(type(e).__name__)
"""


@pytest.mark.parametrize("keep", [0, 0.5])
def test_a_store_with_a_truncated_index_is_refused(tmp_path, built, keep):
    _, raw = built
    root = tmp_path / "store"
    (root / "index").mkdir(parents=True, mode=0o700)
    (root / "index" / "data.mdb").write_bytes(raw[: int(len(raw) * keep)])
    result = run_isolated(STORE_OPEN, str(root))
    assert child_failure(result) == ""
    assert result.stdout.strip() == "IndexCorruptError"


COMPACT = """
import json, subprocess, sys
for args in ([], ["--reset-index", "--dry-run"], ["--reset-index"], []):
    run = subprocess.run([sys.executable, "tools/compact", "--store", sys.argv[1], "--json", *args],
                         capture_output=True, text=True, timeout=120)
    out = json.loads(run.stdout) if run.stdout.startswith("{") else {}
    print(run.returncode, out.get("status"), sorted(out.get("actions", {})))
"""


def test_compact_sets_a_truncated_index_aside_when_told(tmp_path):
    """The repair path: compact refuses a truncated index like any open does; with
    --reset-index it moves it aside (kept), starts an empty one and reclaims the files."""
    from promptstore import PromptStore
    from promptstore.testing.models import tiny_model

    from ..conftest import forward, prompt_tokens

    root = tmp_path / "store"
    model = tiny_model("llama")
    with PromptStore.open(root, durability="sync") as store:
        space = store.bind(model, model_id="m")
        tokens = prompt_tokens(20)
        hit = space.fetch(tokens)
        forward(model, hit.cache, tokens)
        space.insert(tokens, hit.cache)
    data = root / "index" / "data.mdb"
    damaged = data.read_bytes()[: data.stat().st_size // 2]
    data.write_bytes(damaged)
    result = run_isolated(COMPACT, str(root))
    assert child_failure(result) == ""
    refused, dry, reset, after = result.stdout.splitlines()
    # Refused: no report, not the exit status of a clean store (which status a failure
    # gets is the command's top-level handling).
    assert refused.split()[0] != "0" and refused.split()[1] == "None"
    assert dry.startswith("1 repaired ['damaged index set aside")
    assert reset.startswith("1 repaired ['LMDB space', 'damaged index set aside") and "'orphan files'" in reset
    assert after.startswith("0 clean")
    kept = [p for p in root.iterdir() if p.name.startswith("index.damaged-")]
    assert len(kept) == 1 and (kept[0] / "data.mdb").read_bytes() == damaged
    assert not list((root / "cold" / "files").rglob("*.safetensors"))
