"""mlx-lm prompt-cache files, read into promptstore caches.

Supports the format of the pinned mlx-lm (0.32.x): `save_prompt_cache` writes
one safetensors file whose arrays are the flattened per-layer `state` and whose
metadata lists the class names and which state entries were scalars. Class
names resolve through the closed registry, never through a module's globals.
Our caches carry mlx-lm's class names and state layouts, so mlx-lm's own
`save_prompt_cache` writes them and `load_prompt_cache` reads ours back.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import save_prompt_cache as save_mlx_lm_prompt_cache

from ..errors import CacheError, SnapshotFormatError
from .prompt import prompt_position
from .registry import from_mlx_lm_state

__all__ = ["load_mlx_lm_prompt_cache", "save_mlx_lm_prompt_cache"]


def _scalar(array: mx.array, kind: str) -> Any:
    if kind == "scalar":
        return array.item()
    if kind == "string":
        return "".join(chr(i) for i in array.tolist())
    if kind == "none":
        return None
    raise SnapshotFormatError(f"unknown scalar type {kind!r} in a prompt-cache file")


def load_mlx_lm_prompt_cache(path: str | os.PathLike, return_metadata: bool = False, offset: int | None = None):
    """Read a file written by mlx-lm's `save_prompt_cache` into promptstore caches.

    offset: the position, for files holding only recurrent layers (their
    state does not record it).
    """
    try:
        arrays, flat_meta = mx.load(str(path), return_metadata=True)
        metadata, classes, scalars = tree_unflatten(list(flat_meta.items()))
    except (ValueError, RuntimeError, OSError, TypeError) as e:
        raise SnapshotFormatError(f"not an mlx-lm prompt-cache file: {path}: {e}") from None
    if not isinstance(classes, list) or not isinstance(scalars, list):
        raise SnapshotFormatError(f"malformed mlx-lm prompt-cache metadata in {path}")
    for entry in scalars[1:]:
        pos, kind = entry
        if pos not in arrays:
            raise SnapshotFormatError(f"scalar entry {pos!r} names no array")
        arrays[pos] = _scalar(arrays[pos], kind)
    states = tree_unflatten(list(arrays.items())) if arrays else []
    if len(states) != len(classes):
        raise SnapshotFormatError(f"{len(classes)} classes but {len(states)} layer states")
    try:
        caches = [from_mlx_lm_state(name, state) for name, state in zip(classes, states)]
    except (ValueError, TypeError) as e:
        raise CacheError(f"a layer state does not fit its class: {e}") from None
    prompt_position(caches, offset)
    return (caches, metadata) if return_metadata else caches
