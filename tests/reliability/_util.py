"""Helpers shared by the reliability tests."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

from ..conftest import forward, fresh_cache

TOL = 1e-4


def prefill_insert(space, model, tokens):
    """Fetch `tokens`, prefill what was not served, insert them all; returns the hit."""
    hit = space.fetch(tokens)
    forward(model, hit.cache, tokens[hit.length :])
    space.insert(tokens, hit.cache)
    return hit


def continuation_error(space, model, tokens) -> tuple[int, float]:
    """(hit length, max |logits - full prefill|) for a fetch of `tokens`."""
    hit = space.fetch(tokens)
    got = forward(model, hit.cache, tokens[hit.length :])
    want = forward(model, fresh_cache(model), tokens)
    return hit.length, mx.abs(got - want).max().item()


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (not following links): path -> (kind, size, mtime_ns, mode, link target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            link = os.readlink(p) if os.path.islink(p) else None
            kind = "link" if link is not None else ("dir" if os.path.isdir(p) else "file")
            size = 0 if kind == "dir" else st.st_size  # a directory's size and mtime change with its entries
            mtime = 0 if kind == "dir" else st.st_mtime_ns
            out[p] = (kind, size, mtime, st.st_mode, link)
    return out


def changes_outside(before: dict, after: dict, allowed: list[Path]) -> list[str]:
    """Paths created, removed or changed between two tree_state()s that are not under `allowed`."""
    roots = [str(a) for a in allowed]

    def inside(p: str) -> bool:
        return any(p == r or p.startswith(r + os.sep) for r in roots)

    changed = [p for p in set(before) | set(after) if before.get(p) != after.get(p)]
    return sorted(p for p in changed if not inside(p))
