"""The remote tier: node files shared through one Redis (or Valkey) server, cluster or
Sentinel-watched primary by many machines.

A node's blob is its cold file, sealed; a chain record at each grid point and
at the end of a published node lists the blobs that tile that prefix. A lookup
costs two round trips whatever the prompt length (every grid key in one MGET,
then the positions of one chunk), and the blobs a third: only those of nodes
the local tiers lack, every piece asked for at once and opened, checked and
made into arrays in memory as it arrives (no file is staged). Anything the
server does wrong (down, slow, restarted empty, evicting, answering garbage) is
a reported miss after a bounded wait, never an exception to the caller. A blob
larger than `piece_bytes` is stored in pieces (seal.py); a Redis Cluster is
spoken to through cluster.py, Sentinels through sentinel.py.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, InvalidResponse, RedisClusterException
from redis.retry import Retry

from ...caches import Snapshot, present_layers
from ...errors import ColdFileError, RemoteError
from ...identity import NodeId
from ..blob import load_bytes
from ..cold import NODE_KEY, ColdTier, NodeFileMeta
from ..safetensors_header import MAX_HEADER, header_of_bytes
from .cluster import SCHEMES as CLUSTER_SCHEMES
from .cluster import ClusterClient, ClusterURL, read_values
from .keys import CHUNK, RemoteKeys, blob_key, index_key
from .seal import MAX_PIECES, Assembly, Chain, Link, seal_chain, seal_pieces, unseal_chain
from .sentinel import SCHEMES as SENTINEL_SCHEMES
from .sentinel import SentinelURL
from .sentinel import connect as connect_sentinel

log = logging.getLogger("promptstore.remote")

RETRY_SECONDS = 2.0  # after a connection failure, calls skip the server this long instead of each waiting out a timeout
QUEUE = 256  # publishes waiting; past this they are dropped (counted), never blocking an insert
LEDGER = "remote.ledger"
CHECK_BATCH = 1000  # keys per pipelined EXISTS when counting what is still on the server
BLOB_SLACK = 8 + MAX_HEADER  # a blob's bytes past its record's count, at most: a safetensors header
PIECE_BYTES = 8 << 20  # a blob over this is stored in pieces of about this size (a value per piece):
# small enough that a reader opens one while the next arrives, and a node spreads over a cluster's shards

# What the remote tier needs of the store: a node's identity, its path and file.
Report = Callable[[str, bytes, str], None]
# A link of a fetched chain -> the snapshots of its node when the local tiers hold it.
Held = Callable[[Link], list[Snapshot] | None]


@dataclass(frozen=True)
class LocalLink:
    """A node on the path of a node to publish, as this store holds it."""

    key: bytes
    start: int
    end: int
    file: str | None
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class PublishItem:
    """A node to publish: its namespace, prefix tokens and the path that tiles them."""

    namespace: bytes
    tokens: np.ndarray  # uint32, exactly [0, links[-1].end)
    links: list[LocalLink]


@dataclass
class RemoteHit:
    """Verified snapshots of the links that tile [0, length) (the last may reach past it).

    fetched: per link, whether its blob came from the server (else the local tiers held it).
    nbytes: sealed bytes fetched.
    """

    length: int
    links: list[Link]
    snapshots: list[list[Snapshot]]
    round_trips: int = 0
    nbytes: int = 0
    fetched: list[bool] = field(default_factory=list)


@dataclass
class _Lookup:
    position: int
    chain: Chain
    round_trips: int


@dataclass
class _Publisher:
    queue: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=QUEUE))
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


def connect(url: str, timeout: float) -> redis.Redis | ClusterClient:
    """A client that fails fast: one try per call, every socket wait bounded; for a
    redis+cluster:// URL, the cluster's shards behind the same calls; for a
    redis+sentinel:// URL, the primary the Sentinels name at each connection."""
    if url.startswith(CLUSTER_SCHEMES):
        return ClusterClient(ClusterURL.parse(url), timeout)
    if url.startswith(SENTINEL_SCHEMES):
        return connect_sentinel(SentinelURL.parse(url), timeout)
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


