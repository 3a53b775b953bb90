"""The mlx-lm cache files comparison: save_prompt_cache / load_prompt_cache, one file
per conversation."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from mlx_lm.models import cache as mlc

from .harness import Contender, Outcome
from .workloads import Request


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if diff.size else n


class Files(Contender):
    """mlx-lm's save_prompt_cache / load_prompt_cache, one file per conversation."""

    name = "mlx-lm cache files"
    persistent = True

    def __init__(self, engine, root: Path, held: dict | None = None):
        super().__init__(engine)
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.held: dict[str, list[int]] = held if held is not None else {}  # what each file holds

    def path(self, conv: str) -> Path:
        return self.root / f"{conv}.safetensors"

    def _source(self, req: Request) -> tuple[str | None, int]:
        """The file to start from and how many of its tokens the prompt shares."""
        for conv in (req.conv, req.parent):
            if conv is not None and conv in self.held and self.path(conv).exists():
                return conv, min(common_prefix(self.held[conv], req.prompt), len(req.prompt) - 1)
        return None, 0

    def serve(self, req):
        out = Outcome(req.name, len(req.prompt))
        t0 = time.perf_counter()
        conv, shared = self._source(req)
        cache, restored = None, 0
        if conv is not None and shared > 0:
            cache = mlc.load_prompt_cache(str(self.path(conv)))
            extra = len(self.held[conv]) - shared
            if extra == 0:
                restored = shared
            elif mlc.can_trim_prompt_cache(cache):
                mlc.trim_prompt_cache(cache, extra)
                restored = shared
            else:
                cache = None
        if cache is None:
            cache, restored = mlc.make_prompt_cache(self.engine.model), 0
        self._restored(out, cache, restored, t0)
        self.engine.generate(cache, req.prompt[restored:], t0, out)
        mlc.save_prompt_cache(str(self.path(req.conv)), cache, {"tokens": str(len(req.prompt) + len(out.reply))})
        self.held[req.conv] = req.prompt + out.reply
        out.total_s = time.perf_counter() - t0
        return out

    def probe(self, req):
        conv, shared = self._source(req)
        if conv is None:
            return 0
        if shared == len(self.held[conv]):
            return shared
        cache = mlc.load_prompt_cache(str(self.path(conv)))
        return shared if mlc.can_trim_prompt_cache(cache) else 0
