"""The command line run as a person runs it: real processes, a real model
directory on disk (the demo's random-weight llama), stores in temporary folders."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240  # a bound on each command; on 2 busy cores a generate takes a few seconds


def cli_env(home: Path, **extra: str) -> dict:
    """The environment a command runs in: no PROMPTSTORE_* of the caller's, no network,
    the user cache (the default store) under `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPTSTORE_")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), HF_HUB_OFFLINE="1", COLUMNS="80")
    env.pop("TTY_COMPATIBLE", None)
    env.pop("FORCE_COLOR", None)
    env.update(extra)
    return env


@pytest.fixture
def cli(tmp_path):
    """cli(*args, input=None, **env) -> CompletedProcess of `python -m promptstore ARGS`."""

    def run(*args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "promptstore", *args],
            input=input if input is not None else "",
            capture_output=True,
            text=True,
            env=cli_env(tmp_path, **env),
            cwd=tmp_path,
            timeout=TIMEOUT_S,
        )

    return run


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The demo's random-weight llama and tokenizer as an MLX model directory."""
    from promptstore.demo import save_model

    return save_model(tmp_path_factory.mktemp("models") / "demo-model")


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The single line a failed command printed on stderr (no traceback)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def error_after_progress(proc: subprocess.CompletedProcess) -> str:
    """The error line of a command that failed after slow work (loading a model):
    a progress line may come first (a task that took a second says so), then one error line."""
    *before, last = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert all(re.fullmatch(r"[\w .-]+: .* in \d+\.\d s", line) for line in before), proc.stderr
    return last
