"""Per-kind drivers for property tests: build a cache by feeding it chunks of
positions whose contents encode the position, and read back its logical state.

Because a position's keys depend only on the position, a cache built in other
chunks, or restored from snapshots, must hold the same logical state.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from promptstore import caches as C

H, D = 2, 32


def kv_rows(lo: int, hi: int, batch: int = 1, dtype=mx.float32):
    """Keys and values for positions [lo, hi): each row encodes its position."""
    pos = mx.arange(lo, hi, dtype=mx.float32)[None, None, :, None]
    head = mx.arange(H, dtype=mx.float32)[None, :, None, None] * 0.25
    dim = mx.arange(D, dtype=mx.float32)[None, None, None, :] * 0.01
    base = mx.broadcast_to(pos + head + dim, (batch, H, hi - lo, D))
    return base.astype(dtype), (-base).astype(dtype)


class Driver:
    kind: str
    batch = 1

    def new(self):
        raise NotImplementedError

    def update(self, cache, lo: int, hi: int) -> None:
        cache.update_and_fetch(*kv_rows(lo, hi, self.batch))

    def logical(self, cache) -> dict:
        raise NotImplementedError

    def build(self, chunks: list[int], target: int | None = None):
        """A cache fed `chunks`, cut at `target`; also the chunk boundaries."""
        cache, pos, bounds = self.new(), 0, [0]
        for n in chunks:
            hi = pos + n if target is None else min(pos + n, target)
            if hi > pos:
                self.update(cache, pos, hi)
            pos = hi
            bounds.append(pos)
        return cache, bounds


def _np(x):
    return None if x is None else np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)


class KVDriver(Driver):
    kind = "kv"

    def new(self):
        return C.KVCache()

    def logical(self, cache):
        if cache.keys is None:
            return {"offset": cache.offset}
        k, v = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        return {"offset": cache.offset, "k": _np(k), "v": _np(v)}


class QuantizedDriver(Driver):
    kind = "quantized"

    def new(self):
        return C.QuantizedKVCache(group_size=32, bits=8)

    def logical(self, cache):
        if cache.keys is None:
            return {"offset": cache.offset}
        k, v = cache.keys_and_values() if cache.offset else (cache.keys, cache.values)
        parts = {f"k{i}": _np(a[..., : cache.offset, :]) for i, a in enumerate(k)}
        parts.update({f"v{i}": _np(a[..., : cache.offset, :]) for i, a in enumerate(v)})
        return {"offset": cache.offset, **parts}


class ChunkedDriver(Driver):
    kind = "chunked"
    chunk = 8

    def new(self):
        return C.ChunkedKVCache(self.chunk)

    def update(self, cache, lo, hi):
        cache.maybe_trim_front()  # as llama4 does before every forward
        super().update(cache, lo, hi)

    def logical(self, cache):
        # Only the chunk the next position falls in is ever attended to.
        first = cache.offset // self.chunk * self.chunk
        if cache.keys is None or first == cache.offset:
            return {"offset": cache.offset}
        k, v = cache.keys_and_values()
        lo = first - cache.start_position
        return {"offset": cache.offset, "k": _np(k[..., lo:, :]), "v": _np(v[..., lo:, :])}


class RotatingDriver(Driver):
    kind = "rotating"

    def __init__(self, max_size=12, keep=0):
        self.max_size, self.keep = max_size, keep

    def new(self):
        return C.RotatingKVCache(max_size=self.max_size, keep=self.keep)

    def logical(self, cache):
        """The window the next step attends to: the keep first positions and the
        last max_size - keep (a longer buffer after a chunked update trims the rest
        before it is read)."""
        if cache.keys is None:
            return {"offset": cache.offset}
        k = cache._temporal_order(cache.keys)
        v = cache._temporal_order(cache.values)
        if cache.offset > cache.max_size:
            tail = cache.max_size - cache.keep
            k = mx.concatenate([k[..., : cache.keep, :], k[..., -tail:, :]], axis=2)
            v = mx.concatenate([v[..., : cache.keep, :], v[..., -tail:, :]], axis=2)
        return {"offset": cache.offset, "k": _np(k), "v": _np(v)}


class ArraysDriver(Driver):
    kind = "arrays"

    def new(self):
        return C.ArraysCache(2)

    def update(self, cache, lo, hi):
        cache[0] = mx.full((1, 3, 4), float(hi))
        cache[1] = mx.full((1, 2, 4, 4), float(hi * 2 + lo))
        cache.advance(hi - lo)

    def logical(self, cache):
        return {"offset": cache.offset, **{f"s{i}": _np(a) for i, a in enumerate(cache.cache)}}


class CacheListDriver(Driver):
    kind = "cache_list"

    def __init__(self, second: Driver):
        self.first, self.second = ArraysDriver(), second

    def new(self):
        return C.CacheList(self.first.new(), self.second.new())

    def update(self, cache, lo, hi):
        self.first.update(cache.caches[0], lo, hi)
        self.second.update(cache.caches[1], lo, hi)

    def logical(self, cache):
        a, b = self.first.logical(cache.caches[0]), self.second.logical(cache.caches[1])
        return {**{f"a.{k}": x for k, x in a.items()}, **{f"b.{k}": x for k, x in b.items()}}


class BatchKVDriver(Driver):
    kind = "batch_kv"
    batch = 2

    def new(self):
        return C.BatchKVCache(left_padding=[1, 0])

    def logical(self, cache):
        out = {"idx": cache._idx, "offset": _np(cache.offset), "lp": _np(cache.left_padding)}
        if cache.keys is not None:
            k, v = cache.keys_and_values()
            out.update(k=_np(k), v=_np(v))
        return out


class BatchRotatingDriver(Driver):
    kind = "batch_rotating"
    batch = 2

    def __init__(self, max_size=12):
        self.max_size = max_size

    def new(self):
        return C.BatchRotatingKVCache(self.max_size, left_padding=[1, 0])

    def logical(self, cache):
        out = {"pos": cache._offset, "offset": _np(cache.offset), "lp": _np(cache.left_padding)}
        if cache.keys is not None:
            k = mx.roll(cache.keys, -cache._idx, axis=2) if cache.rotated else cache.keys[..., : cache._idx, :]
            out["k"] = _np(k)
        return out


def _present(d: dict) -> dict:
    # An empty window and no window are the same state.
    return {k: x for k, x in d.items() if not (isinstance(x, np.ndarray) and x.size == 0 and k not in ("offset", "lp"))}


def same(a: dict, b: dict) -> bool:
    a, b = _present(a), _present(b)
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
                return False
            if x.shape != y.shape or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True
