"""Whole-model operations: a model's cache is a list of per-layer caches.

Every function here applies to all layers or to none: a restore that one
layer cannot reach leaves every layer as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from ..errors import CacheShapeError
from .arrays import ArraysCache
from .base import as_position
from .cache_list import CacheList
from .kv import KVCache, QuantizedKVCache
from .registry import adopt, kind_class
from .snapshot import Snapshot


def make_prompt_cache(
    model: nn.Module,
    max_kv_size: int | None = None,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> list:
    """The model's per-layer caches, as promptstore caches.

    max_kv_size: as mlx-lm's (a window for models without their own layout).
    kv_bits, kv_group_size: quantize full-attention layers from the start.
    """
    caches = adopt_prompt_cache(mlx_cache.make_prompt_cache(model, max_kv_size))
    if kv_bits is not None:
        caches = [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c for c in caches]
    return caches


def adopt_prompt_cache(caches: Sequence[Any], offset: int | None = None) -> list:
    """Adopt each of mlx-lm's plain caches in place (no buffer is copied).

    offset: the position the caches are at, for recurrent layers of models
    that do not report it (needed only when no other layer knows it).
    """
    out = [adopt(c) for c in caches]
    prompt_position(out, offset)
    return out


def _leaves(caches):
    for c in caches:
        if isinstance(c, CacheList):
            yield from _leaves(c.caches)
        else:
            yield c


def prompt_position(caches: Sequence[Any], offset: int | None = None) -> int:
    """The position every layer is at, syncing recurrent layers that lag.

    Recurrent layers learn their position from `advance`, which some models
    never call; they take the position of the model's other layers (or
    `offset`, when given).
    """
    leaves = list(_leaves(caches))
    if offset is not None:
        position = as_position(offset, "offset")
    else:
        known = [c.position for c in leaves if not isinstance(c, ArraysCache)]
        position = max(known, default=max((c.position for c in leaves), default=0))
    for c in leaves:
        if isinstance(c, ArraysCache) and c.offset != position and not c.empty():
            c.offset = position
    return position


def _check_layers(caches: Sequence[Any], snapshots: Sequence[Any]) -> None:
    if len(caches) != len(snapshots):
        raise CacheShapeError(f"{len(snapshots)} layer snapshots for a model of {len(caches)} layers")


def snapshot_prompt_cache(caches: Sequence[Any], from_offset: int = 0) -> list[Snapshot]:
    """Per-layer snapshots from `from_offset` to the model's position."""
    prompt_position(caches)
    return [c.snapshot(from_offset) for c in caches]


def restore_prompt_cache(caches: Sequence[Any], snapshots: Sequence[Any] | None, target: int) -> bool:
    """Bring every layer to `target`, or change nothing and return False.

    snapshots: per layer, a snapshot or a chain of consecutive snapshots (or
    None to rewind in place).
    """
    prompt_position(caches)
    if snapshots is None:
        snapshots = [None] * len(caches)
    _check_layers(caches, snapshots)
    plans = []
    for cache, snap in zip(caches, snapshots):
        plan = cache.plan_restore(snap, target)
        if plan is None:
            return False
        plans.append(plan)
    for cache, plan in zip(caches, plans):
        cache.apply_restore(plan)
    return True


def merge_prompt_snapshots(parents: Sequence[Snapshot], children: Sequence[Snapshot]) -> list:
    """Per layer: `[a, b)` + `[b, c)` -> `[a, c)`."""
    _check_layers(parents, children)
    return [kind_class(p.kind).merge_chain([p, c]) for p, c in zip(parents, children)]


def merge_prompt_chain(chain: Sequence[Sequence[Snapshot]]) -> list:
    """Per-layer snapshots of consecutive spans -> one per layer, one copy each."""
    if not chain:
        raise CacheShapeError("an empty chain merges nothing")
    for layers in chain[1:]:
        _check_layers(chain[0], layers)
    return [kind_class(layer[0].kind).merge_chain(list(layer)) for layer in zip(*chain)]


def split_prompt_snapshots(snapshots: Sequence[Snapshot], at: int):
    """Per layer split at `at`: (uppers, lowers). A layer that cannot split
    there gives (None, its snapshot)."""
    halves = [kind_class(s.kind).split_snapshot(s, at) for s in snapshots]
    return [h[0] for h in halves], [h[1] for h in halves]


def layer_description(cache: Any) -> dict:
    """A layer's cache layout in the index's terms: kind and window, keep, bits,
    group_size, chunk_size where they apply; a cache list's caches in `children`."""
    if isinstance(cache, CacheList):
        return {"kind": cache.kind, "children": [layer_description(c) for c in cache.caches]}
    layout = cache.layout()
    names = {
        "window": "max_size",
        "keep": "keep",
        "bits": "bits",
        "group_size": "group_size",
        "chunk_size": "chunk_size",
    }
    return {"kind": cache.kind, **{ours: layout.get(theirs) for ours, theirs in names.items()}}


def prompt_layout(caches: Sequence[Any]) -> list[dict]:
    """Per layer: kind and the settings a snapshot must share with it."""
    return [{"kind": c.kind, **c.layout()} for c in caches]
