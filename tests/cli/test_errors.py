"""A person's mistakes end in one line saying what was wrong and what was
expected, and a non-zero status; `--debug` shows the traceback."""

from __future__ import annotations

import pytest

from promptstore import compact_cli
from promptstore.console import guarded

from .conftest import one_line_error


def test_a_model_path_that_does_not_exist_is_refused_without_downloading(cli, tmp_path):
    # "org/name" is what mlx-lm would take for a hub repository and try to download.
    for model in ("no-such-org/no-such-model", str(tmp_path / "missing")):
        proc = cli("generate", "--model", model, "--prompt", "hi", "--store", str(tmp_path / "s"))
        line = one_line_error(proc)
        assert proc.returncode == 1
        assert line.startswith("promptstore generate: error: --model") and "no such directory" in line
        assert "expected a local MLX model directory" in line
    assert not (tmp_path / "s").exists()


def test_a_directory_that_is_not_a_model_is_refused(cli, tmp_path):
    line = one_line_error(cli("chat", "--model", str(tmp_path)))
    assert "no config.json" in line and "expected a local MLX model directory" in line


def test_a_store_path_that_is_a_file(cli, tmp_path, model_dir):
    store = tmp_path / "a-file"
    store.write_text("not a store")
    line = one_line_error(cli("generate", "--model", str(model_dir), "--prompt", "hi", "--store", str(store)))
    assert (
        line
        == f"promptstore generate: error: {store} is a file; expected a store directory (or a path to create one at)"
    )
    assert store.read_text() == "not a store"
    for command in ("stats", "compact"):
        assert f"{store} is a file; expected a store directory" in one_line_error(cli(command, "--store", str(store)))


def test_a_bad_setting(cli, tmp_path, model_dir):
    proc = cli(
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "hi",
        "--store",
        str(tmp_path / "s"),
        PROMPTSTORE_HOT_BYTES="lots",
    )
    line = one_line_error(proc)
    assert "invalid settings: hot_bytes" in line and "integer" in line
    assert not (tmp_path / "s").exists()  # settings are checked before the store touches the disk


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--max-tokens", "0"], "expected a positive number of tokens (or -1 for no limit)"),
        (["-m", "-5"], "expected a positive number of tokens"),
        (["--temp", "-1"], "expected a temperature of 0 or more"),
        (["--top-p", "1.5"], "expected a probability in (0, 1]"),
        (["--seed", "x"], "invalid int value"),
    ],
)
def test_bad_generation_options_are_usage_errors(cli, model_dir, args, expected):
    proc = cli("generate", "--model", str(model_dir), "--prompt", "hi", *args)
    line = one_line_error(proc)
    assert proc.returncode == 2
    assert line.startswith("promptstore generate: error: argument") and expected in line
    assert line.endswith("(see `promptstore generate --help`)")


def test_an_unknown_command(cli):
    line = one_line_error(cli("serve-me"))
    assert "invalid choice: 'serve-me'" in line and "'generate'" in line


def test_debug_shows_the_traceback(cli, tmp_path):
    proc = cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", "--debug")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ModelPathError" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("promptstore generate: error: --model")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_works_before_or_after_the_command(cli, tmp_path, where):
    nowhere = tmp_path / "nowhere"
    args = ["compact", "--store", str(nowhere)]
    proc = cli(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert proc.returncode == 2  # compact's "failed"
    assert "Traceback" in proc.stderr and "StoreDirectoryError" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"promptstore compact: error: no store at {nowhere}")
    assert not nowhere.exists()


def test_any_exception_is_one_line_and_the_failed_status(capsys):
    def boom() -> int:
        raise RuntimeError("the disk\nmelted")

    assert guarded(boom, "promptstore x", debug=False, failed=7) == 7
    assert capsys.readouterr().err == "promptstore x: error: RuntimeError: the disk melted\n"


def test_compact_failing_unexpectedly_is_failed_not_repaired(monkeypatch, capsys, tmp_path):
    """An exception inside compact (not a report of errors) exits 2, the documented "failed"."""
    from promptstore import PromptStore
    from promptstore.store import compact as compact_module

    PromptStore.open(tmp_path).close()

    def explode(*args, **kwargs):
        raise IsADirectoryError(21, "Is a directory", str(tmp_path / "cold" / "x.safetensors"))

    monkeypatch.setattr(compact_module, "compact", explode)
    status = compact_cli.run(["--store", str(tmp_path)], prog="tools/compact")
    err = capsys.readouterr().err.strip().splitlines()
    assert status == compact_cli.EXIT["failed"] == 2
    assert err == [f"tools/compact: error: {tmp_path / 'cold' / 'x.safetensors'}: Is a directory"]


def test_compact_usage_errors_are_failed_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        compact_cli.run(["--max-bytes", "lots"])
    assert exit_.value.code == 2
    assert "expected a number of bytes" in capsys.readouterr().err
