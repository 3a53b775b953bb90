"""The public store: PromptStore, a Space per model namespace, and its Hits."""

from ..errors import StoreDirectoryError
from .hit import Hit
from .metrics import Report
from .space import Space
from .store import PromptStore, default_path
from .tiers import Tiers

__all__ = ["Hit", "PromptStore", "Report", "Space", "StoreDirectoryError", "Tiers", "default_path"]
