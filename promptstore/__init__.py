"""promptstore: a persistent prompt-cache store for MLX language models."""

__version__ = "0.1.0"
