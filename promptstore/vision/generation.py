"""stream_generate / generate for a vision-language model with a store underneath.

As promptstore.generation does for text: fetch the longest stored prefix of the
prompt's keys, prefill the rest in steps while inserting the checkpoints the
hit asked for, generate with mlx-lm's loop, then insert the whole conversation.
The embeddings of what the hit did not cover are made once (the vision tower
runs only when an image lies past the hit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..caches import prompt_position
from ..store import Space
from ..store.retention import marks
from .model import VisionModel, VisionPrompt


def prefill(
    model: VisionModel,
    prompt: VisionPrompt,
    cache: list,
    embeddings: mx.array,
    start: int,
    end: int,
    step: int,
    on_step: Callable[[int], None] = lambda done: None,
) -> None:
    """Run prompt positions [start, end) in steps of `step`; `embeddings` are those of [start, n)."""
    base = start
    for lo in range(start, end, step):
        hi = min(lo + step, end)
        model.forward(prompt, cache, lo, embeddings[:, lo - base : hi - base])
        mx.eval([c.state for c in cache])
        on_step(hi)


def stream_generate(
    model: VisionModel,
    prompt: VisionPrompt | Sequence[dict],
    *,
    space: Space,
    checkpoints: Sequence[int] = (),
    retention=None,
    **kwargs: Any,
) -> Generator:
    """mlx_lm.stream_generate over `model` (a VisionModel bound to `space`) for
    `prompt`: chat messages with images (VisionModel.render) or a VisionPrompt.
    checkpoints, retention: as in promptstore.generation.stream_generate."""
    if "prompt_cache" in kwargs:
        raise TypeError("pass space=, not prompt_cache=: the store provides the cache")
    if not isinstance(prompt, VisionPrompt):
        prompt = model.prompt(prompt)
    n = len(prompt)
    marks(retention, n)
    keys = prompt.keys
    hit = space.fetch(keys, checkpoints)
    cache, position = hit.cache, hit.length
    embeddings = model.embed(prompt, position)
    start, step = position, space.settings.prefill_step
    for point in [p for p in hit.checkpoints if p < n - 1] + [n - 1]:
        if point <= position:
            continue
        started = time.perf_counter()
        prefill(model, prompt, cache, embeddings[:, position - start :], position, point, step)
        seconds = time.perf_counter() - started
        space.record_prefill(position, point, seconds)
        space.insert(keys[:point], cache, prefill_seconds=seconds, retention=retention)
        position = point
    tokenizer = model.tokenizer
    wrapper = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
    produced: list[int] = []
    rest = mx.array(prompt.ids[position:])
    for response in mlx_stream_generate(
        model.decoder(prompt),
        wrapper,
        rest,
        prompt_cache=cache,
        input_embeddings=embeddings[0, position - start :],
        **kwargs,
    ):
        produced.append(response.token)
        yield replace(response, prompt_tokens=n)
    seen = np.concatenate([keys, np.asarray(produced, dtype="<u4")])
    held = prompt_position(cache)
    if 0 < held <= len(seen):
        space.insert(seen[:held], cache, retention=retention)


def generate(model: VisionModel, prompt, *, space: Space, **kwargs: Any) -> str:
    """The reply's text (see stream_generate)."""
    return "".join(r.text for r in stream_generate(model, prompt, space=space, **kwargs))
