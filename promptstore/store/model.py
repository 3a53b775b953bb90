"""What a namespace reads of a model: its layers' specs, its dtype, its weights' digest
and fingerprint; and whether a cache fits it (layout and arrays), before an insert
stores anything of it."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import caches as C
from ..errors import CacheShapeError, UnsupportedCacheError
from ..index import LayerSpec
from ..snapshots import device


def layer_spec(cache: Any, dtype: str) -> LayerSpec:
    return _spec(C.layer_description(cache), dtype)


def _spec(description: dict, dtype: str) -> LayerSpec:
    # The dtype is a property of the arrays, so of the leaves: a composite layer has none.
    children = description.get("children")
    if children:
        return LayerSpec(kind=description["kind"], children=[_spec(c, dtype) for c in children])
    return LayerSpec(**description, dtype=dtype)


def model_dtype(model: nn.Module) -> str:
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    floats = [p.dtype for _, p in params if mx.issubdtype(p.dtype, mx.floating)]
    return str(floats[0]).rsplit(".", 1)[-1] if floats else "unknown"


def weights_digest(model: nn.Module) -> str:
    """xxh3-128 over every parameter's name, dtype, shape and bytes."""
    import xxhash
    from mlx.utils import tree_flatten

    h = xxhash.xxh3_128()
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        mx.eval(p)
        h.update(f"{name}:{p.dtype}:{p.shape};".encode())
        # A copy the host reads: on CUDA the weights themselves stay on the device.
        copy = device.host_readable({"p": p})
        h.update(memoryview(mx.contiguous(copy["p"])))
        device.release_host_copies(copy)
    device.release_host_copies({}, flush=True)  # none of the copies stays in MLX's buffer cache
    return h.hexdigest()


# Values of each tensor the fingerprint reads: an 8B-parameter model's ~300 tensors
# give ~1.2 million, against the ~8 billion weights_digest reads.
FINGERPRINT_SAMPLES = 4096
# Names what the fingerprint reads: a store that recorded another version's is not
# refused for it (the next bind records this one instead).
FINGERPRINT_VERSION = "xxh3-sampled-v1"


def weights_fingerprint(model: nn.Module) -> str:
    """xxh3-128 over every parameter's name, dtype and shape, and FINGERPRINT_SAMPLES
    evenly spaced values of each (all of a smaller one): cheap enough for every
    start of a large model, where weights_digest reads every weight.

    It tells apart another model (names, shapes or dtypes, or values), the same
    model re-scaled or quantized otherwise, and a fine-tune (one moves nearly every
    value, a merged LoRA adapter too; one left unmerged adds parameters). It can
    miss a change to a few isolated weights that no sampled position holds.
    """
    import xxhash
    from mlx.utils import tree_flatten

    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    samples = {}
    for name, p in params:
        flat = p.reshape(-1)
        step = max(1, flat.size // FINGERPRINT_SAMPLES)
        samples[name] = mx.contiguous(flat[::step][:FINGERPRINT_SAMPLES])  # a strided gather, evaluated below
    mx.eval(list(samples.values()))
    # Copies the host reads: on CUDA the weights and their samples stay on the device.
    copies = device.host_readable(samples)
    h = xxhash.xxh3_128()
    for name, p in params:
        h.update(f"{name}:{p.dtype}:{p.shape};".encode())
        h.update(memoryview(copies[name]))
    device.release_host_copies(copies, flush=True)
    return f"{FINGERPRINT_VERSION}:{h.hexdigest()}"


def check_layout(cache: Any, namespace, dtype: str) -> None:
    """A list of `namespace`'s cache kinds and layouts, or a typed error."""
    if not isinstance(cache, (list, tuple)) or not all(isinstance(c, C.SnapshotProtocol) for c in cache):
        raise UnsupportedCacheError(
            "insert takes the list of per-layer caches a model ran with "
            "(promptstore caches: see caches.make_prompt_cache / adopt_prompt_cache)"
        )
    given = [layer_spec(c, dtype) for c in cache]
    if given != list(namespace.spec.layers):
        raise CacheShapeError(
            f"the cache's layout does not match namespace {namespace.hex[:12]}: "
            f"{len(given)} layers of {[g.kind for g in given][:4]}..."
        )


def check_arrays(cache: Any, expected: list) -> None:
    """Every layer's arrays have the dtype, batch size, head count and head dim the
    model gives them (`expected`: its per-layer signatures): another model with the
    same layer kinds, or a batch of 2, would otherwise be stored and later served
    to this one."""
    for i, (c, want) in enumerate(zip(cache, expected)):
        got = c.signature()
        if got != want:
            raise CacheShapeError(
                f"layer {i}'s arrays are {_describe(got)}, but this namespace's model "
                f"makes {_describe(want)} (name, dtype, shape without the token axis)"
            )


def _describe(signature: tuple) -> str:
    """A `signature()` in words: 'keys float16 [1, 8, 64], ...', a cache list's children in []."""
    parts = [
        f"{e[0]} {e[1].rsplit('.', 1)[-1]} {list(e[2])}" if e and isinstance(e[0], str) else f"[{_describe(e)}]"
        for e in signature
    ]
    return ", ".join(parts) or "none"
