"""A Redis Cluster as the remote tier's server: every key lives on the primary of
its hash slot, so a namespace's blobs spread over every shard. Commands go to
all the shards they need in one round trip (written to every shard before any
reply is read), with one try, as the single-server client: a failure raises,
and the next call asks the cluster again which shard serves which slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster, get_connection
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)
from redis.retry import Retry

REDIRECTS = 1  # MOVED or ASK (a failover or a reshard moved the slot) is followed once, then is an error
# Error replies that say the table of slot owners may be old: a MOVED or ASK not followed,
# CLUSTERDOWN, TRYAGAIN (a slot mid-move), a write sent to a replica. A refusal (OOM under
# noeviction, WRONGTYPE) says nothing of it, and must not cost every next call a re-read.
STALE_REPLIES = (AskError, ClusterDownError, TryAgainError, ReadOnlyError)  # MovedError is an AskError
SCHEMES = ("redis+cluster://", "rediss+cluster://")


@dataclass(frozen=True)
class ClusterURL:
    """A Redis Cluster: startup nodes (any one that answers finds the rest) and how to reach them."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    tls_options: tuple[tuple[str, str], ...] = ()  # ssl_ca_certs, ssl_cert_reqs, ... (TLS only)

    @classmethod
    def parse(cls, url: str) -> ClusterURL:
        """redis+cluster://[user:password@]host:port[,host:port...][/0] (rediss+cluster://: TLS),
        as Settings checked it; ValueError where it cannot be split."""
        scheme, _, rest = url.partition("://")
        cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
        # urlsplit of the rest alone: some Pythons refuse text before a bracketed host in a netloc
        parts = urlsplit(f"{scheme}://host{rest[cut:]}")._replace(netloc=rest[:cut])
        if parts.scheme not in ("redis+cluster", "rediss+cluster"):
            raise ValueError(f"{parts.scheme}://: not a redis+cluster:// or rediss+cluster:// URL")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        nodes = [node.rpartition(":") for node in hosts.split(",")]
        if not all(host and port.isdigit() for host, _, port in nodes):
            raise ValueError(f"{hosts!r}: not a list of host:port")
        user, sep, password = userinfo.partition(":")
        tls = parts.scheme == "rediss+cluster"
        return cls(
            tuple(dict.fromkeys((host.strip("[]"), int(port)) for host, _, port in nodes)),
            tls,
            unquote(user) or None,
            unquote(password) if sep else None,
            tuple(parse_qsl(parts.query)) if tls else (),
        )


