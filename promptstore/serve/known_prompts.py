"""Prompts a deployment knows before any request (`--warm-prompts FILE`), stored at start.

An agent framework or a chat application sends the same system prompt (and
tool definitions) with every conversation. Given them ahead, the server
prefills each once at start and stores it, so the first request of the first
conversation restores it as every later one does. Stored, it is kept across
restarts: a restart finds it in the store and prefills nothing.

The file holds a JSON list of message arrays, the shape `messages` has in a
chat completion (as vllm-mlx's `--warm-prompts` takes). What is stored of each
is the part every request that starts with these messages shares: its
rendering followed by a user message, up to where the two renderings of two
different user messages part, cut back to the last special token before that.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ..errors import ServeConfigError
from ..generation import prefill
from .options import read_json_file
from .replies import common_prefix, plain_special_tokens

log = logging.getLogger("promptstore.serve")

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_PROMPTS = 64


def load_known_prompts(path: str | Path) -> list[list[dict]]:
    """The file's message arrays, or ServeConfigError saying what is wrong."""
    raw = read_json_file(path, "warm prompts file")
    want = 'a JSON list of message arrays, e.g. [[{"role": "system", "content": "..."}]]'
    if not isinstance(raw, list) or not raw or len(raw) > MAX_PROMPTS:
        raise ServeConfigError(f"the warm prompts file {path} must hold {want}, 1 to {MAX_PROMPTS} of them")
    for i, messages in enumerate(raw):
        if not isinstance(messages, list) or not messages:
            raise ServeConfigError(f"the warm prompts file {path}: prompt {i} is not a non-empty list; want {want}")
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ServeConfigError(
                    f"the warm prompts file {path}: prompt {i}, message {j} must be an object with a role "
                    f"({', '.join(sorted(ROLES))}) and a string content"
                )
    return raw


def shared_tokens(tokenizer, messages: list[dict], template_kwargs: dict) -> list[int]:
    """The tokens every request that starts with `messages` begins with."""

    def rendered(text: str) -> list[int]:
        turn = [*messages, {"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(turn, add_generation_prompt=True, **template_kwargs))

    a, b = rendered("a"), rendered("b")
    n = common_prefix(a, b)
    specials = plain_special_tokens(tokenizer)
    while n > 0 and a[n - 1] not in specials:  # a word may run on into the user's text
        n -= 1
    return a[:n]


def store_known_prompts(cache, prompts: list[list[dict]], template_kwargs: dict) -> str:
    """Prefill and store each prompt's shared tokens in every tenant's namespace of
    the model `cache` (a StoreCache) is bound to, unless stored already; on the
    generation thread, before the server takes requests. Returns the log line."""
    started = time.perf_counter()
    prefilled = stored = skipped = 0
    for i, messages in enumerate(prompts):
        try:
            tokens = shared_tokens(cache.tokenizer, messages, template_kwargs)
        except Exception as e:  # no chat template, or one these messages do not render with
            log.warning("warm prompt %d not stored: its messages do not render (%s)", i, e)
            skipped += 1
            continue
        if len(tokens) < 2:
            skipped += 1
            continue
        for tenant in cache.tenants:
            space = cache.spaces(tenant)[0]
            have = space.restorable_length(tokens)
            if have >= len(tokens) - 1:
                stored += 1
                continue
            hit = space.fetch(tokens + [0], count=False)  # what the store holds of it already
            t0 = time.perf_counter()
            prefill(cache.model, hit.cache, tokens, hit.length, len(tokens), cache.prefill_step)
            space.insert(tokens, hit.cache, prefill_seconds=time.perf_counter() - t0)
            prefilled += len(tokens) - hit.length
    return (
        f"warm prompts: {len(prompts)} prompts, {prefilled} tokens prefilled and stored, {stored} found stored"
        f"{f', {skipped} skipped' if skipped else ''} ({time.perf_counter() - started:.1f} s)"
    )
