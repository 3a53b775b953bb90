"""A real redis-server on a free loopback port, in a temporary directory, for the
remote-tier tests; killed (and restartable) by the tests that fault it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

REDIS = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
START_SECONDS = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; `kill` and `start` again (empty: nothing is saved)."""

    def __init__(self, directory: Path, *args: str):
        self.dir, self.args = directory, args
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        cmd = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        cmd += ["--save", "", "--appendonly", "no", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {START_SECONDS} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart_empty(self) -> None:
        self.kill()
        self.start()


@pytest.fixture
def redis_server(tmp_path_factory):
    if REDIS is None:
        pytest.skip("redis-server is not installed (`make redis` installs it)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.kill()
