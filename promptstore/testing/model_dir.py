"""A model directory `mlx_lm.load(dir)` reads: a tiny random-weight model's
config.json and model.safetensors, and the demo tokenizer with its chat
template, so servers and other processes load it as they would a real model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .models import model_args, tiny_model
from .tokenizer import demo_tokenizer


def write_model_dir(
    path: str | Path,
    family: str = "llama",
    *,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    **overrides: Any,
):
    """Write `family`'s random-weight model (with `overrides`, in `dtype`) and a
    BPE tokenizer of `vocab_size` tokens to `path`; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    overrides = dict(overrides, vocab_size=vocab_size)
    model = tiny_model(family, seed=seed, dtype=dtype, **overrides)
    config = dataclasses.asdict(model_args(family, **overrides))
    config["model_type"] = family
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    demo_tokenizer(vocab_size)._tokenizer.save_pretrained(str(path))
    return path
