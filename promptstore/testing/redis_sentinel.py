"""Real redis-server processes on free loopback ports: a primary, its replica, and
three Sentinels (redis-server in sentinel mode) that watch them and promote the
replica when the primary is lost, for the remote tier's tests and by hand
(`make redis-sentinel`); all of them over TLS if asked (testing/tls.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from .redis_cluster import REDIS, RedisServer, Replicated, answering, by_hand, client_tls, free_port, wait_until
from .tls import TLSFiles

SERVICE = "promptstore"
FAILOVER_SECONDS = 20.0  # the longest the Sentinels may take to agree the primary is lost and promote its replica
# Sentinel settings of the group: the primary is taken for lost after 1 s without an answer.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
# What asking mid-failover may meet besides a Redis error: Sentinels that disagree or do not know the service yet.
MIDWAY = (LookupError, StopIteration)


def missing() -> str | None:
    """Why the group cannot be started here (None when it can)."""
    return None if REDIS is not None else "redis-server not installed (`make redis` installs it)"


def watched(sentinel: SentinelServer) -> dict:
    """What a Sentinel knows of the service: its primary's address, how many
    replicas and other Sentinels it sees, ... (SENTINEL MASTERS: redis-py parses
    that one for a plain client)."""
    return sentinel.client().sentinel_masters()[SERVICE]


class SentinelServer:
    """One redis-server in sentinel mode, watching `service` at the primary's port."""

    def __init__(self, directory: Path, primary_port: int, quorum: int, tls: TLSFiles | None = None):
        self.dir, self.port, self.tls = directory, free_port(), tls
        self.config = directory / f"sentinel-{self.port}.conf"  # Sentinel rewrites it as it learns
        listen = f"port {self.port}\n"
        if tls is not None:  # TLS only, to clients and to the servers it watches
            listen = f"port 0\ntls-port {self.port}\ntls-replication yes\ntls-auth-clients no\n"
            listen += f"tls-cert-file {tls.cert}\ntls-key-file {tls.key}\ntls-ca-cert-file {tls.ca}\n"
        self.config.write_text(
            f"{listen}bind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
        )
        self.proc: subprocess.Popen | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **client_tls(self.tls))

    def start(self) -> SentinelServer:
        cmd = [REDIS, str(self.config), "--sentinel"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        answering(self, "redis-server --sentinel")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class SentinelGroup(Replicated):
    """A primary, a replica following it, and three Sentinels (quorum 2) watching
    both; nothing is saved."""

    def __init__(self, directory: Path, sentinels: int = 3, quorum: int = 2, tls: TLSFiles | None = None):
        self.dir, self.tls = directory, tls
        self.servers = [RedisServer(directory, "--repl-diskless-sync-delay", "0", tls=tls) for _ in range(2)]
        primary = self.servers[0]
        self.servers[1].args += ("--replicaof", "127.0.0.1", str(primary.port))
        self.sentinels = [SentinelServer(directory, primary.port, quorum, tls) for _ in range(sentinels)]

    @property
    def url(self) -> str:
        return self.hosts_url("sentinel", self.sentinels, f"/{SERVICE}")

    def start(self) -> SentinelGroup:
        try:
            for server in self.servers:
                server.start()
            self.wait_replicated()
            for sentinel in self.sentinels:
                sentinel.start()
            self.wait_watching()
        except BaseException:
            self.kill()
            raise
        return self

    def role(self, server: RedisServer) -> str:
        return server.client().info("replication")["role"]

    def primary(self) -> RedisServer:
        """The server every live Sentinel names as the service's primary."""
        ports = {int(watched(s)["port"]) for s in self.live_sentinels()}
        if len(ports) != 1:
            raise LookupError(f"the Sentinels name {len(ports)} primaries: {sorted(ports)}")
        return next(s for s in self.servers if s.port in ports)

    def live_sentinels(self) -> list[SentinelServer]:
        return [s for s in self.sentinels if s.proc is not None and s.proc.poll() is None]

    def wait_watching(self, seconds: float = FAILOVER_SECONDS) -> None:
        """Until each Sentinel sees a replica in step with the primary and knows the
        other Sentinels (both learnt from the primary every second or so): only
        then can they promote it."""
        others = len(self.sentinels) - 1

        def ready(s: SentinelServer) -> bool:
            client = s.client()
            healthy = [
                r for r in client.sentinel_slaves(SERVICE) if not r["is_sdown"] and r["master-link-status"] == "ok"
            ]
            return bool(healthy) and watched(s)["num-other-sentinels"] >= others

        what = "Sentinels that know a healthy replica"
        wait_until(lambda: all(ready(s) for s in self.live_sentinels()), seconds, what, also=MIDWAY)

    def add_replica(self) -> RedisServer:
        """A fresh server following the primary (after a failover left none), once
        the Sentinels see it."""
        primary = self.primary()
        args = ("--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1", str(primary.port))
        server = RedisServer(self.dir, *args, tls=self.tls)
        self.servers.append(server.start())
        self.wait_replicated()
        self.wait_watching()
        return server

    def wait_promoted(self, lost: RedisServer, seconds: float = FAILOVER_SECONDS) -> RedisServer:
        """Until the Sentinels name another primary than `lost`, and it says it is one."""

        def promoted() -> bool:
            now = self.primary()
            return now is not lost and self.role(now) == "master"

        wait_until(promoted, seconds, "a replica promoted by the Sentinels", also=MIDWAY)
        return self.primary()

    def failover(self) -> RedisServer:
        """Ask the Sentinels for a failover with the primary alive (as an operator
        does before maintenance): the replica is promoted and the old primary
        follows it. Returns the new primary."""
        old = self.primary()
        self.wait_synced()
        self.live_sentinels()[0].client().execute_command("SENTINEL", "FAILOVER", SERVICE)
        return self.wait_promoted(old)

    def flushall(self) -> None:
        self.primary().client().flushall()
        self.wait_synced()

    def wait_synced(self, seconds: float = FAILOVER_SECONDS) -> None:
        """Until every replica has applied what its primary has sent (the offsets agree)."""
        primary = self.primary()

        def synced() -> bool:
            offset = primary.client().info("replication")["master_repl_offset"]
            replicas = [s for s in self.alive() if s is not primary]
            return all(s.client().info("replication").get("slave_repl_offset") == offset for s in replicas)

        wait_until(synced, seconds, "replicas in step with the primary", also=MIDWAY)

    def kill(self) -> None:
        for sentinel in self.sentinels:
            sentinel.kill()
        super().kill()


# --- `make redis-sentinel`: one to use by hand -----------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Start a primary, its replica and three Sentinels on free loopback ports,
    print the remote_url, and tear them down on Ctrl-C or SIGTERM."""
    what = "a primary, its replica and 3 Sentinels"
    module = "promptstore.testing.redis_sentinel"
    return by_hand(argv, module, main.__doc__, lambda d: SentinelGroup(d).start(), what, missing())


if __name__ == "__main__":
    raise SystemExit(main())
