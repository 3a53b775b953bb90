"""Shared fixtures: tiny random-weight mlx-lm models and generation helpers."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from promptstore import caches as C
from promptstore.testing import models
from promptstore.testing.small_disk import SmallDisk, SmallDiskUnavailable

# Cold hits load their nodes unless a test says otherwise: which of load, recompute
# or overlap is quickest depends on rates this busy machine measures as it runs, so
# tests of what a cold hit restores pin it; the plan's own tests set cold_plan.
os.environ.setdefault("PROMPTSTORE_COLD_PLAN", "load")


@functools.cache
def _model(family: str, variant: str = ""):
    overrides = VARIANTS[variant]
    return models.tiny_model(family, **overrides)


# Quantization groups are at least 32 wide, so quantized KV needs head dim 32.
VARIANTS = {"": {}, "hd32": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}}


@pytest.fixture
def model_of():
    """model_of(family, variant="") -> a cached tiny random-weight model."""
    return _model


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(size) -> a SmallDisk: a tmpfs of its own this test mounts (root
    only; skipped where no filesystem can be mounted), unmounted at the end."""
    made: list[SmallDisk] = []

    def make(size: int = 16 << 20) -> SmallDisk:
        try:
            disk = SmallDisk(tmp_path / f"disk{len(made)}", size)
        except SmallDiskUnavailable as e:
            pytest.skip(f"no small filesystem can be mounted here: {e}")
        made.append(disk)
        return disk

    yield make
    for disk in made:
        disk.close()


def prompt_tokens(n: int, seed: int = 1, vocab: int = 256) -> mx.array:
    """Random token ids, computed now: MLX's streams are per thread, and a lazy array made
    at a module's import fails when a test's other thread is the first to use it."""
    tokens = mx.random.randint(0, vocab, (n,), key=mx.random.key(seed))
    mx.eval(tokens)
    return tokens


def forward(model, cache, tokens: mx.array) -> mx.array:
    """Last-position logits after running `tokens` through the model."""
    logits = model(tokens[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def insert_following_checkpoints(space, model, tokens: mx.array, checkpoints=()):
    """What stream_generate does before it generates: fetch, then prefill to each
    checkpoint the hit asks for and to the end, inserting at each; returns the hit."""
    hit = space.fetch(tokens, checkpoints)
    position = hit.length
    for point in (*hit.checkpoints, len(tokens)):
        if point > position:
            forward(model, hit.cache, tokens[position:point])
            space.insert(tokens[:point], hit.cache)
            position = point
    return hit


def greedy(model, cache, logits: mx.array, n: int) -> list[int]:
    """n greedy tokens continuing from `logits`."""
    out = []
    for _ in range(n):
        token = logits.argmax(axis=-1)
        out.append(token.item())
        logits = forward(model, cache, token)
    return out


def fresh_cache(model, kv_bits=None):
    return C.make_prompt_cache(model, kv_bits=kv_bits, kv_group_size=32 if kv_bits else 64)


def assert_hit_whole(space, model, tokens: mx.array) -> None:
    """`space` restores all but the last of `tokens`, and the last position's
    logits from that restore equal a full prefill's (within 1e-4)."""
    hit = space.fetch(tokens)
    assert hit.length == len(tokens) - 1
    want = forward(model, fresh_cache(model), tokens)
    got = forward(model, hit.cache, tokens[hit.length :])
    assert mx.abs(want - got).max().item() < 1e-4


REPO = Path(__file__).resolve().parents[1]


def run_isolated(source: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run Python `source` in a child process (argv[1:] = args), so that a signal that
    would kill the interpreter (SIGBUS, SIGSEGV) shows as a test failure, not a dead run."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def child_failure(result: subprocess.CompletedProcess) -> str:
    """'' if the child exited 0, else why not (the signal's name if it died of one)."""
    if result.returncode == 0:
        return ""
    if result.returncode < 0:
        return f"killed by {signal.Signals(-result.returncode).name}: {result.stderr[-2000:]}"
    return f"exit status {result.returncode}: {result.stderr[-2000:]}"
