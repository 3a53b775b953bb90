"""A Hit: what a fetch found, its cache and the figures a log line or a metric reads."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .plan import Choice


@dataclass
class Hit:
    """What fetch found.

    length: prompt tokens restored (at most len(tokens) - 1, so the caller
        always computes the last position's logits).
    cache: per-layer caches at offset `length`, usable as mlx-lm's prompt_cache.
    checkpoints: positions p > length where the caller, while prefilling,
        should call `space.insert(tokens[:p], cache)`.
    remote_tokens: of `length`, tokens restored from the remote tier (0: none).
    computed: of `length`, tokens fetch prefilled itself while it read the rest
        from disk (an overlap cold hit; see restore.py).
    plan: how a hit with nodes on disk was served (load, recompute, overlap), None
        when every node was in memory.
    nbytes: bytes of the stored nodes the hit restored from (fetched, for a
        remote hit).
    matched: prompt tokens the store holds (at most len(tokens) - 1): what a
        model of attention layers only would restore; a model with window or
        recurrent layers restores at or before it.
    """

    length: int
    cache: list
    checkpoints: tuple[int, ...] = ()
    nodes: int = 0
    cold_nodes: int = 0
    cold_tokens: int = 0
    seconds: float = 0.0
    remote_tokens: int = 0
    matched: int = 0
    computed: int = 0
    plan: Choice | None = None
    nbytes: int = 0

    def figures(self) -> Hit:
        """This hit without its cache: what a log line or a metric reads. Kept
        in place of the hit, it holds no memory of the restore once the caller
        lets its cache go (a kept cache held a restore's memory, gigabytes on
        a GPU, until the next fetch, and made that fetch's restore allocate
        afresh beside it)."""
        return replace(self, cache=[])
