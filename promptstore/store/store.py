"""The public PromptStore: an index, the tiers, and namespaces bound to models.

It holds no storage logic of its own: the index finds prefixes, the tiers
hold snapshots, and a Space (a namespace bound to a model) composes them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.nn as nn
import platformdirs

from ..config import Settings
from ..errors import StoreDirectoryError, StoreNotWritableError
from ..index import Index
from ..snapshots.remote import RemoteTier
from .group import Group
from .metrics import DiskFigures, Report, StoreMetrics, WarmStart
from .retention import Retention
from .space import Space
from .tiers import Tiers
from .warm_start import Warmer

log = logging.getLogger("promptstore.store")
WARM_STOP_SECONDS = 30.0  # a close waits this long for the files a warm start is reading


def default_path() -> Path:
    """$PROMPTSTORE_HOME, else the user's cache directory."""
    home = os.environ.get("PROMPTSTORE_HOME")
    return Path(home) if home else Path(platformdirs.user_cache_dir("promptstore"))


class PromptStore:
    """A persistent prompt-cache store in one directory (LMDB index plus files)."""

    def __init__(self, path: Path, settings: Settings, group: Group | None = None):
        self.path, self.settings, self.group = path, settings, group
        # Every open store holds the lock shared; maintenance that needs the
        # store idle takes it exclusively (tools/compact).
        self._lock = _lock_file(path)
        fcntl.flock(self._lock, fcntl.LOCK_SH)
        self.exclusive = False
        self.index = Index.open(path / "index", map_size=settings.map_size)
        self.tiers = Tiers(path, self.index, settings)
        self.spaces: list[Space] = []
        self._closed = False
        self.unwritten = (0, 0)  # nodes and bytes the disk refused, as close() left them
        self.declined = (0, 0)  # nodes and bytes the admit durability never wrote (one-offs), as close() left them
        self.warming: Warmer | None = None
        if settings.warm_start:
            self.warm()

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, *, group: Group | None = None, **settings: Any) -> PromptStore:
        """Open (creating it private) the store at `path` (default: `default_path()`).

        group: this process's rank of a distributed group (`Group.of(...)`, under
            mlx.launch): the rank's own store under `path` (store/group.py), whose
            fetches every rank of the group agrees on.
        settings: fields of `promptstore.config.Settings`, over PROMPTSTORE_* variables.
        """
        config = Settings.from_env(**settings)
        root = Path(path) if path is not None else default_path()
        if group is not None:
            root, config = group.folder(root), group.settings(config)
            for folder in reversed(root.parents[:3]):  # ranks/, ranks/<shape>/: private like the root
                _prepare(folder, config.dir_mode)
        _prepare(root, config.dir_mode)
        return cls(root, config, group)

    def bind(
        self,
        model: nn.Module,
        model_id: str | None = None,
        salt: str | None = None,
        *,
        spans_weights: bool = False,
        fingerprint: str | None = None,
        **cache_kwargs,
    ) -> Space:
        """The namespace of `model` (and its cache layout) in this store, as a Space.

        model_id: an identity you vouch for; without it the weights are digested. The
            namespace keeps a fingerprint of the weights it was bound with
            (promptstore.store.model.weights_fingerprint): other weights under the same
            id raise ModelIdentityError, and nothing is written.
        salt: a tenant secret; namespaces with different salts never share a node. Only a
            keyed scrypt digest of it is stored (Index.tenant_digest), never the salt.
        spans_weights: the id is meant to span versions of the weights: other weights
            are bound, and the namespace keeps theirs (later binds are checked against
            the weights its newest entries come from).
        fingerprint: `weights_fingerprint(model)`, when the caller has it already (a
            server binding a namespace per tenant); None: computed here.
        cache_kwargs: kv_bits, kv_group_size, max_kv_size, as for make_prompt_cache.
        """
        space = Space.bind(
            self.index,
            self.tiers,
            self.settings,
            model,
            model_id=model_id,
            salt=salt,
            spans_weights=spans_weights,
            fingerprint=fingerprint,
            group=self.group,
            **cache_kwargs,
        )
        self.spaces.append(space)
        return space

    def warm(self, namespaces=None, budget: int | None = None) -> Warmer:
        """Read the most recently used nodes into memory in the background, up to
        `budget` bytes per tenant (default hot_bytes), so the next hits are hot.

        namespaces: keys of the namespaces to warm (default: all; a Space's is
            `space.namespace.key`). Returns the running Warmer (`wait()`,
            `progress()`, `stop()`); one already running is returned as it is.

        On CUDA, `wait()` for it before making the model: a warm start still
        reading while the weights were made has left later batches over its
        caches several times slower (docs/cold.md, "Warm start").
        """
        if self.warming is None or not self.warming.running:
            budget = self.settings.hot_bytes if budget is None else budget
            self.warming = Warmer(self.index, self.tiers, budget, namespaces).start()
        return self.warming

    def metrics(self) -> StoreMetrics:
        """What this store did since it opened, in this process (fetches by model and
        the tokens they restored by tier, evictions, files written, quarantines), its
        size against the budgets, and the warm start's progress (promptstore.store.metrics)."""
        stats = self.index.stats()  # raises IndexStoreError once closed
        return self.tiers.metrics(
            hot_budget_bytes=self.settings.hot_bytes,
            stored_nodes=stats["nodes"],
            stored_bytes=stats["nbytes"],
            disk_budget_bytes=self.settings.disk_bytes,
            warm_start=None if self.warming is None else WarmStart(**self.warming.progress()),
        )

    @property
    def has_remote(self) -> bool:
        """Whether a remote tier is configured: a fetch may then find more than the index says."""
        return self.tiers.remote.tier is not None

    def give_way(self, busy: Callable[[], bool] | None, at_most: float = 1.0) -> None:
        """Background spills pause between chunks while `busy()` is true (a server:
        requests wait for their first tokens), at most `at_most` seconds per spill;
        None: they never pause (the default)."""
        self.tiers.give_way(busy, at_most)

    def in_memory(self) -> tuple[int, int]:
        """Nodes, and their bytes, this process holds in memory (the hot tier)."""
        return self.tiers.memory()

    def disk(self) -> DiskFigures:
        """What the disk refused of this process's writes, whether it refuses now (the
        store is then degraded: what it refused waits in memory), and how much waits."""
        return self.tiers.disk_figures()

    def only_in_memory(self) -> dict[bytes, int]:
        """Nodes in memory not on disk yet (close spills them), by key: their bytes."""
        return self.tiers.only_in_memory()

    def flush(self) -> None:
        """Wait for queued spills."""
        self.tiers.flush()

    # --- what an operator, a tool or a test reads of the tiers ----------------------

    @property
    def reports(self) -> list[Report]:
        """The misses an operator should know of (a bad file, a bad record, a remote
        fault), the newest last (at most the last 1,000)."""
        return list(self.tiers.reports)

    @property
    def counts(self) -> Counter:
        """This process's counters of the tiers' work (a copy): spills, cold loads,
        healed nodes, misses by reason (`miss_<reason>`), remote tokens, ..."""
        return Counter(self.tiers.counts)

    @property
    def remote(self) -> RemoteTier | None:
        """The remote tier (docs/remote.md), None without a remote_url."""
        return self.tiers.remote.tier

    @property
    def clock(self) -> Callable[[], float]:
        """What retention and the admit durability's idle times read (time.time)."""
        return self.tiers.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.tiers.clock = clock

    def retention_of(self, key: bytes) -> Retention | None:
        """The retention class this process keeps a node by (`never_write`,
        `keep_until`), None without one."""
        return self.tiers.keeping.of(key)

    def write_due(self) -> int:
        """Queue for disk what the durability writes now (admit: reused nodes, idle
        conversations; its thread does it every second); returns the nodes queued."""
        return self.tiers.write_due()

    def cold_bytes(self) -> int:
        """Bytes of every node with a file on disk, as the index records them."""
        return self.tiers.budget.filed_bytes()

    def evict_cold(self, budget: int | None = None) -> tuple[int, int]:
        """Evict leaves with files, least valuable first (retained ones last), until
        each tenant's are within `budget` (default: disk_bytes); (nodes, bytes) removed.
        compact --max-bytes does it for an operator."""
        return self.tiers.budget.evict(self.settings.disk_bytes if budget is None else budget)

    def close(self) -> None:
        """Put everything on disk (whatever the durability) and close the index."""
        if not self._closed:
            self._closed = True
            if self.warming is not None and not self.warming.stop(timeout=WARM_STOP_SECONDS):
                log.warning("warm start still reading after %.0f s; closing under it", WARM_STOP_SECONDS)
            try:
                for space in self.spaces:
                    space.flush_stats()
                self.tiers.close()
                self.unwritten = self.tiers.unwritten()
                counted = self.tiers.meter.counts("declined_nodes", "declined_bytes")
                self.declined = (counted["declined_nodes"], counted["declined_bytes"])
                if self.unwritten[0]:
                    log.warning(
                        "closed with %d nodes (%.1f MB) not on disk: the disk refused their spills, "
                        "and they are lost with this process",
                        self.unwritten[0],
                        self.unwritten[1] / 1e6,
                    )
            finally:
                self.index.close()
                self._lock.close()  # releases the flock

    def try_exclusive(self) -> bool:
        """Hold the store's lock exclusively if no other process has it open."""
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.exclusive = True
        except BlockingIOError:
            fcntl.flock(self._lock, fcntl.LOCK_SH)  # a failed conversion may drop the old lock
            self.exclusive = False
        return self.exclusive

    @staticmethod
    @contextmanager
    def lock(path, exclusive: bool = True, blocking: bool = True):
        """The store's lock, held for the block; yields whether it was taken."""
        handle = _lock_file(Path(path))
        try:
            flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
            try:
                fcntl.flock(handle, flags)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            handle.close()

    def __enter__(self) -> PromptStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lock_file(root: Path):
    try:
        fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as e:
        raise _unusable(root / "lock", e, "write") from None
    return os.fdopen(fd, "r+")


