"""Random-weight mlx-lm models for tests, demos and benchmarks: real mlx-lm
model classes at toy size, covering every cache kind mlx-lm has, that run on
CPU in milliseconds with no weights to download."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

# Every family and the cache kinds make_prompt_cache gives it:
#   llama        KVCache
#   gemma3_text  RotatingKVCache (sliding layers) + KVCache (global layers)
#   qwen3_next   ArraysCache (gated-delta layers) + KVCache
#   llama4       ChunkedKVCache (chunked layers) + KVCache (every 4th layer)
#   falcon_h1    CacheList(ArraysCache, KVCache) on every layer
#   baichuan_m1  CacheList(ArraysCache, RotatingKVCache | KVCache)
FAMILIES = (
    "llama",
    "gemma3_text",
    "qwen3_next",
    "llama4",
    "falcon_h1",
    "baichuan_m1",
)

# Small enough that a ~100-token forward is milliseconds on CPU. The window
# and chunk sizes are small so that short test prompts wrap and roll them.
SLIDING_WINDOW = 16
ATTENTION_CHUNK_SIZE = 16

# Weight matrices are redrawn with variance 1/fan_in: at width 2048 that is
# the usual std 0.02; at width 64 it keeps each sublayer's output as large as
# the residual it joins. (A flat 0.02 at width 64 leaves the residual close
# to the current token's embedding: logits barely depend on context and
# greedy decoding repeats one token, useless for telling a right cache from a
# wrong one.) Norm scales, biases and the recurrences' 1-D constants (A_log,
# dt_bias, D) keep their constructor values: redrawn around zero they would
# zero the norms.

# The demo's llama (4 layers, hidden 256; 4 KiB of KV per token in float32): the
# demo, the CPU benchmarks and the wear benchmark build it with the demo tokenizer's vocabulary.
DEMO_LLAMA = dict(
    num_hidden_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=512,
)

_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
)

# MoE layers are left out (num_experts=0, a huge interleave step): top-k
# routing is discontinuous, so a last-bit difference can flip an expert and
# make two mathematically equal prefills disagree by far more than rounding.
_ARGS: dict[str, dict[str, Any]] = {
    # Untied head: with tied embeddings a 2-layer model predicts the token it
    # was just given, so greedy decoding repeats one token forever.
    "llama": dict(_COMMON, num_hidden_layers=2, rope_theta=500000.0, tie_word_embeddings=False),
    "gemma3_text": dict(
        _COMMON,
        num_hidden_layers=4,
        num_key_value_heads=1,
        query_pre_attn_scalar=16,
        sliding_window=SLIDING_WINDOW,
        # Layers 0 and 2 slide, 1 and 3 are global.
        sliding_window_pattern=2,
    ),
    "qwen3_next": dict(
        _COMMON,
        num_hidden_layers=4,
        # Layers 0 and 2 are gated-delta (recurrent), 1 and 3 attention.
        full_attention_interval=2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=1,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=128,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
    ),
    "llama4": dict(
        _COMMON,
        model_type="llama4_text",
        # mlx-lm hard-codes every 4th layer as global (no RoPE, KVCache);
        # layers 0-2 attend within chunks (ChunkedKVCache).
        num_hidden_layers=4,
        attention_chunk_size=ATTENTION_CHUNK_SIZE,
        attention_bias=False,
        interleave_moe_layer_step=1_000_000,
        intermediate_size_mlp=128,
        num_experts_per_tok=1,
        num_local_experts=2,
        rope_scaling=None,
        rope_theta=500000.0,
        use_qk_norm=True,
    ),
    "falcon_h1": dict(
        _COMMON,
        num_hidden_layers=2,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        # Untied: the tied head scales logits by lm_head/embedding
        # multipliers (~0.007), which assume checkpoint-folded weights.
        tie_word_embeddings=False,
    ),
    "baichuan_m1": dict(
        _COMMON,
        num_hidden_layers=4,
        sliding_window=SLIDING_WINDOW,
        sliding_window_layers=[0, 2],
        conv_window=2,
        rope_theta=10000.0,
    ),
}


def model_args(family: str, **overrides: Any):
    """The mlx-lm ModelArgs tiny_model builds `family` from.

    `overrides` replace config keys; for llama4 they go into `text_config`,
    where all of its text-model settings live.
    """
    if family not in _ARGS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    config = dict(_ARGS[family], **overrides)
    if family == "llama4":
        config = {"model_type": "llama4", "text_config": config}
    else:
        config["model_type"] = family
    return _module(family).ModelArgs.from_dict(config)


def tiny_model(family: str, *, seed: int = 0, dtype: mx.Dtype = mx.float32, **overrides: Any) -> nn.Module:
    """A small `family` model with weights fixed by `seed`, in eval mode.

    `overrides` go to model_args. Reseeds mlx's global generator: the
    constructors draw from it too (e.g. qwen3_next's A_log).
    """
    mx.random.seed(seed)
    model = _module(family).Model(model_args(family, **overrides))
    _reinitialise(model)
    if family == "baichuan_m1":
        _init_baichuan_convs(model)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


def llama_1b_shape(
    num_layers: int = 4,
    *,
    dtype: mx.Dtype = mx.float16,
    seed: int = 0,
    vocab_size: int = 32000,
) -> nn.Module:
    """A llama with Llama-3.2-1B's per-layer shape and `num_layers` layers.

    Caches and attention cost per token match the real model layer for
    layer; the vocabulary is smaller only to save memory.
    """
    return tiny_model(
        "llama",
        seed=seed,
        dtype=dtype,
        num_hidden_layers=num_layers,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=vocab_size,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
    )


def _module(family: str):
    return importlib.import_module(f"mlx_lm.models.{family}")


def _reinitialise(model: nn.Module) -> None:
    # Redraw matrices only (see the note at the top). Each is drawn in float32
    # and evaluated at once, so the weights do not depend on `dtype` and a
    # large model never holds all its float32 drafts at the same time.
    fresh = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            # Uniform with std 1/sqrt(fan_in): as good as a normal here and
            # ~3.5x faster to draw on CPU (seconds saved on llama_1b_shape).
            bound = (3 / _fan_in(name, p.shape)) ** 0.5
            p = mx.random.uniform(-bound, bound, p.shape, dtype=mx.float32)
            mx.eval(p)
        fresh.append((name, p))
    model.update(tree_unflatten(fresh))


def _fan_in(name: str, shape: tuple[int, ...]) -> int:
    # Linear, Embedding and expert weights keep inputs on the last axis; a
    # depthwise Conv1d weight is (channels, kernel, 1) and sums over the kernel.
    if "conv1d" in name:
        return shape[-2] * shape[-1]
    return shape[-1]


def _init_baichuan_convs(model: nn.Module) -> None:
    # Baichuan-M1 mixes each key and value with the previous token's through a
    # 2-tap conv that the constructor zeroes (which would zero every key and
    # value). Mostly-current-token taps keep attention meaningful while still
    # making the conv state in the cache matter.
    for layer in model.layers:
        attn = layer.self_attn
        shape = attn.conv_k.shape
        taps = mx.array([0.3, 0.7])
        for name in ("conv_k", "conv_v"):
            noise = mx.random.normal(shape) * 0.02
            setattr(attn, name, mx.broadcast_to(taps, shape) + noise)
