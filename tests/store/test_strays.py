"""Something other than a file where a snapshot file belongs (issue 16, defect 2):
a directory, a FIFO, a symlink. Before the fix a directory there made every compact
die with IsADirectoryError (a traceback, and the exit status of a repair), and a
FIFO or a symlink was deleted as an orphan file. Now a fetch of a node whose record
names one is a reported miss, and compact moves it to quarantine (never following,
reading or deleting it) and reports it by kind, wherever it stands."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from promptstore import PromptStore
from promptstore.store.compact import compact

from ..conftest import _model, prompt_tokens
from ..reliability._util import TOL, continuation_error, prefill_insert

TOKENS = prompt_tokens(30, seed=61)
KINDS = {
    "directory": lambda p, outside: (p.mkdir(), (p / "inside").write_text("x")),
    "FIFO": lambda p, outside: os.mkfifo(p),
    "symlink": lambda p, outside: p.symlink_to(outside),
}


def build(root):
    model = _model("llama")
    with PromptStore.open(root, durability="sync") as store:
        space = store.bind(model, model_id="m")
        prefill_insert(space, model, TOKENS)
        (node,) = list(store.index.iter_nodes(space.namespace))
    return root / "cold" / node.record.file


KIND_TESTS = {"symlink": stat.S_ISLNK, "directory": stat.S_ISDIR, "FIFO": stat.S_ISFIFO, "file": stat.S_ISREG}


def kinds_in(root) -> dict[str, str]:
    """Quarantined entries by kind."""
    out = {}
    for p in (root / "cold" / "quarantine").iterdir():
        mode = p.lstat().st_mode
        out[p.name] = next(k for k, test in KIND_TESTS.items() if test(mode))
    return out


@pytest.fixture
def outside(tmp_path):
    target = tmp_path / "outside.safetensors"
    target.write_bytes(b"not yours")
    return target


@pytest.mark.parametrize("first", ["compact", "fetch"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_in_place_of_a_named_file(tmp_path, caplog, outside, kind, first):
    root = tmp_path / "store"
    path = build(root)
    path.unlink()
    KINDS[kind](path, outside)
    model = _model("llama")
    with caplog.at_level(logging.CRITICAL):
        if first == "compact":
            report = compact(root, verify=True, max_bytes=1 << 30)
            assert report.status == "repaired" and report.actions[f"stray {kind}"]["files"] == 1
        with PromptStore.open(root, hot_bytes=0) as store:
            space = store.bind(model, model_id="m")
            length, err = continuation_error(space, model, TOKENS)
            assert length == 0 and err < TOL
            if first == "fetch":
                assert [r.reason for r in store.reports] == ["not a file"]
            prefill_insert(space, model, TOKENS)  # stored again, in a file of its own
        report = compact(root, verify=True, max_bytes=1 << 30)
        assert report.status != "failed" and not report.errors
    assert list(kinds_in(root).values()) == [kind]
    assert outside.read_bytes() == b"not yours"
    with PromptStore.open(root, hot_bytes=0) as store:
        length, err = continuation_error(store.bind(model, model_id="m"), model, TOKENS)
        assert length == len(TOKENS) - 1 and err < TOL


STRAYS = [(kind, "a file's name") for kind in KINDS] + [
    (kind, "a fan-out directory") for kind in ("FIFO", "symlink", "file")
]


@pytest.mark.parametrize("kind,where", STRAYS)
def test_unnamed_strays_are_set_aside(tmp_path, outside, kind, where):
    root = tmp_path / "store"
    named = build(root)
    if where == "a file's name":
        path = named.with_name("ab" * 16 + "-0123abcd.safetensors")
        KINDS[kind](path, outside)
    else:  # files/zz, where a directory of the fan-out belongs (a link would lead outside)
        path = root / "cold" / "files" / "zz"
        {**KINDS, "file": lambda p, _: p.write_text("x")}[kind](path, outside.parent)
    for dry_run in (True, False):
        report = compact(root, dry_run=dry_run, max_bytes=1 << 30)
        assert report.status == "repaired" and report.actions[f"stray {kind}"]["files"] == 1
        assert os.path.lexists(path) == dry_run
    assert list(kinds_in(root).values()) == [kind]
    assert outside.read_bytes() == b"not yours" and named.is_file()
    assert compact(root, max_bytes=1 << 30).status == "clean"
