"""Tokens a namespace accepts: valid ids (index.as_tokens) below its model's vocabulary,
and, for a vision-language model, image keys (ids from IMAGE_KEYS up: promptstore.vision.keys).

A token id past the embedding's rows makes MLX read out of bounds and crash the
process, so every entry point checks before anything runs.
"""

from __future__ import annotations

import mlx.nn as nn
import numpy as np

from ..errors import TokenRangeError
from ..index import as_tokens


def vocabulary_size(model: nn.Module) -> int | None:
    """Rows of the model's token embedding (its largest embedding table), or None if it has none."""
    rows = [
        module.num_embeddings if isinstance(module, nn.QuantizedEmbedding) else module.weight.shape[0]
        for _, module in model.named_modules()
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))
    ]
    return max(rows) if rows else None


# Ids from here up stand for image content, never for a token: no tokenizer's vocabulary reaches 2^31.
IMAGE_KEYS = 1 << 31


def model_tokens(tokens, vocabulary: int | None, image_keys: bool = False) -> np.ndarray:
    """as_tokens(tokens), refusing ids at or past `vocabulary` with TokenRangeError
    (but for image keys, ids from IMAGE_KEYS up, where `image_keys`)."""
    toks = as_tokens(tokens)
    if vocabulary is None or not len(toks):
        return toks
    outside = toks >= vocabulary
    if image_keys:
        outside &= toks < IMAGE_KEYS
    if outside.any():
        at = int(np.argmax(outside))
        raise TokenRangeError(
            f"token {int(toks[at])} at position {at} is outside the model's vocabulary of {vocabulary} ids"
        )
    return toks
