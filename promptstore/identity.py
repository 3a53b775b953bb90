"""A node's identity: its key, namespace and span, as one small value.

Every layer speaks of a node through this type (the index's records, the tiers'
entries, spill jobs, cold files), and one rule says when what was read of a
node is stale: the stored node no longer has this identity.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeId:
    """key: the node's address (xxh3-128 of its namespace and prefix); namespace:
    the namespace fingerprint; [start, end): the span of token positions it holds."""

    key: bytes
    namespace: bytes
    start: int
    end: int

    def __repr__(self) -> str:
        return f"NodeId({self.key.hex()[:12]}…, [{self.start}, {self.end}))"
