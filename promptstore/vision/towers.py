"""Vision towers run as mlx-vlm defines them, in fewer kernels.

Qwen2.5-VL's vision tower attends within windows (8x8 patches of 14 px) in 28
of its 32 blocks. mlx-vlm's attention splits every block's queries, keys and
values at each window's bounds (read back from the device with `tolist`, once
per block) and runs one attention per window: a 1024x768 image is 70 windows,
so ~2,000 attention calls and 32 waits on the device per image. On an H200 that
tower took 122 ms per image with cuDNN's attention and 161 ms with MLX's own,
for under 6 TFLOP of work (`tools/gpu/vision_phases.py`).

`batch_windows` makes each such attention run every window of one length as one
batch (a 1024x768 image has windows of four lengths), with each kind of block's
bounds read once per call of the tower. Each window is still attended alone, by
the same kernel over the same rows: the tower's output is bitwise the same, on
the CPU (tests/vision/test_processing.py) and on an H200. The attention modules keep their class's
parameters and names (their class is swapped for a subclass), so the model's
parameters, and the store's namespace of them, are unchanged.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import mlx.core as mx


def batch_windows(vlm) -> bool:
    """Run `vlm`'s vision tower's window attention batched by window length, where
    its tower is one this module knows (Qwen2.5-VL); returns whether it did."""
    tower = getattr(vlm, "vision_tower", None)
    if tower is None or type(tower).__module__ != "mlx_vlm.models.qwen2_5_vl.vision":
        return False
    from mlx_vlm.models.qwen2_5_vl.vision import Attention

    batched = _batched_class(Attention)
    for block in tower.blocks:
        if type(block.attn) is Attention:
            block.attn.__class__ = batched
    return True


_CLASSES: dict[type, type] = {}


def _batched_class(attention: type) -> type:
    if attention not in _CLASSES:
        _CLASSES[attention] = type("WindowBatchedAttention", (attention,), {"__call__": _batched_call})
    return _CLASSES[attention]


class _Bounds(threading.local):
    """The bounds arrays read back lately, per thread, with what was made of them: the
    tower passes one array to its window blocks and another to its full-attention
    blocks, each the same object for every block of its kind, so a tower's call reads
    each once, not once per block."""

    def __init__(self):
        self.seen: list[tuple[mx.array, tuple]] = []  # (bounds array, _groups of it), the last two


_BOUNDS = _Bounds()


def _groups(cu_seqlens: mx.array) -> tuple[list[tuple[int, mx.array, int]], mx.array]:
    """The windows of `cu_seqlens` grouped by length, each group (length, the rows of its
    windows in order, how many windows), and the order that puts the groups' rows back."""
    for array, out in _BOUNDS.seen:
        if array is cu_seqlens:
            return out
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = defaultdict(list)
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if hi > lo:
            by_length[hi - lo].append(lo)
    groups, order = [], []
    for length, starts in by_length.items():
        rows = [s + i for s in starts for i in range(length)]
        order.extend(rows)
        groups.append((length, mx.array(rows, dtype=mx.int32), len(starts)))
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    out = (groups, mx.array(inverse, dtype=mx.int32))
    _BOUNDS.seen = [*_BOUNDS.seen[-1:], (cu_seqlens, out)]
    return out


def _batched_call(self, x: mx.array, cu_seqlens: mx.array, rotary_pos_emb: mx.array = None) -> mx.array:
    """mlx-vlm's Qwen2.5-VL vision Attention.__call__, every window of a length in one call."""
    from mlx_vlm.models.qwen2_5_vl.vision import apply_rotary_pos_emb_vision

    seq_length = x.shape[0]
    qkv = self.qkv(x).reshape(seq_length, 3, self.num_heads, -1).transpose(1, 0, 2, 3)
    q, k, v = mx.split(qkv, 3)
    q = apply_rotary_pos_emb_vision(mx.expand_dims(q, 0), rotary_pos_emb)[0]
    k = apply_rotary_pos_emb_vision(mx.expand_dims(k, 0), rotary_pos_emb)[0]
    # (1, seq, heads, dim) each: rows are patches
    groups, inverse = _groups(cu_seqlens)
    heads, dim = q.shape[2], q.shape[3]
    if len(groups) == 1 and groups[0][2] == 1:  # one window: the whole image (a full-attention block)
        qs, ks, vs = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=self.scale, mask=None)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(seq_length, -1))
    outputs = []
    for length, rows, count in groups:
        qs, ks, vs = (t[0, rows].reshape(count, length, heads, dim).transpose(0, 2, 1, 3) for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=self.scale, mask=None)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(count * length, heads * dim))
    output = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
    return self.proj(output[inverse])
