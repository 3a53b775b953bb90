"""Snapshot tiers: hot (this process's memory) and cold (safetensors files)."""

from .cold import ColdTier, FileRef, NodeFileMeta
from .hot import HotEntry, HotTier
from .writer import SpillJob, Writer

__all__ = ["ColdTier", "FileRef", "HotEntry", "HotTier", "NodeFileMeta", "SpillJob", "Writer"]
