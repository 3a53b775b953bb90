"""Distributed groups on this machine: mlx.launch's ring backend, its ranks on
loopback ports, each a process of its own (tests/group/_rank.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from promptstore.testing.model_dir import write_model_dir

ROOT = Path(__file__).resolve().parents[2]
RANK = Path(__file__).with_name("_rank.py")
LAUNCH_SECONDS = 180  # a group of tiny models plays its turns in seconds; a hang ends here
# The ring's ports are chosen free, then bound by the ranks: another process may take one between.
BIND_TRIES = 3
RING_BIND_FAILED = "[ring] Couldn't bind socket"


def _free_ports(n: int) -> int:
    """A first port of `n` consecutive free loopback ports (the ring backend
    listens on the first + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n >= 65536:
            continue
        try:
            held = []
            for port in range(first, first + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return first
    raise RuntimeError("no run of free loopback ports")


def launch(tmp: Path, model: Path, store: Path, steps: list, *, kind: str = "tensor", ranks: int = 2) -> list[dict]:
    """Play `steps` on a group of `ranks` processes; what each rank saw, by rank."""
    out = Path(tmp) / f"out-{len(list(Path(tmp).glob('out-*')))}"
    out.mkdir()
    steps_file = out / "steps.json"
    steps_file.write_text(json.dumps(steps))
    if ranks == 1:  # a process of no group: the worker alone, as a one-machine server runs
        cmd = [sys.executable, str(RANK), "--model", str(model), "--store", str(store), "--kind", kind]
        cmd += ["--steps", str(steps_file), "--out", str(out)]
        return _run(cmd, out, ranks)
    for _ in range(BIND_TRIES):
        first = _free_ports(ranks)
        cmd = [
            *(sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"),
            *("--backend", "ring", "-n", str(ranks), "--starting-port", str(first), "--python", sys.executable),
            *(str(RANK), "--model", str(model), "--store", str(store), "--kind", kind),
            *("--steps", str(steps_file), "--out", str(out)),
        ]
        try:
            return _run(cmd, out, ranks)
        except PortTaken:
            continue  # no rank got past mx.distributed.init(): nothing was opened or stored
    pytest.fail(f"the ring's ports were taken {BIND_TRIES} times in a row")


class PortTaken(Exception):
    """A port the ring was to listen on was taken between the choice and the bind."""


def _run(cmd: list[str], out: Path, ranks: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    log = out / "output.log"
    with open(log, "wb") as sink, quiet_stdin() as stdin:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, stdin=stdin, stdout=sink, stderr=sink)
        try:
            proc.wait(timeout=LAUNCH_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the group did not finish in {LAUNCH_SECONDS} s:\n{_tail(log)}")
    seen = [out / f"rank-{r}.json" for r in range(ranks)]
    if not any(f.exists() for f in seen) and RING_BIND_FAILED in log.read_text(errors="replace"):
        raise PortTaken
    if proc.returncode != 0 or not all(f.exists() for f in seen):
        pytest.fail(f"the group failed (exit {proc.returncode}):\n{_tail(log)}")
    return [json.loads(f.read_text()) for f in seen]


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


@contextmanager
def quiet_stdin():
    """A stdin for mlx.launch that never has input nor ends: its loop select()s on its
    stdin every 0.1 s, and on a closed one (at EOF at once) it spins a core."""
    read, write = os.pipe()
    try:
        yield read
    finally:
        os.close(read)
        os.close(write)


@pytest.fixture(scope="session")
def group_model(tmp_path_factory):
    """group_model(family, **overrides) -> a model folder (float32, random weights), made once."""
    made: dict = {}

    def make(family: str = "llama", **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = write_model_dir(tmp_path_factory.mktemp(f"group-{family}"), family, **overrides)
        return made[key]

    return make
