"""The remote tier: node files shared through one Redis (or Valkey) server, cluster or Sentinel-watched primary by many machines."""

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
