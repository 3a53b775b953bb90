"""Random-weight vision-language model folders that `mlx_vlm.load(dir)` reads:
mlx-vlm's own model classes at toy size (config.json, model.safetensors), a
BPE tokenizer with the family's special tokens and an image-aware chat
template, and the family's image-processor config, so tests, demos and
benchmarks run real images through real processors with nothing downloaded.

    qwen2_vl     mrope positions, one placeholder run per image sized by its grid
    qwen2_5_vl   the same, with a windowed vision tower
    gemma3       sliding-window layers beside global ones, a fixed run per image
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .models import _reinitialise
from .tokenizer import train_bpe

VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "gemma3")

_QWEN_SPECIAL = [
    "<pad>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_GEMMA_SPECIAL = [
    "<pad>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

# A message's content is a string, or a list of parts ({"type": "text", "text": ...}
# or {"type": "image"}): the placeholder where each image goes, as the real templates do.
_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

_QWEN_TEXT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
    # head_dim 16: 8 rotary frequencies, split over (time, height, width).
    rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]},
)
# 28-pixel cells (a 14-pixel patch, merged 2x2) make one token each: an image of
# at most 112x112 pixels is at most 16 tokens; 56x56 is the least (4 tokens).
QWEN_PIXELS = dict(min_pixels=56 * 56, max_pixels=112 * 112)
_QWEN_PROCESSOR = dict(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)
# Gemma 3: every image is resized to 56x56 (4x4 patches of 14), pooled to 2x2 = 4 tokens.
GEMMA_IMAGE_SIZE = 56
GEMMA_TOKENS_PER_IMAGE = 4


def write_vision_dir(
    path: str | Path,
    family: str,
    *,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    processor: dict[str, Any] | None = None,
) -> Path:
    """Write `family`'s random-weight model, tokenizer and processor config to `path`.

    text / vision / processor: overrides of the text model's, the vision tower's
    and the image processor's settings (a benchmark's larger shape, larger images)."""
    if family not in VISION_FAMILIES:
        raise ValueError(f"unknown vision family {family!r}; expected one of {VISION_FAMILIES}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    qwen = family != "gemma3"
    tokenizer = _tokenizer(vocab_size, _QWEN_SPECIAL if qwen else _GEMMA_SPECIAL, qwen)
    # The corpus may not make `vocab_size` tokens: the model has as many as the tokenizer,
    # so that every id it generates decodes.
    vocab_size = min(vocab_size, len(tokenizer))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (_QWEN_SPECIAL if qwen else _GEMMA_SPECIAL)}
    if qwen:
        config = _qwen_config(family, ids, vocab_size, text or {}, vision or {})
        preprocessor = dict(
            _QWEN_PROCESSOR,
            **QWEN_PIXELS,
            image_processor_type="Qwen2VLImageProcessor",
            processor_class="Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen2VLProcessor",
        )
        (path / "preprocessor_config.json").write_text(json.dumps(dict(preprocessor, **(processor or {})), indent=1))
    else:
        config = _gemma_config(ids, vocab_size, text or {}, vision or {})
        size = config["vision_config"]["image_size"]
        preprocessor = dict(
            image_processor_type="Gemma3ImageProcessor",
            processor_class="Gemma3Processor",
            size={"height": size, "width": size},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
            do_pan_and_scan=False,
        )
        (path / "preprocessor_config.json").write_text(json.dumps(dict(preprocessor, **(processor or {})), indent=1))
        (path / "processor_config.json").write_text(
            json.dumps({"image_seq_length": config["text_config"]["mm_tokens_per_image"]})
        )
    tokenizer.save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(tokenizer.chat_template)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    weights = _random_weights(config, seed, dtype)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def _tokenizer(vocab_size: int, special: list[str], qwen: bool):
    from transformers import PreTrainedTokenizerFast

    bpe = train_bpe(vocab_size, special)
    if qwen:
        return PreTrainedTokenizerFast(
            tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<pad>", chat_template=_QWEN_TEMPLATE
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<bos>",
        eos_token="<end_of_turn>",
        pad_token="<pad>",
        chat_template=_GEMMA_TEMPLATE,
        extra_special_tokens={
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )


def _qwen_config(family: str, ids: dict, vocab_size: int, text: dict, vision: dict) -> dict:
    hidden = text.get("hidden_size", _QWEN_TEXT["hidden_size"])
    if family == "qwen2_vl":
        tower = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=hidden)
    else:
        # A 56-pixel window (2x2 merged tokens) so that the toy images span several windows.
        tower = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=hidden,
            num_heads=2,
            window_size=56,
            fullatt_block_indexes=[1],
        )
    tower.update(
        model_type=family,
        patch_size=14,
        spatial_patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    return dict(
        _QWEN_TEXT,
        **text,
        model_type=family,
        vocab_size=vocab_size,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=None,
        vision_config=dict(tower, **vision),
    )


def _gemma_config(ids: dict, vocab_size: int, text: dict, vision: dict) -> dict:
    text_config = dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        # Layers 0 and 2 slide over 24 positions, 1 and 3 are global: test prompts wrap the window.
        sliding_window=24,
        sliding_window_pattern=2,
        mm_tokens_per_image=GEMMA_TOKENS_PER_IMAGE,
        max_position_embeddings=32768,
    )
    text_config.update(text)
    vision_config = dict(
        model_type="siglip_vision_model",
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        patch_size=14,
        image_size=GEMMA_IMAGE_SIZE,
    )
    vision_config.update(vision)
    return dict(
        model_type="gemma3",
        text_config=text_config,
        vision_config=vision_config,
        vocab_size=vocab_size,
        hidden_size=text_config["hidden_size"],
        image_token_index=ids["<image_soft_token>"],
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<end_of_turn>"], ids["<eos>"]],
    )


def _random_weights(config: dict, seed: int, dtype: mx.Dtype) -> dict:
    """mlx-vlm's model for `config`, with matrices redrawn as promptstore.testing.models does."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    module, _ = get_model_and_args(config=dict(config))
    params = json.loads(json.dumps(config))
    params.setdefault("text_config", {})
    params.setdefault("vision_config", {})
    model_config = update_module_configs(module.ModelConfig.from_dict(params), module, params, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    _reinitialise(model)
    model.set_dtype(dtype)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    return weights
