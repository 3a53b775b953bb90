"""Real redis-server processes on free loopback ports, for the remote tier's tests
and the soak: one server, or a Redis Cluster of three primaries with a replica
each (formed by redis-cli), whose nodes can be killed, paused and resharded;
either over TLS with certificates made in process (testing/tls.py).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from .tls import TLSFiles

REDIS = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
REDIS_CLI = shutil.which("redis-cli") or ("/usr/bin/redis-cli" if Path("/usr/bin/redis-cli").exists() else None)
START_SECONDS = 10.0
CLUSTER_SECONDS = 20.0  # the longest a cluster may take to form, or to promote a replica
RESHARD_SECONDS = 60.0  # the longest redis-cli may take to move a slot range
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000
# Replicas sync at once (by default a primary waits 5 s for more replicas to share a transfer).
CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000", "--repl-diskless-sync-delay", "0")


def missing() -> str | None:
    """Why a cluster cannot be started here (None when it can)."""
    absent = [name for name, path in (("redis-server", REDIS), ("redis-cli", REDIS_CLI)) if path is None]
    return f"{' and '.join(absent)} not installed (`make redis` installs both)" if absent else None


def answering(server, what: str) -> None:
    """Wait until a just started `server` (its `proc`, `client()`, `port`, `kill()`)
    answers PING; else kill it and raise RuntimeError."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        try:
            if server.client().ping():
                return
        except redis.RedisError:
            if server.proc.poll() is not None:
                break
            time.sleep(0.02)
    server.kill()
    raise RuntimeError(f"{what} did not answer PING on port {server.port} within {START_SECONDS} s")


def client_tls(tls: TLSFiles | None) -> dict:
    """redis-py's options to reach a server of these certificates (none without TLS)."""
    return {} if tls is None else {"ssl": True, "ssl_ca_certs": str(tls.ca)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; `kill` and `start` again (empty: nothing is saved).
    With `tls`, it serves TLS only (on `port`), and replicates over it."""

    def __init__(self, directory: Path, *args: str, tls: TLSFiles | None = None):
        self.dir, self.args, self.tls = directory, args, tls
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **client_tls(self.tls))

    def start(self) -> RedisServer:
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port), *self.tls.server_args()]
        cmd = [REDIS, *ports, "--bind", "127.0.0.1", "--dir", str(self.dir)]
        cmd += ["--save", "", "--appendonly", "no", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        answering(self, "redis-server")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart_empty(self) -> None:
        self.kill()
        self.start()


# --- a real Redis Cluster: three primaries, a replica each ------------------------------


def free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port is free too."""
    for _ in range(200):
        port = free_port()
        if port in taken or port + BUS_OFFSET in taken or port + BUS_OFFSET > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) on 127.0.0.1 after 200 tries")


def wait_until(done, seconds: float, what: str, also=()) -> None:
    """Until done() is true, asked every 50 ms (a Redis error, or one of `also`, is
    a no: a process still starting or just killed); else RuntimeError naming `what`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if done():
                return
        except (redis.RedisError, *also):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no {what} within {seconds} s")


class Replicated:
    """redis-server processes some of which replicate others (`servers`)."""

    servers: list[RedisServer]
    tls: TLSFiles | None

    def hosts_url(self, kind: str, nodes: list, path: str = "") -> str:
        """The remote_url of `kind` ("cluster", "sentinel") naming `nodes`: over
        TLS, trusting the test authority."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in nodes)
        if self.tls is not None:
            return f"rediss+{kind}://{hosts}{path}?ssl_ca_certs={self.tls.ca}"
        return f"redis+{kind}://{hosts}{path}"

    def alive(self) -> list[RedisServer]:
        return [s for s in self.servers if s.proc is not None and s.proc.poll() is None]

    def wait_replicated(self, seconds: float = CLUSTER_SECONDS) -> None:
        """Until every live replica's link to its primary is up."""

        def linked(s: RedisServer) -> bool:
            r = s.client().info("replication")
            return r["role"] == "master" or r.get("master_link_status") == "up"

        wait_until(lambda: all(linked(s) for s in self.alive()), seconds, "every replica linked to its primary")

    def kill(self) -> None:
        for server in self.servers:
            server.kill()


