"""promptstore: a persistent prompt-cache store for MLX language models."""

from .config import Settings
from .generate import generate, stream_generate
from .store import Hit, PromptStore, Space

__version__ = "0.1.0"
__all__ = ["Hit", "PromptStore", "Settings", "Space", "generate", "stream_generate"]
