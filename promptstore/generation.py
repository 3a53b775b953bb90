"""generate / stream_generate: mlx-lm's generation with a store underneath.

Fetch the longest stored prefix, prefill the rest in steps while inserting
the checkpoints the hit asked for, generate with mlx-lm, then insert the
whole conversation (prompt and reply) so the next turn hits all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .caches import prompt_position
from .store import Space
from .store.retention import marks

Prompt = str | Sequence[int] | mx.array


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Tokens of `prompt` exactly as mlx-lm's stream_generate would make them."""
    if isinstance(prompt, str):
        wrapper = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        special = wrapper.bos_token is None or not prompt.startswith(wrapper.bos_token)
        return list(wrapper.encode(prompt, add_special_tokens=special))
    return [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]


def prefill(
    model: nn.Module, cache: list, tokens: list[int], start: int, end: int, step: int, on_step=lambda done: None
) -> None:
    """Run tokens[start:end] through the model in steps of `step`; `on_step(position)` after each."""
    for lo in range(start, end, step):
        model(mx.array(tokens[lo : min(lo + step, end)])[None], cache=cache)
        mx.eval([c.state for c in cache])
        on_step(min(lo + step, end))


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Prompt,
    *,
    space: Space,
    checkpoints: Sequence[int] = (),
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    retention=None,
    **kwargs: Any,
) -> Generator:
    """mlx_lm.stream_generate with a prompt-cache store: same arguments and
    responses (prompt_tokens counts the whole prompt), plus `space` (the
    store's namespace of this model, from `PromptStore.bind`) and
    `checkpoints` (token positions later prompts will share, such as the end of
    the system prompt: see Space.fetch).
    prompt_progress_callback(processed, total): as in mlx-lm, called while the
    prompt is prefilled; restored tokens count as processed.
    retention: how long the store keeps the conversation ("5m", "1h", "24h",
    "in_memory", a Retention; None: by its budgets alone), see Space.insert."""
    if "prompt_cache" in kwargs:
        raise TypeError("pass space=, not prompt_cache=: the store provides the cache")
    tokens = encode(tokenizer, prompt)
    marks(retention, len(tokens))  # a wrong class fails now, before any work
    hit = space.fetch(tokens, checkpoints)
    cache, position = hit.cache, hit.length
    progress = prompt_progress_callback or (lambda processed, total: None)
    progress(position, len(tokens))
    step = space.settings.prefill_step
    # Checkpoints, then the whole prompt but its last token: stored before
    # generation, while every layer still holds it (a chunked layer drops old
    # positions as it decodes).
    for point in [p for p in hit.checkpoints if p < len(tokens) - 1] + [len(tokens) - 1]:
        if point <= position:
            continue
        started = time.perf_counter()
        prefill(model, cache, tokens, position, point, step, lambda done: progress(done, len(tokens)))
        seconds = time.perf_counter() - started
        space.record_prefill(position, point, seconds)
        space.insert(tokens[:point], cache, prefill_seconds=seconds, retention=retention)
        position = point
    produced: list[int] = []
    # mlx-lm counts only the tokens it is given: shift its counts past what came before.
    kwargs["prompt_progress_callback"] = lambda done, total, at=position: progress(at + done, at + total)
    for response in mlx_stream_generate(model, tokenizer, mx.array(tokens[position:]), prompt_cache=cache, **kwargs):
        produced.append(response.token)
        yield replace(response, prompt_tokens=len(tokens))
    seen = tokens + produced
    held = prompt_position(cache)
    if 0 < held <= len(seen):
        space.insert(seen[:held], cache, retention=retention)


def generate(model: nn.Module, tokenizer, prompt: Prompt, *, space: Space, verbose: bool = False, **kwargs: Any) -> str:
    """mlx_lm.generate with a prompt-cache store: the reply's text."""
    text = ""
    for response in stream_generate(model, tokenizer, prompt, space=space, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
    return text
