"""What a stored node is worth keeping: the prefill time it saves, how often and
how recently it was used, against the bytes it takes.

Both tiers evict the least valuable first. Age is counted in accesses, not
seconds, so the order is the same on a fast machine and a slow one.
"""

from __future__ import annotations

# After this many accesses to other nodes, a node's recency weight halves.
HALF_LIFE = 256


def value(prefill_seconds: float, hits: int, nbytes: int, age: int) -> float:
    """Seconds of prefill saved per byte, weighted by use and recency."""
    saved = max(prefill_seconds, 1e-9) * (1 + hits)
    recency = 1.0 / (1.0 + age / HALF_LIFE)
    return saved * recency / max(nbytes, 1)
