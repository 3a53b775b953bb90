"""promptstore's contender: the calls promptstore.stream_generate makes."""

from __future__ import annotations

import time
from pathlib import Path

from promptstore import PromptStore
from promptstore.caches import prompt_position

from .harness import Contender, Outcome
from .workloads import GiB


class Store(Contender):
    """promptstore: the calls promptstore.stream_generate makes, in its order."""

    persistent = True

    def __init__(self, engine, root: Path, model_id: str, *, cold_only: bool = False, hot_bytes: int = 2 * GiB):
        super().__init__(engine)
        self.root, self.model_id, self.cold_only = root, model_id, cold_only
        self.name = "promptstore cold only" if cold_only else "promptstore hot"
        self.settings = dict(hot_bytes=0 if cold_only else hot_bytes, prefill_step=engine.profile.prefill_step)
        if engine.profile.checkpoint_interval is not None:
            self.settings["checkpoint_interval"] = engine.profile.checkpoint_interval
        self.store = PromptStore.open(root, **self.settings)
        self.space = self.store.bind(engine.model, model_id=model_id)

    def serve(self, req):
        out = Outcome(req.name, len(req.prompt))
        tokens, space = req.prompt, self.space
        t0 = time.perf_counter()
        # The end of the system segment, as the mlx-lm server is told it (see LRU).
        hit = space.fetch(tokens, checkpoints=(req.sys_end,) if 0 < req.sys_end < len(tokens) else ())
        cache, position = hit.cache, hit.length
        self._restored(out, cache, hit.length, t0)
        out.cold_tokens, out.matched = hit.cold_tokens, hit.matched
        for point in [p for p in hit.checkpoints if p < len(tokens) - 1] + [len(tokens) - 1]:
            if point <= position:
                continue
            started = time.perf_counter()
            self.engine.prefill(cache, tokens, position, point)
            space.insert(tokens[:point], cache, prefill_seconds=time.perf_counter() - started)
            position = point
        self.engine.generate(cache, tokens[position:], t0, out)
        seen = tokens + out.reply
        held = prompt_position(cache)
        if 0 < held <= len(seen):
            space.insert(seen[:held], cache)
        out.total_s = time.perf_counter() - t0
        if self.cold_only:
            self.store.flush()  # untimed: the next hit must come from its file
        return out

    def probe(self, req):
        return self.space.fetch(req.prompt).length

    def close(self):
        self.store.close()
