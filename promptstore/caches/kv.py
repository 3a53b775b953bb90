"""Full-attention kinds: KV, quantized KV and chunked KV.

Each is mlx-lm's class of the same name (so models, generation, batching and
mlx-lm's prompt-cache files treat it as their own) plus range snapshots.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..errors import CacheShapeError, SnapshotFormatError
from .range import RangeKind
from .registry import adopt, kind_class, register
from .snapshot import Snapshot


@register
class KVCache(RangeKind, mlx_cache.KVCache):
    """mlx-lm's step-buffered full-attention cache, with range snapshots."""

    kind: ClassVar[str] = "kv"

    def live_buffers(self):
        if self.keys is None:
            return None
        return {"keys": self.keys, "values": self.values}

    def plan_install(self, buffers, lo, target, last):
        return {"keys": buffers["keys"], "values": buffers["values"], "offset": target}

    def _plan_rewind(self, target):
        return {"offset": target}

    @classmethod
    def validate_extra(cls, snapshot: Snapshot) -> None:
        k, v = snapshot.arrays["keys"], snapshot.arrays["values"]
        if k.dtype != v.dtype:
            raise CacheShapeError(f"keys are {k.dtype} but values are {v.dtype}")

    @classmethod
    def merge(cls, caches):
        return kind_class("batch_kv").merge(caches)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        return adopt(super().to_quantized(group_size=group_size, bits=bits))


@register
class QuantizedKVCache(RangeKind, mlx_cache.QuantizedKVCache):
    """mlx-lm's quantized KV cache: (packed, scales, biases) per keys and values."""

    kind: ClassVar[str] = "quantized"
    expected_names: ClassVar[tuple[str, ...]] = tuple(f"{w}.{i}" for w in ("keys", "values") for i in range(3))

    def layout(self) -> dict:
        return {"group_size": int(self.group_size), "bits": int(self.bits)}

    def live_buffers(self):
        if self.keys is None:
            return None
        out = {}
        for which, parts in (("keys", self.keys), ("values", self.values)):
            out.update({f"{which}.{i}": p for i, p in enumerate(parts)})
        return out

    def plan_install(self, buffers, lo, target, last):
        return {
            "keys": tuple(buffers[f"keys.{i}"] for i in range(3)),
            "values": tuple(buffers[f"values.{i}"] for i in range(3)),
            "offset": target,
        }

    def _plan_rewind(self, target):
        return {"offset": target}

    @classmethod
    def validate_extra(cls, snapshot: Snapshot) -> None:
        bits, group = snapshot.scalars.get("bits"), snapshot.scalars.get("group_size")
        if not isinstance(bits, int) or not isinstance(group, int) or bits <= 0 or group <= 0:
            raise SnapshotFormatError(f"bad quantization: bits={bits!r} group_size={group!r}")
        for which in ("keys", "values"):
            packed, scales, biases = (snapshot.arrays[f"{which}.{i}"] for i in range(3))
            if packed.dtype != mx.uint32:
                raise CacheShapeError(f"{which}.0 must be uint32, got {packed.dtype}")
            dim = packed.shape[3] * 32 // bits
            if scales.shape != biases.shape or scales.shape[3] * group != dim:
                raise CacheShapeError(
                    f"{which}: scales {tuple(scales.shape)} and biases {tuple(biases.shape)} "
                    f"do not fit {dim}-wide rows in groups of {group}"
                )


@register
class ChunkedKVCache(RangeKind, mlx_cache.ChunkedKVCache):
    """mlx-lm's chunked-attention cache (llama4): only the current chunk matters.

    Positions before the current chunk are never attended to again, so the
    cache may drop them; snapshots record where their data starts, and a
    restore installs just the chunk the target falls in.
    """

    kind: ClassVar[str] = "chunked"
    trims_front: ClassVar[bool] = True

    def layout(self) -> dict:
        return {"chunk_size": int(self.chunk_size)}

    def live_buffers(self):
        if self.keys is None:
            return None
        return {"keys": self.keys, "values": self.values}

    def live_data_start(self) -> int:
        return self.start_position

    def install_from(self, target: int) -> int:
        return target // self.chunk_size * self.chunk_size

    def plan_install(self, buffers, lo, target, last):
        return {
            "keys": buffers["keys"],
            "values": buffers["values"],
            "offset": target,
            "start_position": lo,
        }

    def _plan_rewind(self, target):
        if self.install_from(target) < self.start_position:
            return None  # the target's chunk starts at positions already dropped
        return {"offset": target}

    validate_extra = KVCache.validate_extra