class RemoteTier:
    """This process's view of the shared server, for every namespace of one store.

    cold: the store's cold tier (what it published is read from its files).
    describe: node key -> PublishItem (or None when the node is gone), run on the
        publishing thread.
    report: (reason, key, detail) for misses an operator should see.
    """

    def __init__(
        self,
        url: str,
        cold: ColdTier,
        describe: Callable[[bytes], PublishItem | None],
        report: Report,
        *,
        secret: str | None = None,
        timeout: float = 0.5,
        close_seconds: float = 10.0,
        piece_bytes: int = PIECE_BYTES,
    ):
        self.client = connect(url, timeout)
        self.cluster = isinstance(self.client, ClusterClient)
        self.cold, self.describe, self.report = cold, describe, report
        self.secret, self.close_seconds = secret, close_seconds
        self.piece_bytes = piece_bytes  # publishers of one deployment should agree (readers follow the record)
        self.ledger = cold.root.parent / LEDGER
        self.counts: Counter = Counter()
        self._keys: dict[bytes, RemoteKeys] = {}
        self._down_until = 0.0
        self.last_round_trips = 0  # of the last hit: lookup (1-2) plus blobs (1)
        self.last_fetch = (0, 0.0)  # of the last hit: sealed bytes fetched, seconds to fetch and verify them
        self._lock = threading.Lock()
        self._queued: set[bytes] = set()
        self._pub = _Publisher()
        self._pub.thread = threading.Thread(target=self._run, name="promptstore-remote", daemon=True)
        self._pub.thread.start()
        self._opening: tuple[int, ThreadPoolExecutor] | None = None

    def keys(self, namespace: bytes) -> RemoteKeys:
        if namespace not in self._keys:
            self._keys[namespace] = RemoteKeys.of(namespace, self.secret)
        return self._keys[namespace]

    # --- failing fast -----------------------------------------------------------------

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, what: str, fn):
        """Run one round trip; RemoteError("down") if the server is unreachable or slow."""
        if not self.available():
            raise RemoteError(f"{what}: the server failed less than {RETRY_SECONDS} s ago", "down")
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException, OSError) as e:
            self._down_until = time.monotonic() + RETRY_SECONDS
            raise RemoteError(f"{what}: {type(e).__name__}: {e}", "down") from None
        except InvalidResponse as e:  # a reply out of step: its connection was closed
            raise RemoteError(f"{what}: {e}", "garbage") from None
        except redis.RedisError as e:  # OOM under noeviction, WRONGTYPE, ...
            raise RemoteError(f"{what}: {e}", "refused") from None

    def _miss(self, error: RemoteError, key: bytes = b"") -> None:
        self.counts[f"remote_{error.reason}"] += 1
        self.report(f"remote_{error.reason}", key, str(error))

    # --- lookup and fetch -------------------------------------------------------------

    def fetch(
        self,
        namespace: bytes,
        tokens: np.ndarray,
        beyond: int,
        node_key: Callable[[int], bytes],
        held: Held | None = None,
    ) -> RemoteHit | None:
        """The deepest prefix of `tokens` longer than `beyond` that the server holds,
        as verified snapshots, or None (a miss, reported when something failed).

        node_key: end -> the local key of the node tokens[:end] (what its file must name).
        held: a link -> its node's snapshots when the local tiers hold that node
            (same span, same tokens); its blob is then not fetched.
        """
        self.counts["remote_lookups"] += 1
        try:
            found = self._lookup(namespace, tokens, beyond)
            if found is None:
                self.counts["remote_misses"] += 1
                return None
            hit = self._load(namespace, tokens, found, node_key, held)
        except RemoteError as e:
            self._miss(e)
            self.counts["remote_misses"] += 1
            return None
        if hit is None or hit.length <= beyond:
            self.counts["remote_misses"] += 1
            return None
        self.counts["remote_hits"] += 1
        self.last_round_trips = hit.round_trips
        return hit

    def _lookup(self, namespace: bytes, tokens: np.ndarray, beyond: int) -> _Lookup | None:
        """Round trip 1: every grid key past `beyond`; round trip 2: every position
        of the chunk after the deepest grid key found. The deepest record that
        opens and covers its position wins."""
        keys, n = self.keys(namespace), len(tokens)
        grid = keys.grid(tokens, n)
        grid_at = [j * CHUNK for j in range(1, len(grid)) if j * CHUNK > beyond]
        values = self._mget("lookup", [index_key(grid[p // CHUNK]) for p in grid_at]) if grid_at else []
        found = {p: v for p, v in zip(grid_at, values) if v is not None}
        base = max(found, default=(beyond // CHUNK) * CHUNK)
        lo, hi = max(beyond, base) + 1, min(n, base + CHUNK - 1)
        tail = keys.positions(grid, tokens, lo, hi) if lo <= hi else {}
        if tail:
            found.update({p: v for p, v in zip(tail, self._mget("lookup", [index_key(k) for k in tail.values()])) if v})
        trips = int(bool(grid_at)) + int(bool(tail))
        for p in sorted(found, reverse=True):
            key = keys.position(tokens, p, grid) if p not in tail else tail[p]
            try:
                chain = unseal_chain(keys.seal, found[p], index_key(key))
            except RemoteError as e:
                self._miss(e, key)
                continue
            links = [link for link in chain.links if link.start < p]
            if chain.end >= p and links:
                return _Lookup(p, Chain(links=links), trips)
            self._miss(RemoteError(f"record at {index_key(key)[:20]}… does not cover its position", "garbage"), key)
        return None

    def _mget(self, what: str, names: list[str]) -> list:
        return self._call(what, lambda: self.client.mget(names))

    def _load(self, namespace: bytes, tokens, found: _Lookup, node_key, held: Held | None = None) -> RemoteHit | None:
        """Round trip 3: the blobs of the chain's links the local tiers do not hold,
        every piece asked for at once; each opened into place as it arrives, then
        verified in memory as the cold loader verifies a file. The hit ends before
        the first link that fails."""
        keys, links = self.keys(namespace), found.chain.links
        local = self._held(links, found.position, held)
        names = {
            i: keys.pieces(bytes.fromhex(link.blob), link.pieces) for i, link in enumerate(links) if i not in local
        }
        started = time.perf_counter()
        blobs = self._open_pieces(keys.seal, links, names) if names else {}
        hit = RemoteHit(0, [], [], found.round_trips + bool(names))
        for i, link in enumerate(links):
            snaps = local.get(i)
            if snaps is None:
                whole = link.end <= found.position  # the tokens agree to the node's end
                try:
                    snaps = self._verified(namespace, link, blobs[i].data(), node_key(link.end) if whole else None)
                except RemoteError as e:
                    self._miss(e, bytes.fromhex(link.blob))
                    break
                hit.nbytes += blobs[i].nbytes
            hit.links.append(link)
            hit.snapshots.append(snaps)
            hit.fetched.append(i not in local)
            hit.length = min(link.end, found.position)
        self.last_fetch = (hit.nbytes, time.perf_counter() - started)
        return hit if hit.links else None

    def _held(self, links: list[Link], position: int, held: Held | None) -> dict[int, list[Snapshot]]:
        """Snapshots the local tiers hold of the chain's nodes, by link index: of nodes
        the prompt covers to their end, the chain's last only if it holds every layer
        (a restore ends there)."""
        if held is None:
            return {}
        out = {}
        for i, link in enumerate(links):
            if link.end > position:
                break
            snaps = held(link)
            if snaps is not None and (i < len(links) - 1 or all(present_layers(snaps))):
                out[i] = snaps
        self.counts["remote_links_local"] += len(out)
        return out

    def _open_pieces(self, seal_key: bytes, links: list[Link], names: dict[int, list[str]]) -> dict[int, Assembly]:
        """Every piece of the blobs `names` (link index -> its pieces' keys), asked
        for in one round trip; each read into a buffer and opened on the opening
        thread as soon as it is read, while the next ones arrive."""
        blobs = {i: Assembly(seal_key, pieces, links[i].nbytes + BLOB_SLACK) for i, pieces in names.items()}
        order = [(i, j) for i, pieces in names.items() for j in range(len(pieces))]
        buffers = _Buffers()
        opening = []

        def into(k: int, length: int) -> memoryview | None:
            return buffers.take(length) if length <= blobs[order[k][0]].longest else None

        def arrived(k: int, value) -> None:
            i, j = order[k]
            opening.append(self._opener().submit(_open, blobs[i], j, value, buffers))

        try:
            self._call("fetch", lambda: self._stream([names[i][j] for i, j in order], arrived, into))
        finally:
            for done in opening:
                done.result()  # `add` keeps a bad piece as its blob's error; never raises
        self.counts["remote_fetched_values"] += len(order)
        self.counts["remote_fetched_bytes"] += sum(blob.nbytes for blob in blobs.values())
        return blobs

    def _opener(self) -> ThreadPoolExecutor:
        """The thread that opens fetched pieces while the calling thread reads the
        next ones off the socket (this process's: a forked child makes its own)."""
        with self._lock:
            if self._opening is None or self._opening[0] != os.getpid():
                self._opening = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="promptstore-remote-open"))
            return self._opening[1]

    def _stream(self, names: list[str], each: Callable[[int, object], None], into) -> None:
        """GET every name in one round trip, each value read into into(index, length)
        and handed to each(index, value) as soon as it is read (None where absent);
        the first error reply is raised after the last."""
        commands = [("GET", name) for name in names]
        if self.cluster:
            self.client.run(commands, each, into)
            return
        pool = self.client.connection_pool
        connection = pool.get_connection()
        clean = False
        try:
            connection.send_packed_command(connection.pack_commands(commands))
            errors = read_values(connection, len(names), into, each)
            clean = True
        finally:
            if not clean:
                connection.disconnect()  # replies may be left unread: never reuse it
            pool.release(connection)
        if errors:
            raise errors[min(errors)]

    def _verified(self, namespace: bytes, link: Link, data: memoryview, key: bytes | None) -> list[Snapshot]:
        """The blob's snapshots, verified as the cold loader verifies a file of node
        `key` spanning the link (key None: the node the blob names, for a node the
        prompt leaves inside, whose end this prompt cannot name)."""
        where = f"blob {link.blob[:12]}"
        try:
            if key is None:
                key = _claimed_key(data, where)
            return load_bytes(data, NodeId(key, namespace, link.start, link.end), where)
        except ColdFileError as e:
            raise RemoteError(str(e), "garbage") from None

    # --- publishing -------------------------------------------------------------------

    def submit(self, node_key: bytes) -> None:
        """Queue a node (already in a cold file) for publishing; never blocks."""
        with self._lock:
            if node_key in self._queued:
                return  # a node spilled twice before its publish ran goes once
            self._queued.add(node_key)
        try:
            self._pub.queue.put_nowait(node_key)
        except queue.Full:
            with self._lock:
                self._queued.discard(node_key)
            self.counts["remote_publish_dropped"] += 1

    def _run(self) -> None:
        q = self._pub.queue
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                with self._lock:
                    self._queued.discard(item)
                if not self._pub.stop.is_set():
                    self._publish_node(item)
            except Exception:  # a bug must not kill the publisher silently
                log.exception("publishing %s failed", item.hex()[:12] if item else item)
                self.counts["remote_publish_failed"] += 1
            finally:
                q.task_done()

    def _publish_node(self, node_key: bytes) -> None:
        item = self.describe(node_key)
        if item is None:
            self.counts["remote_publish_gone"] += 1
            return
        try:
            sent = self.publish(item)
        except RemoteError as e:
            self.counts["remote_publish_failed"] += 1
            self._miss(e, node_key)
            return
        self.counts["remote_published"] += sent

    def publish(self, item: PublishItem) -> int:
        """Put a node's blob (and those of its path the server lacks) and the chain
        records of their positions on the server; returns the blobs sent."""
        keys, tokens = self.keys(item.namespace), item.tokens
        grid = keys.grid(tokens, len(tokens))
        chain, ids = [], []
        for link in item.links:
            bid = keys.blob(keys.position(tokens, link.end, grid), link.start)
            ids.append(bid)
            span = {"start": link.start, "end": link.end, "nbytes": link.nbytes, "seconds": link.seconds}
            chain.append(Link(blob=bid.hex(), pieces=self._piece_count(link.nbytes), **span))
        names = [keys.pieces(bid, link.pieces) for bid, link in zip(ids, chain)]
        missing = self._missing(names)
        blobs = {i: self._file_bytes(item.links[i]) for i in missing}
        if any(data is None for data in blobs.values()):
            self.counts["remote_publish_incomplete"] += 1  # a node of the path is in no file here
            return 0
        pipe = self.client.pipeline(transaction=False)
        for i, data in blobs.items():
            for name, value in zip(names[i], seal_pieces(keys.seal, data, names[i])):
                pipe.set(name, value)
        if self.cluster and blobs:  # shards apply their parts side by side: blobs land before records name them
            self._call("publish", pipe.execute)
        # Records after blobs: a record never names a blob the server has not been sent.
        # The node's own records are written even when its blob is there (they may be evicted).
        for i in sorted({*missing, len(ids) - 1}):
            for p in _record_positions(item.links[i]):
                name = index_key(keys.position(tokens, p, grid))
                pipe.set(name, seal_chain(keys.seal, Chain(links=chain[: i + 1]), name))
        self._call("publish", pipe.execute)
        self.counts["remote_published_bytes"] += sum(len(d) for d in blobs.values())
        self._append_ledger([(ids[i], item.links[i]) for i in missing])
        return len(missing)

    def _piece_count(self, nbytes: int) -> int:
        """Values a node's blob is stored in: one up to piece_bytes, then one per piece_bytes."""
        return min(MAX_PIECES, max(1, -(-nbytes // self.piece_bytes)))

    def _missing(self, names: list[list[str]]) -> list[int]:
        """Indices of path blobs the server lacks, or lacks a piece of (one pipelined
        round trip). Every link is asked each time, those this process sent too: a
        failover, an eviction or a restart may have lost them since, and a record
        must never name what is gone."""
        pipe = self.client.pipeline(transaction=False)
        for pieces in names:
            for name in pieces:
                pipe.exists(name)
        present = iter(self._call("publish", pipe.execute))
        return [i for i, pieces in enumerate(names) if not all([next(present) for _ in pieces])]

    def _file_bytes(self, link: LocalLink) -> bytes | None:
        if link.file is None:
            return None
        try:
            return self.cold.absolute(link.file).read_bytes()
        except (OSError, ColdFileError):
            return None  # re-filed or evicted meanwhile

    def _append_ledger(self, sent: list[tuple[bytes, LocalLink]]) -> None:
        """What this store published (blob ids, node keys, sizes: no token, no span)."""
        lines = "".join(
            json.dumps({"blob": bid.hex(), "node": link.key.hex(), "nbytes": link.nbytes, "at": round(time.time())})
            + "\n"
            for bid, link in sent
        )
        try:
            fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.cold.file_mode)
            with os.fdopen(fd, "a") as f:
                f.write(lines)
        except OSError as e:
            log.warning("could not append to %s: %s", self.ledger, e)

    def summary(self, node_exists: Callable[[bytes], bool]) -> dict:
        """ledger_summary for this store, with this process's counters."""
        client = self.client if self.available() else None
        return {**ledger_summary(self.cold.root.parent, client, node_exists), "counts": dict(self.counts)}

    # --- shutdown ---------------------------------------------------------------------

    def flush(self, seconds: float | None = None) -> bool:
        """Wait (at most `seconds`, default the close setting) for queued publishes;
        True if none is left."""
        q = self._pub.queue
        deadline = time.monotonic() + (self.close_seconds if seconds is None else seconds)
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                q.all_tasks_done.wait(left)
        return True

    def close(self) -> None:
        """Wait (bounded) for queued publishes, then drop what is left."""
        if not self.flush():
            self.counts["remote_publish_abandoned"] += self._pub.queue.qsize()
            log.warning("remote publishes still queued after %.1f s were dropped", self.close_seconds)
        self._pub.stop.set()
        try:
            self._pub.queue.put_nowait(None)
        except queue.Full:
            pass  # the thread is a daemon and skips the rest once stop is set
        if self._opening is not None:
            self._opening[1].shutdown(wait=True)  # what it has left is bounded work on bytes in memory
        self.client.close()


class _Buffers:
    """What fetched values are read into, each used again once its piece has opened:
    a fetch writes a few pieces' worth of fresh memory, not the whole blob's."""

    def __init__(self):
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self, length: int) -> memoryview:
        with self.lock:
            for k, buffer in enumerate(self.free):
                if len(buffer) >= length:
                    return memoryview(self.free.pop(k))[:length]
        return memoryview(np.empty(length, np.uint8))

    def give(self, value: memoryview) -> None:
        with self.lock:
            self.free.append(value.obj)


def _open(blob: Assembly, index: int, value, buffers: _Buffers) -> None:
    """Open a piece into its blob (on the opening thread), its buffer then free."""
    if blob.add(index, value) and isinstance(value, memoryview):
        buffers.give(value)


def _record_positions(link: LocalLink) -> list[int]:
    """Where a published node is findable: every grid point in (start, end], and end."""
    first = (link.start // CHUNK + 1) * CHUNK
    return sorted({*range(first, link.end + 1, CHUNK), link.end})


def _claimed_key(data: memoryview, where: str) -> bytes:
    try:
        meta = NodeFileMeta.model_validate_json(header_of_bytes(data)[1].get(NODE_KEY, ""))
        return bytes.fromhex(meta.key)
    except ValueError as e:
        raise RemoteError(f"{where}: without a node record: {e}", "garbage") from None


# --- what this store published (for stats and compact) ----------------------------------


def ledger_summary(
    store_root: str | os.PathLike, client: redis.Redis | ClusterClient | None, node_exists: Callable[[bytes], bool]
):
    """What this store published to the remote tier, and how much of it is stale.

    published: blobs this store sent (and their bytes); on_server: still there;
    evicted: gone from the server (evicted, flushed or restarted empty); local_gone:
    published nodes this store no longer holds (their blobs still serve others).
    client None (no remote configured or reachable): server columns are None.
    """
    entries = read_ledger(Path(store_root) / LEDGER)
    out = {
        "published": len(entries),
        "published_bytes": sum(e["nbytes"] for e in entries.values()),
        "local_gone": sum(1 for e in entries.values() if not node_exists(bytes.fromhex(e["node"]))),
        "on_server": None,
        "evicted": None,
    }
    if client is not None and entries:
        try:
            there = _exists(client, list(entries))
        except (redis.RedisError, RedisClusterException, OSError):
            return out
        out["on_server"] = sum(there)
        out["evicted"] = len(there) - sum(there)
    elif client is not None:
        out["on_server"] = out["evicted"] = 0
    return out


def read_ledger(path: Path) -> dict[str, dict]:
    """The ledger's entries by blob id (the last line for a blob wins; a torn line is skipped)."""
    entries: dict[str, dict] = {}
    try:
        text = path.read_text()
    except OSError:
        return entries
    for line in text.splitlines():
        try:
            e = json.loads(line)
            if isinstance(e, dict) and isinstance(e.get("blob"), str) and isinstance(e.get("nbytes"), int):
                bytes.fromhex(e["blob"]), bytes.fromhex(e["node"])
                entries[e["blob"]] = e
        except (ValueError, KeyError, TypeError):
            continue
    return entries


def prune_ledger(store_root: str | os.PathLike, client: redis.Redis | ClusterClient) -> int:
    """Drop ledger entries whose blob the server no longer has; returns how many."""
    path = Path(store_root) / LEDGER
    entries = read_ledger(path)
    if not entries:
        return 0
    there = _exists(client, list(entries))
    keep = [e for e, ok in zip(entries.values(), there) if ok]
    temp = path.with_name(path.name + f".tmp-{os.getpid()}")
    temp.write_text("".join(json.dumps(e) + "\n" for e in keep))
    os.replace(temp, path)
    return len(entries) - len(keep)


def _exists(client: redis.Redis | ClusterClient, blob_ids: list[str]) -> list[bool]:
    out = []
    for i in range(0, len(blob_ids), CHECK_BATCH):
        pipe = client.pipeline(transaction=False)
        for bid in blob_ids[i : i + CHECK_BATCH]:
            pipe.exists(blob_key(bytes.fromhex(bid)))
        out.extend(bool(x) for x in pipe.execute())
    return out