class ClusterClient:
    """The shards of one Redis Cluster, used as the remote tier uses one server:
    `mget`, `pipeline(transaction=False)` of single-key commands, `ping`, `close`.

    The shards are discovered on first use, not here: a cluster that is down
    costs the first call a bounded wait, never the store's open.
    """

    def __init__(self, url: ClusterURL, timeout: float):
        self.url = url
        self.options: dict = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        self.options.update(username=url.username, password=url.password)
        if url.tls:
            self.options.update(ssl=True, **dict(url.tls_options))
        self._cluster: RedisCluster | None = None
        self._stale = False  # a call failed: ask for the slots' owners before the next
        self._lock = threading.Lock()

    def topology(self) -> RedisCluster:
        """The cluster client, its table of slot owners fresh after a failure."""
        with self._lock:
            try:
                if self._cluster is None:
                    nodes = [ClusterNode(host, port) for host, port in self.url.nodes]
                    self._cluster = RedisCluster(
                        startup_nodes=nodes, retry=Retry(NoBackoff(), 0), require_full_coverage=False, **self.options
                    )
                elif self._stale:
                    self._cluster.nodes_manager.initialize()
                self._stale = False
            except RedisClusterException as e:  # no startup node answered, or the answers disagree
                raise redis.ConnectionError(f"cluster discovery: {e}") from None
            return self._cluster

    # --- what the remote tier calls -----------------------------------------------------

    def mget(self, names: list[str]) -> list:
        """Values of `names` (None where absent or not a string), one MGET per slot."""
        slots: dict[int, list[str]] = {}
        for name in names:
            slots.setdefault(key_slot(name.encode()), []).append(name)
        groups = list(slots.values())
        replies = self.run([("MGET", *group) for group in groups])
        values = {name: value for group, reply in zip(groups, replies) for name, value in zip(group, reply)}
        return [values[name] for name in names]

    def pipeline(self, transaction: bool = False) -> Batch:
        if transaction:
            raise ValueError("a Redis Cluster runs no transaction across slots")
        return Batch(self)

    def ping(self) -> bool:
        return bool(self.topology().ping(target_nodes=RedisCluster.PRIMARIES))

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()

    # --- one round trip to every shard --------------------------------------------------

    def run(self, commands: list[tuple], each: Callable[[int, object], None] | None = None) -> list:
        """Replies to commands (name, key, ...) whose keys all hash to one slot, in
        order; the first error reply is raised, as a redis-py pipeline does.

        each: called with (index, reply) as each reply other than an error is read,
        while the others are still arriving (a shard's in order, shard after shard).
        """
        cluster = self.topology()
        replies: list = [None] * len(commands)
        try:
            todo = {i: (self._owner(cluster, command[1]), False) for i, command in enumerate(commands)}
            for attempt in range(1 + REDIRECTS):
                self._send(cluster, commands, todo, replies, each)
                todo = self._redirected(cluster, replies) if attempt < REDIRECTS else {}
                if not todo:
                    break
        except RedisClusterException as e:  # a slot no shard serves (a primary lost, no replica)
            self._stale = True
            raise redis.ConnectionError(f"cluster: {e}") from None
        for reply in replies:
            if isinstance(reply, Exception):
                self._stale = self._stale or isinstance(reply, STALE_REPLIES)
                raise reply
        return replies

    @staticmethod
    def _owner(cluster: RedisCluster, key) -> ClusterNode:
        return cluster.nodes_manager.get_node_from_slot(key_slot(key.encode() if isinstance(key, str) else key))

    def _send(self, cluster: RedisCluster, commands: list[tuple], todo: dict, replies: list, each=None) -> None:
        """Write each shard's commands, then read the replies (error replies kept as
        values, others also handed to `each`); a connection failure closes every
        connection used and raises."""
        shards: dict[str, tuple[ClusterNode, list]] = {}
        for i, (node, asking) in todo.items():
            shards.setdefault(node.name, (node, []))[1].append((i, asking))
        opened = []
        try:
            for node, batch in shards.values():
                client = cluster.get_redis_connection(node)
                connection = get_connection(client)
                opened.append((client, connection, batch))
                packed = [c for i, asking in batch for c in ([("ASKING",)] if asking else []) + [commands[i]]]
                connection.send_packed_command(connection.pack_commands(packed))
            for client, connection, batch in opened:
                for i, asking in batch:
                    if asking:
                        _reply(client, connection, "ASKING")
                    replies[i] = _reply(client, connection, commands[i][0])
                    if each is not None and not isinstance(replies[i], Exception):
                        each(i, replies[i])
        except BaseException:
            self._stale = True
            for _, connection, _ in opened:
                connection.disconnect()  # replies may be left unread: never reuse it
            raise
        finally:
            for client, connection, _ in opened:
                client.connection_pool.release(connection)

    def _redirected(self, cluster: RedisCluster, replies: list) -> dict:
        """Commands answered MOVED (to the slot's new owner) or ASK (to the node
        importing it, after ASKING)."""
        todo = {}
        for i, reply in enumerate(replies):
            if isinstance(reply, MovedError):
                cluster.nodes_manager.update_moved_exception(reply)
                todo[i] = (cluster.nodes_manager.get_node_from_slot(reply.slot_id), False)
            elif isinstance(reply, AskError):
                node = cluster.get_node(host=reply.host, port=reply.port)
                if node is not None:
                    todo[i] = (node, True)
        return todo


def _reply(client: redis.Redis, connection, command: str):
    try:
        return client.parse_response(connection, command)
    except redis.ResponseError as e:  # an error reply: the connection is still in step
        return e


class Batch:
    """Single-key commands queued for one ClusterClient.run: a pipeline without MULTI."""

    def __init__(self, client: ClusterClient):
        self.client = client
        self.commands: list[tuple] = []

    def set(self, name: str, value: bytes) -> Batch:
        self.commands.append(("SET", name, value))
        return self

    def get(self, name: str) -> Batch:
        self.commands.append(("GET", name))
        return self

    def exists(self, name: str) -> Batch:
        self.commands.append(("EXISTS", name))
        return self

    def execute(self) -> list:
        commands, self.commands = self.commands, []
        return self.client.run(commands) if commands else []
