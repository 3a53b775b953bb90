"""Speculation: run a forward over draft tokens, keep only the accepted prefix.

Range layers rewind in place. A window that has dropped tokens, or a
recurrence, cannot forget a token once it has seen it, so the transaction
keeps their state from before the draft and, when some draft tokens are
rejected, restores it and replays the accepted ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..errors import CacheError
from .prompt import prompt_position, restore_prompt_cache


class Speculation:
    """A cache transaction for one speculative forward.

    caches: the model's per-layer caches, at the position the draft starts.
    """

    def __init__(self, caches: Sequence[Any]):
        self.caches = list(caches)
        self.start = prompt_position(self.caches)
        # Range layers just rewind later; the others are copied now: recurrent
        # state as it is, a window with the positions it holds (a draft may push
        # some of them out).
        self._saved = [_saved(c, self.start) for c in self.caches]
        self.done = False

    def commit(
        self,
        accepted: int,
        tokens: Sequence[int] | None = None,
        replay: Callable[[mx.array], Any] | None = None,
    ) -> None:
        """Keep the first `accepted` draft tokens; the rest leave no trace.

        tokens: the draft tokens the forward ran over.
        replay: runs the model over tokens (shape [1, n]) with these caches;
            needed only when a layer cannot rewind in place.
        """
        if self.done:
            raise CacheError("this speculation was already committed")
        position = prompt_position(self.caches)
        if not 0 <= accepted <= position - self.start:
            raise CacheError(f"accepted {accepted} of {position - self.start} speculated tokens")
        target = self.start + accepted
        if target == position or restore_prompt_cache(self.caches, None, target):
            self.done = True
            return
        if accepted and (tokens is None or replay is None):
            raise CacheError("these caches cannot rewind in place: pass tokens and replay")
        if not restore_prompt_cache(self.caches, self._saved, self.start):
            raise CacheError("could not return to the start of the speculation")
        if accepted:
            replay(mx.array(list(tokens)[:accepted])[None])
            prompt_position(self.caches)
        self.done = True

    def rollback(self) -> None:
        """Forget every draft token (commit none)."""
        self.commit(0)


def _saved(cache, start: int):
    if cache.role == "range":
        return None
    return cache.snapshot(0 if _has_window(cache) else start)


def _has_window(cache) -> bool:
    return cache.role == "window" or any(c.role == "window" for c in getattr(cache, "caches", ()))


def begin_speculation(caches: Sequence[Any]) -> Speculation:
    """Start a speculation transaction at the caches' current position."""
    return Speculation(caches)
