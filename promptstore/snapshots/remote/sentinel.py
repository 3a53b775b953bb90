"""A primary that Redis Sentinels watch as the remote tier's server.

The Sentinels are asked which server is the primary of a service whenever a
connection is made, and every second by a thread of the client's: after a
failover (the primary lost, a replica promoted by the Sentinels) the next
connection goes to the new primary, while the calls in between are misses like
any other of a server that is down; no call waits for the Sentinels unless it
makes a connection. A server that turns out to be a replica (a primary demoted
while a connection to it was kept) refuses the first write, which closes the
connection; what it answers to reads is checked as everything the server sends
is. The calls are those of one server: redis-py's Sentinel support gives a
client of the same shape, with the remote tier's bounds (one try per call,
every socket wait bounded) on the Sentinels' connections as on the primary's.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from urllib.parse import parse_qsl

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from .cluster import HostsURL

log = logging.getLogger("promptstore.remote")

SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
# How often the Sentinels are asked again which server is the primary (redis-py
# asks only when it makes a connection).
RECHECK_SECONDS = 1.0


@dataclass(frozen=True)
class SentinelURL:
    """The Sentinels of one service, and how to reach them and its primary."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None  # the primary's (and its replicas')
    password: str | None = None
    sentinel_username: str | None = None  # the Sentinels' own, where they ask for one
    sentinel_password: str | None = None
    tls_options: tuple[tuple[str, str], ...] = ()  # ssl_ca_certs, ssl_cert_reqs, ... (TLS only)

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        """redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]
        [?sentinel_username=...&sentinel_password=...] (rediss+sentinel://: TLS),
        as Settings checked it; ValueError where it cannot be split."""
        hosts = HostsURL.split(url, "sentinel")
        service, _, db = hosts.path[1:].partition("/")
        if not service:
            raise ValueError("no service name after the Sentinels' addresses")
        options = parse_qsl(hosts.query)
        named = dict(options)
        return cls(
            hosts.nodes,
            service,  # Settings allowed letters, digits, "_", "." and "-" only
            int(db) if db else 0,
            hosts.tls,
            hosts.username,
            hosts.password,
            named.get("sentinel_username"),
            named.get("sentinel_password"),
            hosts.tls_options(options),
        )


def connect(url: SentinelURL, timeout: float) -> redis.Redis:
    """A client of the service's primary, found through the Sentinels at each new
    connection; nothing is asked before the first call."""
    bounded = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    tls = {"ssl": True, **dict(url.tls_options)} if url.tls else {}
    to_sentinels = {**bounded, **tls, "username": url.sentinel_username, "password": url.sentinel_password}
    sentinels = Sentinel(list(url.sentinels), sentinel_kwargs=to_sentinels)
    return sentinels.master_for(
        url.service,
        connection_pool_class=FollowingPool,
        db=url.db,
        username=url.username,
        password=url.password,
        **bounded,
        **tls,
    )


class FollowingPool(SentinelConnectionPool):
    """redis-py's pool of connections to the primary, with a thread that asks the
    Sentinels which server that is every RECHECK_SECONDS, not only when a
    connection is made: a failover with the primary alive (an operator's
    SENTINEL FAILOVER) leaves it taking writes until the Sentinels demote it,
    about ten seconds later, and redis-py would keep its idle connections to it
    all that time; here they are closed within a second of the switch (what was
    written there meanwhile is lost with it: misses, never wrong data). The
    thread is started at first use (again in a forked child), waits for the
    Sentinels off every call's path, and ends when the client is closed or
    the pool is gone."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stop = threading.Event()
        self._follower: int | None = None  # the pid the following thread runs in
        self._follower_lock = threading.Lock()

    def get_connection(self, *args, **kwargs):
        if self._follower != os.getpid():
            self._start_following()
        return super().get_connection(*args, **kwargs)

    def _start_following(self) -> None:
        with self._follower_lock:
            if self._follower != os.getpid():
                name = "promptstore-sentinel"
                threading.Thread(target=_follow, args=(weakref.ref(self), self._stop), name=name, daemon=True).start()
                self._follower = os.getpid()

    def disconnect(self, inuse_connections: bool = True) -> None:
        if inuse_connections:  # the client is closing (a new primary closes only the idle ones)
            self._stop.set()
        super().disconnect(inuse_connections)


def _follow(pool_of: weakref.ref, stop: threading.Event) -> None:
    """Ask the Sentinels for the primary every RECHECK_SECONDS, closing the idle
    connections to a server that is the primary no more, until `stop` or the pool is gone."""
    while not stop.wait(RECHECK_SECONDS):
        pool = pool_of()
        if pool is None:
            return
        try:
            pool.get_master_address()
        except (redis.RedisError, OSError):
            pass  # no Sentinel answered: the connections in use go on, a new one cannot be made
        except Exception:  # a thread of its own: say it, and go on following
            log.exception("asking the Sentinels for the primary failed")
        del pool
