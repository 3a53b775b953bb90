"""`promptstore serve` run sharded: mlx.launch's ring backend starting one server
process per rank on this machine, rank 0 on a free loopback port (always killed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import anthropic
from openai import OpenAI

from tests.serve.conftest import STOP_DEADLINE_S, Server

from .conftest import BIND_TRIES, RING_BIND_FAILED, ROOT, _free_ports

SERVE = Path(__file__).with_name("_serve.py")


class GroupServer(Server):
    """A group of `ranks` server processes under one mlx.launch; `start()`, `health_body()`
    and `log()` as a one-process server's."""

    def __init__(self, model: Path, store: Path, log: Path, *extra: str, ranks: int = 2):
        super().__init__(model, store, log, *extra)
        self.ranks = ranks

    def start(self) -> GroupServer:
        """Started and healthy; started again where a port it was to listen on was taken."""
        for _ in range(BIND_TRIES):
            self.launch()
            if self._healthy():
                return self
            if RING_BIND_FAILED not in self.log() and "Address already in use" not in self.log():
                break
        raise AssertionError(f"the group did not become healthy:\n{self.log()[-4000:]}")

    def launch(self) -> None:
        self.kill()
        first = _free_ports(self.ranks + 1)
        self.port = first + self.ranks  # the ring takes first .. first + ranks - 1
        cmd = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
        cmd += ["--backend", "ring", "-n", str(self.ranks), "--starting-port", str(first), "--python", sys.executable]
        cmd += ["--", str(SERVE), "serve", "--model", str(self.model), "--store", str(self.store)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *self.extra]
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(self.log_path, "a") as log:
            log.write(f"--- start: {' '.join(cmd)}\n")
            log.flush()
            # stdin a pipe never written nor closed: on a closed one (at EOF) mlx.launch's select() loop spins a core
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def pid(self, rank: int) -> int:
        """The process of `rank` (each rank logs it as it starts)."""
        found = re.findall(rf"group: rank {rank} of {self.ranks} \(\w+ parallel\), process (\d+)", self.log())
        assert found, f"rank {rank} did not say its process:\n{self.log()[-3000:]}"
        return int(found[-1])

    def openai(self) -> OpenAI:
        return self.client()

    def anthropic(self) -> anthropic.Anthropic:
        http = anthropic.DefaultHttpxClient(trust_env=False, timeout=120)
        return anthropic.Anthropic(base_url=self.url, api_key="none", max_retries=0, http_client=http)

    def stop(self, rank: int = 0, sig: int = signal.SIGTERM) -> None:
        """`sig` to one rank, then wait for the whole group to end (killed past the deadline)."""
        os.kill(self.pid(rank), sig)
        try:
            self.proc.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the group did not stop in {STOP_DEADLINE_S} s:\n{self.log()[-4000:]}") from None

    def kill(self) -> None:
        """Every rank and the launcher (its session)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=STOP_DEADLINE_S)
