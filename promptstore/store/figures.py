"""What `promptstore stats` reads of a store at rest: the index opened read-only
(no lock taken, nothing written), its totals over every namespace or one
namespace's counters, and what the store published to a remote tier.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.nn as nn

from ..config import Settings
from ..errors import KeyCollisionError, ReadOnlyIndexError, UnknownNamespaceError
from ..index import Index, Namespace
from ..snapshots.remote.tier import connect, ledger_summary
from .space import Space


def store_totals(root: Path) -> tuple[dict, dict | None]:
    """The index's totals over every namespace (Index.stats), and what `remote_figures` says."""
    with Index.open(root / "index", readonly=True) as index:
        return index.stats(), _remote_figures(root, index)


def _remote_figures(root: Path, index: Index) -> dict | None:
    """With a remote tier (remote_url): what this store published, and how much of it
    is stale (gone from the server, or no longer held here)."""
    settings = Settings.from_env()
    if settings.remote_url is None:
        return None
    try:
        client = connect(settings.remote_url, settings.remote_timeout)
        client.ping()
    except Exception:  # unreachable: the server's columns are unknown
        client = None
    return ledger_summary(root, client, lambda key: index.get(key) is not None)


def namespace_counters(
    root: Path,
    salt: str | None,
    fingerprint: str | None = None,
    model: Callable[[], tuple[nn.Module, str]] | None = None,
) -> tuple[Namespace, dict] | None:
    """One namespace and its counters, found by its fingerprint or by its model (with
    `salt` for a salted one); None when the store holds no such namespace.

    model: () -> (the model, its model_id), called only without a fingerprint, with the index open.
    """
    with Index.open(root / "index", readonly=True) as index:
        ns = _by_fingerprint(index, fingerprint, salt) if fingerprint else _by_model(index, model, salt)
        return None if ns is None else (ns, index.counters(ns))


def _by_fingerprint(index: Index, fingerprint: str, salt: str | None) -> Namespace | None:
    try:
        ns = index.namespace(fingerprint)
    except UnknownNamespaceError:
        return None
    # Only the salt's holder may read a salted namespace: the fingerprint covers its digest.
    try:
        tenant = None if salt is None else index.tenant_digest(salt, Settings.from_env().tenant_key())
    except ReadOnlyIndexError:  # no salted namespace was ever made here
        return None
    return ns if Namespace.of(ns.spec.model_copy(update={"tenant": tenant})).key == ns.key else None


def _by_model(index: Index, model: Callable[[], tuple[nn.Module, str]], salt: str | None) -> Namespace | None:
    loaded, model_id = model()
    try:
        # Binding a read-only index finds the namespace, or refuses to create it.
        return Space.bind(index, None, Settings.from_env(), loaded, model_id=model_id, salt=salt).namespace
    except (ReadOnlyIndexError, KeyCollisionError):
        return None
