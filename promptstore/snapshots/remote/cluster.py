"""A Redis Cluster as the remote tier's server: every key lives on the primary of
its hash slot, so a namespace's blobs spread over every shard. Commands go to
all the shards they need in one round trip (written to every shard before any
reply is read), with one try, as the single-server client: a failure raises,
and the next call asks the cluster again which shard serves which slot.

Replies to a fetch's GETs, from a shard or from one server, are read off the
socket straight into buffers the caller hands out (`read_values`): no parser's
buffer and no bytes object per value between the kernel and the decryption.
Each shard's values are read on a thread of their own, so the shards send side
by side instead of each waiting for the one before to be read.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis._parsers import BaseParser
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster, get_connection
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    InvalidResponse,
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
LINE = 64 << 10  # the most bytes read ahead for a reply's first line (the rest of a value is read into place)
READERS = 15  # threads reading shards' values beside the calling thread (a shard each)

# (reply index, value length) -> the writable buffer of exactly that length the value is read into,
# or None when the caller takes no value that long.
Into = Callable[[int, int], memoryview | None]


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
        hosts = HostsURL.split(url, "cluster")
        return cls(hosts.nodes, hosts.tls, hosts.username, hosts.password, hosts.tls_options(parse_qsl(hosts.query)))


@dataclass(frozen=True)
class HostsURL:
    """A redis+<kind>:// or rediss+<kind>:// URL naming several nodes, split."""

    nodes: tuple[tuple[str, int], ...]  # in order, each once
    tls: bool
    username: str | None
    password: str | None
    path: str
    query: str

    @classmethod
    def split(cls, url: str, kind: str) -> HostsURL:
        scheme, _, rest = url.partition("://")
        cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
        # urlsplit of the rest alone: some Pythons refuse text before a bracketed host in a netloc
        parts = urlsplit(f"{scheme}://host{rest[cut:]}")._replace(netloc=rest[:cut])
        if parts.scheme not in (f"redis+{kind}", f"rediss+{kind}"):
            raise ValueError(f"{parts.scheme}://: not a redis+{kind}:// or rediss+{kind}:// URL")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        nodes = [node.rpartition(":") for node in hosts.split(",")]
        if not all(host and port.isdigit() for host, _, port in nodes):
            raise ValueError(f"{hosts!r}: not a list of host:port")
        user, sep, password = userinfo.partition(":")
        return cls(
            tuple(dict.fromkeys((host.strip("[]"), int(port)) for host, _, port in nodes)),
            parts.scheme == f"rediss+{kind}",
            unquote(user) or None,
            unquote(password) if sep else None,
            parts.path,
            parts.query,
        )

    def tls_options(self, options: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
        """The ssl_* options among `options` (TLS only)."""
        return tuple((k, v) for k, v in options if k.startswith("ssl_")) if self.tls else ()


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
        self._readers: tuple[int, ThreadPoolExecutor] | None = None  # (pid, threads) reading shards

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
        with self._lock:
            readers, self._readers = self._readers, None
        if readers is not None and readers[0] == os.getpid():
            readers[1].shutdown(wait=True)  # each read is bounded by the socket timeout
        if self._cluster is not None:
            self._cluster.close()

    def _reader_threads(self) -> ThreadPoolExecutor:
        """The threads that read shards' values beside the calling thread (this
        process's: a forked child makes its own)."""
        with self._lock:
            if self._readers is None or self._readers[0] != os.getpid():
                self._readers = (os.getpid(), ThreadPoolExecutor(READERS, thread_name_prefix="promptstore-shard"))
            return self._readers[1]

    # --- one round trip to every shard --------------------------------------------------

    def run(
        self, commands: list[tuple], each: Callable[[int, object], None] | None = None, into: Into | None = None
    ) -> list:
        """Replies to commands (name, key, ...) whose keys all hash to one slot, in
        order; the first error reply is raised, as a redis-py pipeline does.

        each: called with (index, reply) as each reply other than an error is read,
        while the others are still arriving (a shard's in order; with `into`, from
        the thread reading that shard, the shards side by side).
        into: when every command is a GET, where each value is read (read_values);
        the replies are then those buffers (None where absent).
        """
        cluster = self.topology()
        replies: list = [None] * len(commands)
        try:
            todo = {i: (self._owner(cluster, command[1]), False) for i, command in enumerate(commands)}
            for attempt in range(1 + REDIRECTS):
                self._send(cluster, commands, todo, replies, each, into)
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

    def _send(
        self, cluster: RedisCluster, commands: list[tuple], todo: dict, replies: list, each=None, into=None
    ) -> None:
        """Write each shard's commands, then read the replies (error replies kept as
        values, others also handed to `each`); a connection failure, or a reply out
        of step, closes every connection used and raises."""
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
            if into is not None:
                self._read_shards(opened, replies, each, into)
            for client, connection, batch in opened if into is None else ():
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

    def _read_shards(self, opened: list, replies: list, each, into: Into) -> None:
        """Every shard's values (GETs), each shard read on its own thread (the first
        on this one) while the others arrive. Waits for every read to end (each
        bounded by its socket's timeout, and none left using a connection), then
        raises the first shard's error, if any."""
        if len(opened) == 1:
            _, connection, batch = opened[0]
            _read_values(connection, batch, replies, each, into)
            return
        threads = self._reader_threads()
        others = [threads.submit(_read_values, c, b, replies, each, into) for _, c, b in opened[1:]]
        first: BaseException | None = None
        try:
            _, connection, batch = opened[0]
            _read_values(connection, batch, replies, each, into)
        except BaseException as e:
            first = e
            for _, c, _ in opened[1:]:
                _shut(c)  # the other reads end at once, not at their timeouts
        for done in others:
            error = done.exception()
            first = first if first is not None else error
        if first is not None:
            raise first

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


def _shut(connection) -> None:
    """End every read of a connection's socket now (a blocked one returns, the next
    finds it closed) without closing it: the thread still reading it holds its
    descriptor, which must not be freed for another file to take meanwhile. The
    caller disconnects it once every read has ended."""
    sock = connection._sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the server's side


def _read_values(connection, batch: list[tuple[int, bool]], replies: list, each, into: Into) -> None:
    """A shard's replies to GETs (each after an ASKING's +OK where asked), by read_values."""

    def got(k: int, value) -> None:
        replies[batch[k][0]] = value
        if each is not None:
            each(batch[k][0], value)

    errors = read_values(connection, len(batch), lambda k, n: into(batch[k][0], n), got, [a for _, a in batch])
    for k, error in errors.items():
        replies[batch[k][0]] = error


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


# --- replies to GETs, read straight into place -----------------------------------------


def read_values(
    connection, count: int, into: Into, each: Callable[[int, object], None], asking: Sequence[bool] = ()
) -> dict[int, redis.ResponseError]:
    """The replies to `count` pipelined GETs (asking[k]: GET k follows an ASKING),
    read off the connection's socket: each value straight into into(k, length),
    then each(k, that buffer), or each(k, None) for a nil; a value `into` does
    not take is read past and handed over as b"" (no sealed value); error
    replies are returned by index (the connection is still in step).

    Any other reply (the connection out of step), a short read or a timeout
    raises; the caller must then disconnect.
    """
    reader = _Replies(connection)
    errors: dict[int, redis.ResponseError] = {}
    for k in range(count):
        if k < len(asking) and asking[k]:
            reader.status()
        kind, rest = reader.line()
        if kind == b"-":
            errors[k] = BaseParser.parse_error(rest.decode("utf-8", "replace"))
        elif kind == b"_" or (kind == b"$" and rest == b"-1"):  # nil (RESP3, RESP2)
            each(k, None)
        elif kind == b"$" and rest.isdigit() and len(rest) <= 18:
            view = into(k, int(rest))
            if view is None:
                reader.skip(int(rest))
                view = b""
            else:
                reader.fill(view)
            each(k, view)
        else:
            raise InvalidResponse(f"reply {k}: {kind + rest[:32]!r}, not a reply to GET")
    reader.finish()
    return errors


class _Replies:
    """A connection's socket read by hand: lines through a small read-ahead, values
    with recv_into into the caller's buffer (what was read ahead first). The
    socket's timeout bounds every wait, as it bounds redis-py's reads."""

    def __init__(self, connection):
        self.sock = connection._sock
        if self.sock is None:
            raise redis.ConnectionError("not connected")
        self.ahead = bytearray()

    def line(self) -> tuple[bytes, bytes]:
        """A reply's first line: (its type byte, the rest), CRLF left out."""
        while (end := self.ahead.find(b"\r\n")) < 0:
            if len(self.ahead) > LINE:
                raise InvalidResponse("a reply line without its end")
            self.ahead += self._recv(LINE)
        line = bytes(self.ahead[:end])
        del self.ahead[: end + 2]
        if not line:
            raise InvalidResponse("an empty reply line")
        return line[:1], line[1:]

    def status(self) -> None:
        kind, rest = self.line()
        if kind != b"+":
            raise InvalidResponse(f"{kind + rest[:32]!r} where ASKING's +OK belongs")

    def fill(self, view: memoryview) -> None:
        """Exactly len(view) bytes into view, then the value's CRLF."""
        done = min(len(self.ahead), len(view))
        view[:done] = self.ahead[:done]
        del self.ahead[:done]
        while done < len(view):
            done += self._recv_into(view[done:])
        self._end()

    def skip(self, n: int) -> None:
        """A value of n bytes read and dropped, a bounded buffer at a time."""
        scratch = memoryview(bytearray(min(n, LINE)))
        done = min(len(self.ahead), n)
        del self.ahead[:done]
        while done < n:
            done += self._recv_into(scratch[: min(n - done, len(scratch))])
        self._end()

    def _end(self) -> None:
        while len(self.ahead) < 2:
            self.ahead += self._recv(2 - len(self.ahead))
        if self.ahead[:2] != b"\r\n":
            raise InvalidResponse("a value longer than its length says")
        del self.ahead[:2]

    def finish(self) -> None:
        if self.ahead:
            raise InvalidResponse(f"{len(self.ahead)} bytes past the last reply")

    def _recv(self, n: int) -> bytes:
        return self._read(self.sock.recv, n, "the server closed the connection")

    def _recv_into(self, view: memoryview) -> int:
        return self._read(self.sock.recv_into, view, "the server closed the connection mid-value")

    @staticmethod
    def _read(call, arg, closed: str):
        """A socket read, its timeout and an empty read as redis-py's errors."""
        try:
            got = call(arg)
        except TimeoutError:
            raise redis.TimeoutError("timeout reading from the server") from None
        if not got:
            raise redis.ConnectionError(closed)
        return got