# What a directory that cannot be written answers (its filesystem mounted read-only,
# or its mode or owner not letting this user write).
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _unusable(path: Path, error: OSError, doing: str) -> StoreDirectoryError:
    """A typed error for an OSError met while preparing the store (a caller gets one line, not a traceback)."""
    if error.errno in NOT_WRITABLE:
        return StoreNotWritableError(
            f"cannot {doing} {path}: {error.strerror}; a store writes its lock, index and files"
        )
    return StoreDirectoryError(f"cannot use {path} as a store: {error.strerror or error}")


def _not_a_folder(root: Path) -> None:
    """Refuse a store path that is a file, or lies under one, naming that file
    (mkdir would only say "File exists" or "Not a directory")."""
    for path in (root, *root.parents):
        try:
            if path.is_dir():
                return
            if path.exists():
                if path.is_dir():
                    return  # made meanwhile: another process preparing the same folder (a group's ranks)
                kind = "a file" if path.is_file() else "not a regular file"
                raise StoreDirectoryError(f"{path} is {kind}, not a folder")
        except OSError:
            return  # not ours to judge: mkdir below says what is wrong


def _writable(root: Path) -> None:
    """Refuse, before anything is opened, a directory this process cannot write:
    the lock, the index and the cold files all need it. access() also answers
    EROFS for root on a read-only mount, where permission bits would not."""
    effective = os.access in os.supports_effective_ids
    if os.access(root, os.W_OK | os.X_OK, effective_ids=effective):
        return
    if os.statvfs(root).f_flag & os.ST_RDONLY:
        raise StoreNotWritableError(
            f"{root} is on a read-only filesystem; a store writes its lock, index and files there"
        )
    raise StoreNotWritableError(
        f"{root} is not writable by this user (uid {os.geteuid()}); a store writes its lock, index and files there"
    )


def _prepare(root: Path, mode: int) -> None:
    if root.is_symlink():
        raise StoreDirectoryError(f"{root} is a symlink; refusing to use it as a store")
    _not_a_folder(root)
    try:
        root.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as e:
        raise _unusable(root, e, "create") from None
    info = root.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise StoreDirectoryError(f"{root} is not a directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise StoreDirectoryError(f"{root} belongs to another user")
    if info.st_mode & 0o022:
        # Others could plant symlinks for the store to follow: refuse.
        raise StoreDirectoryError(
            f"{root} is writable by others (mode {oct(stat.S_IMODE(info.st_mode))}); make it private (chmod 700)"
        )
    for name in ("index", "cold", "lock"):
        if (root / name).is_symlink():
            raise StoreDirectoryError(f"{root / name} is a symlink; refusing to follow it")
    _writable(root)
