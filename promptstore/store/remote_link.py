"""The store's side of the remote tier (docs/remote.md): which nodes are
published, what a published node's chain from the root is, and the copies of
remote hits that are never published back ("quiet" nodes: the server has them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from ..config import Settings
from ..errors import CorruptRecordError
from ..index import Index
from ..snapshots import ColdTier
from ..snapshots.remote import LocalLink, PublishItem, RemoteHit, RemoteTier, prune_ledger


class RemoteLink:
    """The remote tier of one store (None without a remote_url), and what this
    process published or copied from it."""

    def __init__(self, settings: Settings, index: Index, cold: ColdTier, report: Callable[[str, bytes, str], None]):
        self.settings, self.index, self.cold = settings, index, cold
        self.quiet: set[bytes] = set()  # nodes made from remote hits: the server has their data
        self._origin = threading.local()
        self.tier: RemoteTier | None = None
        if settings.remote_url is not None:
            self.tier = RemoteTier(
                settings.remote_url,
                cold,
                self._describe,
                report,
                secret=settings.remote_secret,
                timeout=settings.remote_timeout,
                close_seconds=settings.remote_close_seconds,
            )

    def from_remote(self):
        """Nodes put inside are copies of a remote hit: stored here, never published back."""
        return self._origin_remote(True)

    def local(self):
        """Nodes put inside are this store's own data, even while a remote hit is
        stored: the two parts of a node a remote hit's insert split have new
        spans, whose blobs the server does not hold."""
        return self._origin_remote(False)

    @contextmanager
    def _origin_remote(self, remote: bool) -> Iterator[None]:
        was = getattr(self._origin, "remote", False)
        self._origin.remote = remote
        try:
            yield
        finally:
            self._origin.remote = was

    def placed(self, key: bytes) -> bool:
        """A node was stored here; whether it will be published once on disk (a copy
        of a remote hit is not: it is quiet)."""
        if getattr(self._origin, "remote", False):
            self.quiet.add(key)
            return False
        return self.tier is not None

    def forget(self, key: bytes) -> None:
        """The node's span changed or it was removed: quiet no more (the server holds
        no blob of its new span)."""
        self.quiet.discard(key)

    def filed(self, key: bytes) -> None:
        """The node's file is published in the index: hand it to the publisher."""
        if self.tier is not None and key not in self.quiet:
            self.tier.submit(key)

    def _describe(self, key: bytes) -> PublishItem | None:
        """A filed node worth publishing, with its path from the root (publisher thread)."""
        try:
            node = self.index.get(key)
            if node is None or node.record.prefill_seconds < self.settings.remote_publish_seconds:
                return None
            path = [node]
            while path[0].parent != node.namespace and len(path) <= node.end:
                parent = self.index.get(path[0].parent)
                if parent is None:
                    return None  # removed meanwhile
                path.insert(0, parent)
            if any(n.record.file_node is not None for n in path):
                return None  # a half reading a wider file: published once it has its own
            links = [
                LocalLink(n.key, n.start, n.end, n.record.file, n.record.nbytes, n.record.prefill_seconds) for n in path
            ]
        except CorruptRecordError:
            return None
        return PublishItem(node.namespace, np.concatenate([n.tokens for n in path]), links)

    def fetch(self, namespace: bytes, tokens, beyond: int, node_key, held) -> RemoteHit | None:
        """The remote tier's deepest prefix of `tokens` past `beyond` (RemoteTier.fetch); None without one."""
        return None if self.tier is None else self.tier.fetch(namespace, tokens, beyond, node_key, held)

    def prune_ledger(self) -> int:
        """Forget published blobs the server no longer has; how many (0 without a
        remote tier, or while the server is down)."""
        if self.tier is None or not self.tier.available():
            return 0
        return prune_ledger(self.cold.root.parent, self.tier.client)

    def summary(self, node_exists: Callable[[bytes], bool]) -> dict | None:
        """What this store published and what of it is stale (RemoteTier.summary); None without a remote tier."""
        return None if self.tier is None else self.tier.summary(node_exists)

    def counts(self) -> dict:
        return self.tier.counts if self.tier is not None else {}

    def flush(self) -> None:
        if self.tier is not None:
            self.tier.flush()  # bounded by remote_close_seconds

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()  # waits (bounded) for queued publishes