class Cluster(Replicated):
    """Six redis-server processes in cluster mode, formed by `redis-cli --cluster
    create` into three primaries with one replica each; nothing is saved."""

    def __init__(self, directory: Path, primaries: int = 3, replicas: int = 1, tls: TLSFiles | None = None):
        self.dir, self.tls = directory, tls
        self.servers: list[RedisServer] = []
        taken: set[int] = set()
        for _ in range(primaries * (1 + replicas)):
            server = RedisServer(directory, tls=tls)
            server.port = free_cluster_port(taken)
            taken |= {server.port, server.port + BUS_OFFSET}
            server.args = (*CLUSTER_ARGS, "--cluster-config-file", str(directory / f"nodes-{server.port}.conf"))
            self.servers.append(server)
        self.replicas = replicas

    @property
    def url(self) -> str:
        return self.hosts_url("cluster", self.servers)

    def start(self) -> Cluster:
        try:
            for server in self.servers:
                server.start()
            cmd = [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers)]
            cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            cmd += ["--tls", "--cacert", str(self.tls.ca)] if self.tls is not None else []
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=CLUSTER_SECONDS)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
            self.wait_ok()
            self.wait_replicated()
        except BaseException:
            self.kill()
            raise
        return self

    def info(self, server: RedisServer, section: str) -> dict:
        return server.client().info(section)

    def wait_ok(self, seconds: float = CLUSTER_SECONDS) -> None:
        """Until every live node says cluster_state:ok and every slot is served."""
        wait_until(lambda: all(self._state_ok(s) for s in self.alive()), seconds, "cluster_state:ok on every node")

    def _state_ok(self, server: RedisServer) -> bool:
        text = server.client().execute_command("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else text
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        return fields.get("cluster_state") == "ok" and fields.get("cluster_slots_ok") == "16384"

    def primaries(self) -> list[RedisServer]:
        return [s for s in self.alive() if self.info(s, "replication")["role"] == "master"]

    def replica_of(self, primary: RedisServer) -> RedisServer:
        for s in self.alive():
            r = self.info(s, "replication")
            if r["role"] == "slave" and int(r["master_port"]) == primary.port:
                return s
        raise LookupError(f"no replica follows 127.0.0.1:{primary.port}")

    def node_id(self, server: RedisServer) -> str:
        """The cluster's name for a node (what `--cluster-from` and `--cluster-to` take)."""
        name = server.client().execute_command("CLUSTER", "MYID")
        return name.decode() if isinstance(name, bytes) else name

    def slots_of(self, primary: RedisServer) -> int:
        """How many hash slots a primary serves."""
        shards = primary.client().execute_command("CLUSTER", "SLOTS")
        return sum(int(end) - int(start) + 1 for start, end, owner, *_ in shards if int(owner[1]) == primary.port)

    def reshard(self, source: RedisServer, target: RedisServer, slots: int, pipeline: int = 10):
        """Move `slots` hash slots (and their keys, `pipeline` per MIGRATE) from one
        primary to another with `redis-cli --cluster reshard`, as an operator would."""
        cmd = [REDIS_CLI, "--cluster", "reshard", f"127.0.0.1:{target.port}"]
        cmd += ["--cluster-from", self.node_id(source), "--cluster-to", self.node_id(target)]
        cmd += ["--cluster-slots", str(slots), "--cluster-pipeline", str(pipeline), "--cluster-yes"]
        cmd += ["--tls", "--cacert", str(self.tls.ca)] if self.tls is not None else []
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=RESHARD_SECONDS)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster reshard failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        self.wait_agreed()  # redis-cli refuses to start another reshard before the nodes agree
        return out

    def wait_agreed(self, seconds: float = CLUSTER_SECONDS) -> None:
        """Until every live node names the same owner for every slot."""

        def table(s: RedisServer) -> list:
            shards = s.client().execute_command("CLUSTER", "SLOTS")
            return sorted((int(start), int(end), int(owner[1])) for start, end, owner, *_ in shards)

        wait_until(lambda: len({str(table(s)) for s in self.alive()}) == 1, seconds, "agreement on the slots' owners")

    def items(self) -> list[tuple[bytes, bytes]]:
        """Every key and its value, from every primary."""
        out = []
        for s in self.primaries():
            client = s.client()
            out += [(key, client.get(key)) for key in client.scan_iter(count=1000)]
        return out

    def flushall(self) -> None:
        for s in self.primaries():
            s.client().flushall()


# --- `make redis-cluster`: one to use by hand ------------------------------------------


def by_hand(argv: list[str] | None, module: str, doc: str, start, what: str, reason: str | None) -> int:
    """Start servers (`start(directory)` -> an object with `url` and `kill()`) on free
    loopback ports, print their remote_url, and tear them down on Ctrl-C or SIGTERM
    (or after --seconds); `what` names them in what is printed, `reason` says why
    they cannot be started here (None: they can)."""
    import argparse
    import signal
    import tempfile

    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    parser.add_argument("--seconds", type=float, default=None, help="tear it down after this long (default: never)")
    args = parser.parse_args(argv)
    if reason is not None:
        print(f"no {what}: {reason}")
        return 2
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    with tempfile.TemporaryDirectory(prefix="redis-") as directory:
        try:
            servers = start(Path(directory))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"no {what}: {e}")
            return 2
        try:
            print(f"{what}: remote_url={servers.url}", flush=True)
            print("Ctrl-C (or SIGTERM) stops it and removes its files", flush=True)
            deadline = None if args.seconds is None else time.monotonic() + args.seconds
            while not stop and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            servers.kill()
    print(f"{what}: stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Start a cluster of three primaries and three replicas on free loopback
    ports, print its remote_url, and tear it down on Ctrl-C or SIGTERM."""
    what = "a Redis Cluster of 3 primaries and 3 replicas"
    module = "promptstore.testing.redis_cluster"
    return by_hand(argv, module, main.__doc__, lambda d: Cluster(d).start(), what, missing())


if __name__ == "__main__":
    raise SystemExit(main())
