"""The public store: PromptStore, a Space per model namespace, and its Hits; CUDA:
whether MLX runs on its CUDA backend (what a server's defaults follow)."""

from ..errors import StoreDirectoryError
from ..snapshots.device import CUDA
from .figures import namespace_counters, store_totals
from .hit import Hit
from .metrics import Report
from .retention import Retention
from .space import Space
from .store import PromptStore, default_path
from .tiers import Tiers

__all__ = [
    "CUDA",
    "Hit",
    "PromptStore",
    "Report",
    "Retention",
    "Space",
    "StoreDirectoryError",
    "Tiers",
    "default_path",
    "namespace_counters",
    "store_totals",
]
