"""The LMDB environment of one store: named databases, schema version and map growth.

LMDB must not open the same file twice in one process, so environments live in a
per-process registry and are shared, refcounted, by every Index on that path.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import lmdb

from promptstore.errors import (
    IndexCorruptError,
    IndexDiskError,
    IndexStoreError,
    ReadOnlyIndexError,
    SchemaVersionError,
)

SCHEMA_VERSION = 3
# 1: namespace specs held tenant salts in clear; upgraded by the first writable open (upgrade.py).
# 2: no record names a file of a wider span (NodeRecord.file_node): code that reads
#    only 2 would call such a record corrupt, so 3 keeps it out; upgraded in place.
READABLE_SCHEMAS = (1, 2, 3)
DEFAULT_MAP_SIZE = 64 << 20
DB_NAMES = ("namespaces", "nodes", "edges", "children", "access", "counters", "meta")
SCHEMA_KEY = b"schema_version"
MAX_READERS = 512  # one slot per concurrently open read txn, across all processes
_MAX_GROWTHS = 48  # doublings; far past any disk
_RESIZE_WAIT_S = 60.0

# What LMDB says of pages that are not what they should be (it has no checksums of
# its own, so this is what it happens to notice).
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError)

# What LMDB says when the disk refuses a commit's pages (a full, read-only or failing
# disk): the transaction is undone, and writes work again once the disk takes them.
# py-lmdb has a class for ENOSPC and EROFS; EIO and EDQUOT come as its base class.
DISK = (lmdb.DiskError, lmdb.ReadonlyError)
DISK_WORDS = ("Input/output error", "Disk quota exceeded", "No space left on device", "Read-only file system")


def refused_by_disk(error: lmdb.Error) -> bool:
    return isinstance(error, DISK) or any(w in str(error) for w in DISK_WORDS)


T = TypeVar("T")
C = TypeVar("C")


@dataclass(frozen=True)
class Dbs:
    """Handles of the named databases."""

    namespaces: object
    nodes: object
    edges: object
    children: object
    access: object
    counters: object
    meta: object


class _Gate:
    """Lets transactions run, or one map resize (which invalidates every open one).

    Transactions take no lock, so a stream of readers can never starve a resize:
    each thread counts its own open transactions, and a resize closes the gate and
    waits for every count to drop to zero. The GIL makes these plain reads and
    writes of Python attributes sequentially consistent.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._counts: weakref.WeakSet[_Count] = weakref.WeakSet()
        self._counts_lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._resize_lock = threading.Lock()

    def enter(self) -> None:
        count = self._count()
        while True:
            count.open += 1
            if self._open.is_set():
                return
            count.open -= 1
            self._open.wait()

    def leave(self) -> None:
        self._count().open -= 1

    def exclusive(self, fn: Callable[[], None]) -> None:
        with self._resize_lock:
            self._open.clear()
            try:
                self._drain()
                fn()
            finally:
                self._open.set()

    def _drain(self) -> None:
        deadline = time.monotonic() + _RESIZE_WAIT_S
        while True:
            with self._counts_lock:
                busy = any(count.open for count in self._counts)
            if not busy:
                return
            if time.monotonic() > deadline:
                raise IndexStoreError("cannot resize the LMDB map: transactions stay open")
            time.sleep(0.0002)

    def _count(self) -> _Count:
        count = getattr(self._local, "count", None)
        if count is None:
            count = self._local.count = _Count()
            with self._counts_lock:
                self._counts.add(count)
        return count


class _Count:
    """Open transactions of one thread."""

    __slots__ = ("__weakref__", "open")

    def __init__(self) -> None:
        self.open = 0


