"""The remote tier: node files shared by many machines through one Redis (or
Valkey) server, a cluster, or a primary that Sentinels watch."""

from .keys import CHUNK, RemoteKeys
from .tier import LocalLink, PublishItem, RemoteHit, RemoteTier, ledger_summary, prune_ledger, read_ledger

__all__ = [
    "CHUNK",
    "LocalLink",
    "PublishItem",
    "RemoteHit",
    "RemoteKeys",
    "RemoteTier",
    "ledger_summary",
    "prune_ledger",
    "read_ledger",
]
