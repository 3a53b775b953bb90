"""promptstore: a persistent prompt-cache store for MLX language models.

The public names load lazily, so `import promptstore.index` (which uses no
MLX) does not pull MLX in.
"""

__version__ = "0.1.0"
__all__ = ["Hit", "PromptStore", "Retention", "Settings", "Space", "generate", "stream_generate"]

_HOMES = {
    "Hit": "store",
    "PromptStore": "store",
    "Retention": "store",
    "Space": "store",
    "Settings": "config",
    "generate": "generation",
    "stream_generate": "generation",
}


def __getattr__(name):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'promptstore' has no attribute {name!r}")