class Environment:
    """One open LMDB environment and its databases."""

    def __init__(self, path: str, env: lmdb.Environment, dbs: Dbs, readonly: bool) -> None:
        self.path = path
        self.env = env
        self.dbs = dbs
        self.readonly = readonly
        self.refs = 0
        self.pid = os.getpid()
        self._gate = _Gate()

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A read transaction whose values are buffers, valid only inside the block."""
        txn = self._begin(write=False)
        try:
            yield txn
        except DAMAGE as e:
            raise IndexCorruptError(f"LMDB index at {self.path} is damaged: {e}") from e
        finally:
            txn.abort()
            self._gate.leave()

    def write(
        self,
        apply: Callable[[lmdb.Transaction, C], T],
        check: Callable[[lmdb.Transaction], C] | None = None,
    ) -> T:
        """Run `check(txn)`, then `apply(txn, checked)`, in one write transaction.

        check reads and may refuse with an IndexStoreError before anything is written;
        the empty transaction is then committed, not aborted, because py-lmdb's abort
        can stall for seconds behind reader threads. The map grows when it fills.
        """
        if self.readonly:
            raise ReadOnlyIndexError(f"index at {self.path} was opened read-only")
        for _ in range(_MAX_GROWTHS):
            txn = self._begin(write=True)
            try:
                try:
                    checked = check(txn) if check is not None else None
                except IndexStoreError:
                    txn.commit()
                    raise
                result = apply(txn, checked)
                txn.commit()
                break
            except lmdb.MapFullError:
                pass
            except DAMAGE as e:
                raise IndexCorruptError(f"LMDB index at {self.path} is damaged: {e}") from e
            except lmdb.Error as e:
                if refused_by_disk(e):
                    raise IndexDiskError(f"the disk refused the index's write at {self.path}: {e}") from e
                raise IndexStoreError(f"LMDB write failed at {self.path}: {e}") from e
            finally:
                txn.abort()  # no-op after commit
                self._gate.leave()
            self._resize(self.map_size * 2)
        else:
            raise IndexStoreError(f"LMDB map at {self.path} cannot grow enough")
        self._grow_early()
        return result

    def _grow_early(self) -> None:
        # Growing before the map is full keeps MapFullError, and the abort it forces, rare.
        info = self.env.info()
        if (info["last_pgno"] + 1) * self.env.stat()["psize"] > 0.75 * info["map_size"]:
            self._resize(info["map_size"] * 2)

    @property
    def map_size(self) -> int:
        return self.env.info()["map_size"]

    def _begin(self, write: bool) -> lmdb.Transaction:
        # Another process may have grown the map past ours: adopt its size and retry.
        for _ in range(8):
            self._gate.enter()
            try:
                return self.env.begin(write=write, buffers=True)
            except lmdb.MapResizedError:
                self._gate.leave()
                self._resize(0)
            except lmdb.Error as e:
                self._gate.leave()
                raise IndexStoreError(f"cannot begin a transaction at {self.path}: {e}") from e
            except BaseException:
                self._gate.leave()
                raise
        raise IndexStoreError(f"LMDB map at {self.path} keeps being resized")

    def _resize(self, size: int) -> None:
        try:
            self._gate.exclusive(lambda: self.env.set_mapsize(size))
        except lmdb.Error as e:
            raise IndexStoreError(f"cannot resize the LMDB map at {self.path}: {e}") from e


_registry: dict[str, Environment] = {}
_registry_lock = threading.Lock()


def acquire(path: str | os.PathLike, map_size: int, readonly: bool, sync: bool) -> Environment:
    """The process's Environment for `path`, opened on first use; release() when done."""
    real = os.path.realpath(os.fspath(path))
    with _registry_lock:
        environment = _registry.get(real)
        if environment is not None and environment.pid != os.getpid():
            environment = None  # inherited through fork: LMDB handles must not cross it
        if environment is None:
            environment = _open(real, map_size, readonly, sync)
            _registry[real] = environment
        elif environment.readonly and not readonly:
            raise IndexStoreError(f"index at {real} is already open read-only in this process")
        environment.refs += 1
        return environment


def release(environment: Environment) -> None:
    with _registry_lock:
        environment.refs -= 1
        if environment.refs > 0:
            return
        if _registry.get(environment.path) is environment:
            del _registry[environment.path]
        environment.env.close()


