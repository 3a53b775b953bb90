"""Settings: one typed table with defaults, documented once, readable from the
environment (PROMPTSTORE_<NAME>, e.g. PROMPTSTORE_HOT_BYTES=1073741824)."""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import re
from typing import Any, Literal
from urllib.parse import SplitResult, parse_qsl, urlsplit

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .errors import SettingsError

GiB = 1 << 30
ENV_PREFIX = "PROMPTSTORE_"
# Variables of the prefix that are not settings: the store's path (store.default_path).
OTHER_VARIABLES = frozenset({"PROMPTSTORE_HOME"})

log = logging.getLogger("promptstore.config")
_warned: set[str] = set()


class Settings(BaseModel):
    """How a store keeps its snapshots."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hot_bytes: int = Field(
        2 * GiB,
        ge=0,
        description="memory budget of the hot tier per process and tenant (the namespaces of one salt, "
        "or of none); 0 keeps nothing hot",
    )
    disk_bytes: int = Field(
        32 * GiB, ge=0, description="disk budget of the cold tier per tenant, brought back by evicting leaves"
    )
    durability: Literal["write_back", "write_through", "sync", "admit"] = Field(
        "write_back",
        description="write_back: spill on eviction and close; write_through: queue every insert for disk; "
        "sync: insert returns once the node is on disk; admit: write a node once it is reused, once its "
        "conversation is idle (admit_idle_seconds), when memory evicts it and it is worth keeping, and at "
        "close every chat turn and conversation (insert(turn=True)); never a one-off prompt nobody came "
        "back to (store/admission.py)",
    )
    admit_idle_seconds: float = Field(
        5.0,
        gt=0,
        description="admit: a conversation (a prompt that went on from an earlier one) idle this long is written "
        "(its earlier turns are written once the next turn reuses them; this bounds what a crash loses of its "
        "last turn)",
    )
    admit_prefill_seconds: float = Field(
        0.1,
        ge=0,
        description="admit: a node memory evicts that nobody reused is still written if recomputing it costs "
        "at least this many prefill seconds (a chat's first turn evicted before its next turn comes cannot be "
        "told from a one-off)",
    )
    disk_write_budget: ByteSize | None = Field(
        None,
        description="admit: bytes the store may write to disk per hour (e.g. 20GiB or 21474836480); over it, "
        "the least valuable writes are skipped, never a request delayed; None: no budget",
    )
    checkpoint_interval: int | None = Field(
        None,
        ge=1,
        description="grid of checkpoints while prefilling, for models with window or recurrent layers "
        "(default: prefill_step, a state at every prefill chunk boundary)",
    )
    prefill_step: int = Field(512, ge=1, description="tokens per forward while prefilling")
    warm_start: bool = Field(
        False,
        description="on open, read the most recently used nodes into memory in the background, up to hot_bytes "
        "per tenant (on for promptstore serve)",
    )
    cold_plan: Literal["auto", "load", "recompute", "overlap"] = Field(
        "auto",
        description="how a hit with nodes on disk is served: auto (the quickest by the rates measured for the "
        "namespace), load, recompute, or overlap (prefill the first nodes while reading the rest); split, "
        "its former name, is still accepted and read as overlap (deprecated)",
    )
    node_bytes: int = Field(
        GiB,
        ge=1 << 12,
        description="largest node one insert stores: a longer span becomes a chain of nodes, so a cold hit "
        "reads files side by side and can prefill the first while it reads the rest; compact joins up to it",
    )
    writer_queue: int = Field(64, ge=1, description="spill jobs queued before inserts wait")
    fsync: bool = Field(True, description="fsync files and directories before publishing them")
    file_mode: int = Field(0o600, description="permissions of snapshot files")
    dir_mode: int = Field(0o700, description="permissions of store directories")
    map_size: int = Field(64 << 20, ge=1 << 16, description="initial LMDB map size; it grows when full")
    # The remote tier: a Redis or Valkey every replica shares (docs/remote.md).
    remote_url: str | None = Field(
        None,
        description="redis://host:port/db (or rediss://, unix://) shared by every replica, a Redis Cluster as "
        "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS), or a primary Sentinels watch as "
        "redis+sentinel://host:port[,host:port...]/service[/db] (rediss+sentinel:// for TLS); None: no remote tier",
    )
    remote_secret: str | None = Field(
        None,
        description="a secret every replica shares, mixed into remote keys and blob encryption (never stored); "
        "it also keys the digests of tenant salts, so replicas agree on salted namespaces",
    )
    remote_timeout: float = Field(0.5, gt=0, le=60, description="seconds a remote round trip may wait before a miss")
    remote_publish_seconds: float = Field(
        0.0, ge=0, description="publish only nodes whose prefill time saved is at least this (0: every node)"
    )
    remote_close_seconds: float = Field(10.0, ge=0, description="how long close() waits for queued publishes")

    @field_validator("file_mode", "dir_mode")
    @classmethod
    def _owner_keeps_access(cls, mode: int, info: ValidationInfo) -> int:
        # Files: the owner reads and writes; directories: also lists and enters.
        need = 0o600 if info.field_name == "file_mode" else 0o700
        if not 0 <= mode <= 0o777 or mode & need != need:
            raise ValueError(f"{oct(mode)}: a permission mode (at most 0o777) that includes {oct(need)}")
        return mode

    @field_validator("disk_write_budget", mode="before")
    @classmethod
    def _size(cls, size: Any) -> Any:
        # ByteSize alone says "could not parse value and unit" of -1: name the rule instead.
        if isinstance(size, (int, float)) and size < 0 or isinstance(size, str) and size.strip().startswith("-"):
            raise ValueError(f"{size!r}: a size of at least 0 bytes (e.g. 20GiB or 21474836480)")
        return None if size in ("", "none", "None") else size

    @field_validator("cold_plan", mode="before")
    @classmethod
    def _cold_plan_alias(cls, plan: Any) -> Any:
        # "split" was the overlap plan's name; the word now means only splitting a node.
        if plan == "split":
            if "cold_plan=split" not in _warned:
                _warned.add("cold_plan=split")
                log.warning("cold_plan split is deprecated and read as overlap; set cold_plan to overlap")
            return "overlap"
        return plan

    @field_validator("remote_url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None and url.startswith(CLUSTER_SCHEMES):
            check_cluster_url(url)  # raises, naming what is wrong
        elif url is not None and url.startswith(SENTINEL_SCHEMES):
            check_sentinel_url(url)
        elif url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"{_redacted(url)!r}: a redis://, rediss://, unix://, redis+cluster://, rediss+cluster://, "
                "redis+sentinel:// or rediss+sentinel:// URL"
            )
        return url or None

    def tenant_key(self) -> bytes | None:
        """The key of tenant digests that every replica derives alike from
        remote_secret; None: each store keys them with a random key of its own."""
        if self.remote_secret is None:
            return None
        return hashlib.sha256(b"promptstore tenant key\0" + self.remote_secret.encode()).digest()

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Defaults, then PROMPTSTORE_* variables, then `overrides`."""
        warn_unknown_variables(cls)
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = os.environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                try:
                    values[name] = int(raw, 0) if name.endswith("_mode") else raw
                except ValueError:
                    raise SettingsError(f"{ENV_PREFIX}{name.upper()}={raw!r}: not a number (e.g. 0o600)") from None
        values.update(overrides)
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors())
            raise SettingsError(f"invalid settings: {problems}") from None


