"""The model's kernels, before the first request: which attention kernels MLX
uses on CUDA (chosen before any runs), and the model run once at start on a
small batch (the kernel warm-up, --kernel-warm-up), so that the first requests
do not pay for building them.

A fresh process builds (or reads from MLX's on-disk cache) the kernels of every
shape of work it meets the first time it meets it: on an H100, the first batch
of four 19-token steps over 5k-token caches took 0.60-0.72 s in a fresh process
and 0.18-0.29 s after it; after one small batch like it first, 0.21 s. A
restarted server's first round is exactly such a batch (every conversation
comes back at once, its prefix restored), so `promptstore serve` runs the same
kind of work, small, while it starts, through mlx-lm's BatchGenerator as the
server uses it. Nothing of it is stored or seen by a request.

On a machine that has never run them, MLX's CUDA backend compiles a kernel
the first time a process needs it and keeps it on disk for the next. A round
after a SIGKILL, where some conversations had lost their last reply, was the
first batch whose new tokens differed in length: it spent 8.5 s to the first
token on two such compiles (the roll of a right-padded batch), on an H100
where the round after took 0.4 s. So the warm-up's batch takes every path a
round of a continuous-batching server takes: new tokens of different lengths
(the batch is right-padded, then rolled back into place), answers of
different lengths (the batch is filtered as each one ends), and a request
that joins a batch already generating (extended into it).
"""

from __future__ import annotations

import logging
import os
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from ..store import CUDA

log = logging.getLogger("promptstore.serve")

PREFIX_TOKENS = 48  # a restored prefix's stand-in (lengths vary a little per prompt)
STEP_TOKENS = 19  # the new tokens of a chat turn's step
RAGGED_TOKENS = 5  # each prompt's step is this much longer than the one before
ANSWER_TOKENS = (2, 5)  # alternately: the shorter answers end while the longer ones go on
MAX_STEPS = 64  # bounded: a handful of steps does it


def warm_up(model, vocab_size: int, batch: int, *, prefill_batch_size: int, prefill_step_size: int) -> float:
    """Run `batch` prompts through the model the way a restarted server's first
    round does (caches restored, steps of new tokens of different lengths, first
    tokens, decode steps, answers ending at different steps), and one prompt more
    that joins the batch while it generates; returns the seconds it took. Runs on
    the calling thread's stream: call it from the generation thread."""
    started = time.perf_counter()
    batch = max(1, batch)
    token = lambda i: 1 + (i * 7919) % max(1, vocab_size - 1)  # noqa: E731 — any valid ids
    caches, prefixes = [], []
    for b in range(batch + 1):
        tokens = [token(b * 131 + i) for i in range(PREFIX_TOKENS + 4 * b)]
        cache = make_prompt_cache(model)
        model(mx.array(tokens)[None], cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
        prefixes.append(tokens)
    steps = [[token(b * 17 + i) for i in range(STEP_TOKENS + RAGGED_TOKENS * b)] for b in range(batch + 1)]
    answers = [ANSWER_TOKENS[b % 2] for b in range(batch)] + [ANSWER_TOKENS[0]]
    generator = BatchGenerator(
        model,
        completion_batch_size=batch,
        prefill_batch_size=prefill_batch_size,
        prefill_step_size=prefill_step_size,
        stream=mx.default_stream(mx.default_device()),
    )

    def insert(which: range) -> list[int]:
        return generator.insert_segments(
            segments=[[steps[b]] for b in which],
            max_tokens=[answers[b] for b in which],
            caches=[caches[b] for b in which],
            all_tokens=[prefixes[b] for b in which],
        )

    try:
        uids = insert(range(batch))
        done: set[int] = set()
        for _ in range(MAX_STEPS):
            _, responses = generator.next()
            if responses and len(uids) == batch:  # the batch generates: one more joins it
                uids += insert(range(batch, batch + 1))
            done.update(r.uid for r in responses if r.finish_reason is not None)
            if done >= set(uids) and len(uids) > batch:
                break
        mx.synchronize()
    finally:
        generator.close()
    return time.perf_counter() - started


CUDNN_SDPA = "MLX_CUDA_USE_CUDNN_SDPA"


def attention_kernels(cudnn: bool | None, environ=os.environ) -> None:
    """Choose MLX's attention kernels on CUDA before any runs (MLX reads the
    variable at its first attention). cuDNN's are built per shape: a graph for
    every new key length, 0.04-1.3 s on an H100, paid inside the request that
    meets it; MLX's own need no building. None: MLX's own unless the operator
    set the variable."""
    if cudnn is None:
        if not CUDA or CUDNN_SDPA in environ:
            return
        cudnn = False
    environ[CUDNN_SDPA] = "1" if cudnn else "0"
    if CUDA:
        log.info(
            "attention: %s", "cuDNN's kernels" if cudnn else "MLX's own kernels (--cudnn-attention to use cuDNN's)"
        )
