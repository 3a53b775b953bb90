"""The models the anchors run: Llama-3.2-1B's per-layer shape, and the two hybrid layouts
(sliding window, recurrent + attention)."""

from __future__ import annotations

import mlx.core as mx

from promptstore.testing.models import llama_1b_shape, tiny_model

from .workloads import Profile


def dtype_of(name: str) -> mx.Dtype:
    return getattr(mx, name)


def build_model(profile: Profile, family: str = "llama"):
    """(model, model_id, description)."""
    dtype = dtype_of(profile.dtype)
    if family == "llama":
        model = llama_1b_shape(profile.layers, dtype=dtype, vocab_size=profile.vocab)
        desc = (
            f"llama, Llama-3.2-1B per-layer shape (hidden 2048, 32 heads, 8 KV heads, head dim 64, "
            f"MLP 8192), {profile.layers} layer(s), vocab {profile.vocab}, {profile.dtype}"
        )
    else:
        h = profile.hybrid_hidden
        common = dict(
            hidden_size=h,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=h // 8,
            intermediate_size=4 * h,
            vocab_size=profile.vocab,
            max_position_embeddings=131072,
        )
        if family == "gemma3_text":
            model = tiny_model(
                family,
                dtype=dtype,
                **common,
                num_hidden_layers=6,
                sliding_window=profile.hybrid_window,
                sliding_window_pattern=6,
                query_pre_attn_scalar=h // 8,
            )
            desc = (
                f"gemma3_text layout: 6 layers {h} wide, 5 sliding-window ({profile.hybrid_window}) "
                f"+ 1 global, {profile.dtype}"
            )
        elif family == "qwen3_next":
            model = tiny_model(
                family,
                dtype=dtype,
                **common,
                num_hidden_layers=4,
                full_attention_interval=4,
                linear_num_value_heads=8,
                linear_num_key_heads=4,
                linear_key_head_dim=h // 8,
                linear_value_head_dim=h // 8,
                shared_expert_intermediate_size=4 * h,
            )
            desc = f"qwen3_next layout: 4 layers {h} wide, 3 gated-delta (recurrent) + 1 attention, {profile.dtype}"
        else:
            raise ValueError(family)
    return model, f"anchors-{family}-{profile.name}-{profile.layers}-{profile.dtype}-seed0", desc