# --- a Redis Cluster's or Sentinels' URL ----------------------------------------------
# Checked here; the remote tier splits it again (snapshots/remote/cluster.py and
# sentinel.py, the same way).

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
TLS_OPTIONS = frozenset({"ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile"})
SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})  # the Sentinels' own credentials
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?)$")
_SERVICE = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_cluster_url(url: str) -> None:
    """redis+cluster://[user:password@]host:port[,host:port...][/0], or rediss+cluster://
    (TLS; it may add ?ssl_ca_certs=...&ssl_cert_reqs=...); ValueError names what is wrong."""
    shown, parts = _checked_hosts(url, "cluster")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"{shown!r}: a cluster has database 0 only, not {parts.path[1:]!r}")
    _check_options(shown, parts.query, TLS_OPTIONS if parts.scheme == "rediss+cluster" else frozenset())


def check_sentinel_url(url: str) -> None:
    """redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]: the
    Sentinels to ask (any one that answers is enough) for the primary of `service`,
    whose credentials the URL carries; ?sentinel_username=...&sentinel_password=...
    where the Sentinels ask for their own; rediss+sentinel:// for TLS to both (it
    may add the ssl_* options). ValueError names what is wrong."""
    shown, parts = _checked_hosts(url, "sentinel")
    service, _, db = parts.path[1:].partition("/")
    if not service:
        raise ValueError(f"{shown!r}: name the service the Sentinels watch (host:port,.../service[/db])")
    if not _SERVICE.match(service):
        raise ValueError(f"{shown!r}: {service!r} is not a service name (letters, digits, '_', '.', '-')")
    if db and not (db.isdigit() and len(db) <= 9):
        raise ValueError(f"{shown!r}: {db!r} is not a database number")
    tls = TLS_OPTIONS if parts.scheme == "rediss+sentinel" else frozenset()
    _check_options(shown, parts.query, SENTINEL_OPTIONS | tls)


