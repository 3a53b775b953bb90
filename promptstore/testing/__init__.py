"""Helpers for promptstore's tests, demos and benchmarks.

`models` builds random-weight mlx-lm models, one per cache kind mlx-lm has.
"""

from .models import FAMILIES, llama_1b_shape, model_args, tiny_model

__all__ = ["FAMILIES", "llama_1b_shape", "model_args", "tiny_model"]