def compact_in_place(path: str) -> int:
    """Swap a compacting copy of the environment at `path` in for its data file."""
    fresh = path.rstrip(os.sep) + ".compact"
    shutil.rmtree(fresh, ignore_errors=True)
    data = os.path.join(path, "data.mdb")
    before = os.stat(data).st_size
    environment = acquire(path, DEFAULT_MAP_SIZE, readonly=False, sync=True)
    try:
        os.makedirs(fresh, mode=0o700)
        environment.env.copy(fresh, compact=True)
    finally:
        release(environment)
    # One atomic rename: a crash leaves either the old map or the new one.
    os.replace(os.path.join(fresh, "data.mdb"), data)
    shutil.rmtree(fresh, ignore_errors=True)
    # Reader slots of the old map; LMDB recreates the lock file on open.
    try:
        os.unlink(os.path.join(path, "lock.mdb"))
    except FileNotFoundError:
        pass
    return max(before - os.stat(data).st_size, 0)


# LMDB 0.9's meta page (two of them, pages 0 and 1): a 16-byte page header, then
# magic, version, map address, map size, the free and main databases (48 bytes each:
# the free one's first field holds the page size; each ends with its root page),
# the last page used and the transaction id.
_META = struct.Struct("<16xIIQQI36xQ40xQQQ")
_META_MAGIC, _META_VERSION = 0xBEEFC0DE, 1
_NO_PAGE = 2**64 - 1  # the root of an empty database


def check_data_file(path: str) -> None:
    """Refuse (IndexCorruptError) a data file LMDB would map past its end.

    LMDB maps data.mdb and trusts its meta pages: a page they name beyond the end
    of a truncated file faults (SIGBUS) when read, killing the process. LMDB writes
    both meta pages when it creates a file, so an empty data.mdb is a lost index,
    not a new one: opening it as an empty store would let compact delete every
    snapshot file it named as an orphan.
    """
    data = os.path.join(path, "data.mdb")
    try:
        fd = os.open(data, os.O_RDONLY)
    except FileNotFoundError:
        return  # a new index
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _META.size, 0)
        page = _page_size(head)
        if page is not None and size >= 2 * page:
            second = os.pread(fd, _META.size, page)
    finally:
        os.close(fd)
    if size == 0:
        raise IndexCorruptError(f"{data} is empty: the index was truncated and is lost ({_REPAIR})")
    if page is None:
        return  # not LMDB's meta page: lmdb.open refuses it
    if size < 2 * page:
        raise IndexCorruptError(f"{data} is {size} bytes, shorter than its two meta pages ({_REPAIR})")
    metas = [_META.unpack(raw) for raw in (head, second) if _page_size(raw) is not None]
    meta = max(metas, key=lambda m: m[-1])  # LMDB uses the newer of the two
    last, roots = meta[-2], (meta[5], meta[6])
    needed = (last + 1) * page
    if size < needed:
        raise IndexCorruptError(
            f"{data} is {size} bytes but its meta page names pages up to byte {needed}: truncated ({_REPAIR})"
        )
    if any(root != _NO_PAGE and root > last for root in roots):
        raise IndexCorruptError(f"{data}: a database root lies past the last page ({_REPAIR})")


_REPAIR = "tools/compact --reset-index sets it aside and starts an empty index"


def set_aside(path: str, dry_run: bool = False) -> str | None:
    """Rename a damaged index directory to `<path>.damaged-<time>` (kept, never deleted),
    so the next open starts an empty one; a sound index is left alone (None). The
    caller holds the store idle: no process may have the index open."""
    if not os.path.isdir(path):
        return None
    try:
        release(acquire(path, DEFAULT_MAP_SIZE, readonly=True, sync=True))
        return None
    except IndexCorruptError:
        pass
    target = f"{path.rstrip(os.sep)}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    if not dry_run:
        os.rename(path, target)
    return target


def _page_size(raw: bytes) -> int | None:
    if len(raw) < _META.size:
        return None
    magic, version, _, _, page = _META.unpack(raw)[:5]
    if magic != _META_MAGIC or version != _META_VERSION or page < 512 or page > 65536 or page & (page - 1):
        return None
    return page


def _open(path: str, map_size: int, readonly: bool, sync: bool) -> Environment:
    if readonly and not os.path.isdir(path):
        raise IndexStoreError(f"no index at {path}")
    if not readonly:
        os.makedirs(path, mode=0o700, exist_ok=True)
    with _opening(path, readonly):
        env = _open_environment(path, map_size, readonly, sync)
    try:
        env.reader_check()  # free reader slots left by crashed processes
        dbs = _open_dbs(env, path, readonly)
    except BaseException:
        env.close()
        raise
    return Environment(path, env, dbs, readonly)