def _checked_hosts(url: str, kind: str) -> tuple[str, SplitResult]:
    """The URL as messages show it and split, if its scheme is redis+<kind>:// or
    rediss+<kind>://, it has no #fragment and every node is host:port."""
    shown = _redacted(url)
    try:
        parts = _split_hosts_url(url)
    except ValueError as e:
        raise ValueError(f"{shown!r}: {e}") from None
    if parts.scheme not in (f"redis+{kind}", f"rediss+{kind}"):
        raise ValueError(f"{shown!r}: a redis+{kind}:// or rediss+{kind}:// URL")
    if parts.fragment:
        raise ValueError(f"{shown!r}: a {kind} URL takes no #fragment")
    for node in parts.netloc.rpartition("@")[2].split(","):
        _check_node(shown, node)
    return shown, parts


def _check_node(shown: str, node: str) -> None:
    host, sep, port = node.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{shown!r}: {node!r} is not host:port (each node of the list needs both)")
    if not _HOST.match(host):
        raise ValueError(f"{shown!r}: {host!r} is not a host name or address ([...] around IPv6)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{shown!r}: {port!r} is not a port (1 to 65535)")


def _check_options(shown: str, query: str, allowed: frozenset[str]) -> None:
    try:
        options = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"{shown!r}: {query!r} is not a query string (name=value&...)") from None
    scheme = shown.partition("://")[0]
    for name, _ in options:
        if name not in allowed:
            takes = f"takes {', '.join(sorted(allowed))}" if allowed else "takes no option"
            raise ValueError(f"{shown!r}: unknown option {name!r} ({scheme}:// {takes})")


def _split_hosts_url(url: str) -> SplitResult:
    """urlsplit of a URL whose netloc lists several hosts (host:port,[::1]:port,...),
    which some Pythons' urlsplit refuses (text before a bracketed IPv6 host)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("no scheme://")
    cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    return urlsplit(f"{scheme}://host{rest[cut:]}")._replace(netloc=rest[:cut])


def _redacted(url: str) -> str:
    """The URL without its passwords, for messages."""
    url = re.sub(r"(://[^/@?#]*?:)[^/@?#]*@", r"\1***@", url)
    return re.sub(r"([?&]sentinel_password=)[^&#]*", r"\1***", url)


def warn_unknown_variables(settings: type[Settings] = Settings) -> None:
    """Log once per name each PROMPTSTORE_* variable that no setting reads (a
    misspelling would otherwise be ignored in silence), naming the closest valid one."""
    valid = {ENV_PREFIX + name.upper() for name in settings.model_fields} | OTHER_VARIABLES
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIX) and name not in valid and name not in _warned:
            _warned.add(name)
            # Compare what follows the prefix: every name shares the prefix, so all would look close.
            close = difflib.get_close_matches(
                name.removeprefix(ENV_PREFIX), [v.removeprefix(ENV_PREFIX) for v in valid], n=1
            )
            hint = f"did you mean {ENV_PREFIX}{close[0]}?" if close else f"valid: {', '.join(sorted(valid))}"
            log.warning("%s is not a promptstore setting and is ignored; %s", name, hint)
