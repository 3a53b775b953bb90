"""The closed registry of cache kinds, and adoption of mlx-lm's plain caches.

Serialized snapshots and mlx-lm prompt-cache files name their kind; the name
is looked up here and nowhere else, so no file can choose which code runs.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as mlx_cache

from ..errors import UnknownKindError, UnsupportedCacheError

# The registry is the one module that knows every kind, and it imports none:
# each kind registers itself (`@register`), and importing `promptstore.caches`
# imports every kind module, so the registry is complete before any lookup.
KINDS: dict[str, type] = {}

# mlx-lm's class -> ours. Exact types only: a subclass someone else wrote may
# keep state we do not know about.
_ADOPTABLE: dict[type, type] = {}

# Class names as mlx-lm writes them into prompt-cache files.
MLX_LM_NAMES: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: `cls` serves its `kind`, and adopts the mlx-lm class it extends."""
    if cls.kind in KINDS:
        raise RuntimeError(f"cache kind {cls.kind!r} registered twice")
    base = next(b for b in cls.__mro__ if b.__module__ == mlx_cache.__name__)
    KINDS[cls.kind] = cls
    _ADOPTABLE[base] = cls
    MLX_LM_NAMES[cls.__name__] = cls
    return cls


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
    if ours.kind == "cache_list":
        cache.caches = tuple(adopt(c) for c in cache.caches)
    return cache


def from_mlx_lm_state(name: str, state: Any) -> Any:
    """Build a cache from mlx-lm's (class name, state) pair, through the registry."""
    cls = MLX_LM_NAMES.get(name)
    if cls is None:
        raise UnknownKindError(f"unknown cache class {name!r} in a prompt-cache file; known: {sorted(MLX_LM_NAMES)}")
    return cls.from_state(state)
