"""The closed registry of cache kinds, and adoption of mlx-lm's plain caches.

Serialized snapshots and mlx-lm prompt-cache files name their kind; the name
is looked up here and nowhere else, so no file can choose which code runs.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as mlx_cache

from ..errors import UnknownKindError, UnsupportedCacheError
from .arrays import ArraysCache
from .batch import BatchKVCache, BatchRotatingKVCache
from .cache_list import CacheList
from .kv import ChunkedKVCache, KVCache, QuantizedKVCache
from .rotating import RotatingKVCache

KINDS: dict[str, type] = {
    cls.kind: cls
    for cls in (
        KVCache,
        RotatingKVCache,
        QuantizedKVCache,
        ChunkedKVCache,
        ArraysCache,
        CacheList,
        BatchKVCache,
        BatchRotatingKVCache,
    )
}

# mlx-lm's class -> ours. Exact types only: a subclass someone else wrote may
# keep state we do not know about.
_ADOPTABLE: dict[type, type] = {
    mlx_cache.KVCache: KVCache,
    mlx_cache.RotatingKVCache: RotatingKVCache,
    mlx_cache.QuantizedKVCache: QuantizedKVCache,
    mlx_cache.ChunkedKVCache: ChunkedKVCache,
    mlx_cache.ArraysCache: ArraysCache,
    mlx_cache.CacheList: CacheList,
    mlx_cache.BatchKVCache: BatchKVCache,
    mlx_cache.BatchRotatingKVCache: BatchRotatingKVCache,
}

# Class names as mlx-lm writes them into prompt-cache files.
MLX_LM_NAMES: dict[str, type] = {cls.__name__: cls for cls in KINDS.values()}


def kind_class(name: str) -> type:
    """The cache class registered under `name`, or UnknownKindError."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise UnknownKindError(f"unknown cache kind {name!r}; known kinds: {sorted(KINDS)}") from None


def adopt(cache: Any) -> Any:
    """Make an mlx-lm cache a promptstore cache in place, without copying buffers.

    Returns the same object, now an instance of promptstore's subclass of its
    class. Already-adopted caches are returned as they are.
    """
    if type(cache) in KINDS.values():
        return cache
    ours = _ADOPTABLE.get(type(cache))
    if ours is None:
        raise UnsupportedCacheError(
            f"cannot adopt a {type(cache).__module__}.{type(cache).__name__}; "
            f"supported: {sorted(c.__name__ for c in _ADOPTABLE)}"
        )
    cache.__class__ = ours
    if ours is CacheList:
        cache.caches = tuple(adopt(c) for c in cache.caches)
    return cache


def from_mlx_lm_state(name: str, state: Any) -> Any:
    """Build a cache from mlx-lm's (class name, state) pair, through the registry."""
    cls = MLX_LM_NAMES.get(name)
    if cls is None:
        raise UnknownKindError(f"unknown cache class {name!r} in a prompt-cache file; known: {sorted(MLX_LM_NAMES)}")
    return cls.from_state(state)
