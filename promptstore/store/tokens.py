"""Tokens a namespace accepts: valid ids (index.as_tokens) below its model's vocabulary.

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


def model_tokens(tokens, vocabulary: int | None) -> np.ndarray:
    """as_tokens(tokens), refusing ids at or past `vocabulary` with TokenRangeError."""
    toks = as_tokens(tokens)
    if vocabulary is not None and len(toks) and int(toks.max()) >= vocabulary:
        at = int(np.argmax(toks >= vocabulary))
        raise TokenRangeError(
            f"token {int(toks[at])} at position {at} is outside the model's vocabulary of {vocabulary} ids"
        )
    return toks
