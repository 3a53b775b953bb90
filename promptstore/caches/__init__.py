"""Every cache kind a model needs, each with the snapshot protocol.

Each kind is mlx-lm's class of the same name, extended; use them wherever
mlx-lm's caches go. Whole-model operations are plain functions.
"""

from .arrays import ArraysCache
from .base import SnapshotProtocol
from .batch import BatchKVCache, BatchRotatingKVCache
from .cache_list import CacheList
from .kv import ChunkedKVCache, KVCache, QuantizedKVCache
from .mlx_lm_files import load_mlx_lm_prompt_cache, save_mlx_lm_prompt_cache
from .node import (
    cut_node,
    drop_states,
    join_nodes,
    node_nbytes,
    present_layers,
    restore_chains,
    richer_windows,
    split_for_edge,
    split_node,
    state_nbytes,
)
from .prompt import (
    adopt_prompt_cache,
    layer_description,
    make_prompt_cache,
    merge_prompt_chain,
    merge_prompt_snapshots,
    prompt_layout,
    prompt_position,
    restore_prompt_cache,
    snapshot_prompt_cache,
    split_prompt_snapshots,
)
from .registry import KINDS, adopt, kind_class
from .rotating import RotatingKVCache
from .serialize import FORMAT_VERSION, from_flat, to_flat
from .snapshot import Snapshot, arrays_equal
from .speculation import Speculation, begin_speculation


def merge_snapshots(parent, child):
    """`[a, b)` + `[b, c)` -> `[a, c)` for any kind (dispatched on the snapshot's
    kind); a None side gives the other."""
    if parent is None or child is None:
        return child if parent is None else parent
    return kind_class(parent.kind).merge_chain([parent, child])


def split_snapshot(snapshot, at):
    """`[a, c)` -> (`[a, at)`, `[at, c)`) for any kind; (None, snapshot) where it cannot."""
    return kind_class(snapshot.kind).split_snapshot(snapshot, at)


__all__ = [
    "adopt",
    "adopt_prompt_cache",
    "arrays_equal",
    "ArraysCache",
    "BatchKVCache",
    "BatchRotatingKVCache",
    "begin_speculation",
    "CacheList",
    "ChunkedKVCache",
    "cut_node",
    "drop_states",
    "FORMAT_VERSION",
    "from_flat",
    "join_nodes",
    "kind_class",
    "KINDS",
    "KVCache",
    "layer_description",
    "load_mlx_lm_prompt_cache",
    "make_prompt_cache",
    "merge_prompt_chain",
    "merge_prompt_snapshots",
    "merge_snapshots",
    "node_nbytes",
    "present_layers",
    "prompt_layout",
    "prompt_position",
    "QuantizedKVCache",
    "restore_chains",
    "restore_prompt_cache",
    "richer_windows",
    "RotatingKVCache",
    "save_mlx_lm_prompt_cache",
    "Snapshot",
    "snapshot_prompt_cache",
    "SnapshotProtocol",
    "Speculation",
    "split_for_edge",
    "split_node",
    "split_prompt_snapshots",
    "split_snapshot",
    "state_nbytes",
    "to_flat",
]
