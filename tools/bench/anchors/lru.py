"""The mlx-lm LRUPromptCache comparison: the in-memory cache of mlx_lm.server."""

from __future__ import annotations

import copy
import time

from mlx_lm.models import cache as mlc

from .harness import Contender, Outcome

LRU_KEY = ("anchors-model", None, None)  # mlx_lm.server's model_key: (path, adapter, draft)
SERVER_PROMPT_CACHE_SIZE = 10  # mlx_lm.server --prompt-cache-size default


class LRU(Contender):
    """mlx-lm's LRUPromptCache, as mlx_lm.server's batched path uses it."""

    name = "mlx-lm LRUPromptCache"

    def __init__(self, engine, max_size: int = SERVER_PROMPT_CACHE_SIZE):
        super().__init__(engine)
        self.lru = mlc.LRUPromptCache(max_size)

    def serve(self, req):
        out = Outcome(req.name, len(req.prompt))
        prompt = req.prompt
        t0 = time.perf_counter()
        cache, rest = self.lru.fetch_nearest_cache(LRU_KEY, prompt)
        restored = len(prompt) - len(rest)
        if cache is None:
            cache = mlc.make_prompt_cache(self.engine.model)
        assert rest, "an exact hit leaves nothing to prefill (never happens in these workloads)"
        self._restored(out, cache, restored, t0)
        position = restored
        if 0 < req.sys_end < len(prompt) and position < req.sys_end:
            # The server saves the cache at the end of the system segment
            # (BatchGenerator.extract_cache: a copy) with type "system".
            self.engine.prefill(cache, prompt, position, req.sys_end)
            self.lru.insert_cache(LRU_KEY, prompt[: req.sys_end], copy.deepcopy(cache), cache_type="system")
            position = req.sys_end
        self.engine.generate(cache, prompt[position:], t0, out)
        self.lru.insert_cache(LRU_KEY, prompt + out.reply, cache, cache_type="assistant")
        out.total_s = time.perf_counter() - t0
        return out

    def probe(self, req):
        cache, rest = self.lru.fetch_nearest_cache(LRU_KEY, req.prompt)
        return 0 if cache is None else len(req.prompt) - len(rest)