@contextmanager
def _opening(path: str, readonly: bool):
    """Opens of one index, one process at a time. LMDB creates data.mdb and then
    writes its meta pages: another process checking the file in between found it
    empty and took it for a truncated index (two processes opening a new store
    at once, seen in a run of the suite). A read-only open of an index that
    has never been opened for writing takes no lock (it creates no file)."""
    lock = os.path.join(path, "open.lock")
    try:
        fd = os.open(lock, os.O_RDONLY) if readonly else os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        fd = None  # read-only, with no lock file: no writer has ever opened it
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH if readonly else fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # and the lock with it


def _open_environment(path: str, map_size: int, readonly: bool, sync: bool) -> lmdb.Environment:
    check_data_file(path)
    try:
        return lmdb.open(
            path,
            map_size=map_size,
            subdir=True,
            readonly=readonly,
            lock=True,
            sync=sync,
            metasync=sync,
            readahead=False,
            meminit=False,
            mode=0o600,
            max_dbs=len(DB_NAMES) + 1,
            max_readers=MAX_READERS,
            max_spare_txns=4,
        )
    except DAMAGE as e:
        raise IndexCorruptError(f"cannot open LMDB index at {path}: {e} ({_REPAIR})") from e
    except lmdb.Error as e:
        raise IndexStoreError(f"cannot open LMDB index at {path}: {e}") from e


def _open_dbs(env: lmdb.Environment, path: str, readonly: bool) -> Dbs:
    # Another process may grow the map between lmdb.open and the first
    # transaction: adopt its size and try again.
    for _ in range(8):
        try:
            return _open_readonly_dbs(env, path) if readonly else _open_writable_dbs(env)
        except lmdb.MapResizedError:
            env.set_mapsize(0)
        except DAMAGE as e:
            raise IndexCorruptError(f"cannot open the databases of {path}: {e} ({_REPAIR})") from e
        except lmdb.Error as e:
            if isinstance(e, lmdb.NotFoundError):
                raise
            raise IndexStoreError(f"cannot open the databases of {path}: {e}") from e
    raise IndexStoreError(f"LMDB map at {path} keeps being resized")


def _open_writable_dbs(env: lmdb.Environment) -> Dbs:
    # One write txn: the schema is checked before anything is created, and a new
    # store gets its databases and schema version atomically.
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn, create=True)
        found = txn.get(SCHEMA_KEY, db=meta)
        if found is None:
            _refuse_foreign(txn)
            txn.put(SCHEMA_KEY, str(SCHEMA_VERSION).encode(), db=meta)
        else:
            _check_schema(found)
        handles = {name: env.open_db(name.encode(), txn=txn, create=True) for name in DB_NAMES}
    return Dbs(**handles)


def _open_readonly_dbs(env: lmdb.Environment, path: str) -> Dbs:
    # Without a txn argument py-lmdb commits the txn that opens each handle, which a
    # read-only handle needs to outlive it.
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            _check_schema(txn.get(SCHEMA_KEY, db=meta))
        handles = {name: env.open_db(name.encode(), create=False) for name in DB_NAMES}
    except lmdb.NotFoundError as e:
        raise IndexStoreError(f"{path} is not a promptstore index: {e}") from e
    return Dbs(**handles)


def _refuse_foreign(txn: lmdb.Transaction) -> None:
    # Only our named databases may live in the main db; anything else is another program's.
    known = {name.encode() for name in DB_NAMES}
    for key in txn.cursor().iternext(values=False):
        if bytes(key) not in known:
            raise IndexStoreError(f"not a promptstore index: it holds {bytes(key)!r}")


def _check_schema(found: bytes | None) -> None:
    text = None if found is None else bytes(found).decode("ascii", "replace")
    if text not in {str(v) for v in READABLE_SCHEMAS}:
        error = SchemaVersionError(f"index schema version {text!r}, this code reads versions {READABLE_SCHEMAS}")
        error.found, error.expected = text, SCHEMA_VERSION
        raise error
