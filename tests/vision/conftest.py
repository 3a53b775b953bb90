"""Vision-language fixtures: mlx-vlm model folders of every family the tests use
(random weights, written once per session), images, and reference computations."""

from __future__ import annotations

import functools
import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from promptstore.testing.vision_models import VISION_FAMILIES, write_vision_dir
from promptstore.vision import VisionModel, VisionPrompt

SYSTEM = "You are a careful assistant who describes pictures for a museum's catalogue, briefly and plainly."


@pytest.fixture(scope="session")
def vision_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-models")
    return {family: write_vision_dir(root / family, family) for family in VISION_FAMILIES}


@pytest.fixture(scope="session")
def vision_model(vision_dirs):
    """vision_model(family) -> the family's VisionModel (one per session)."""
    return functools.cache(lambda family: VisionModel.load(vision_dirs[family]))


def picture(seed: int, width: int = 100, height: int = 80) -> Image.Image:
    """A random RGB image: each seed another picture."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def user(*parts) -> dict:
    """A user message of text and images (PIL images or sources, in order)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    return {"role": "user", "content": content}


def chat(*messages) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *messages]


def full_logits(model: VisionModel, space, prompt: VisionPrompt) -> mx.array:
    """The last position's logits of a full prefill of `prompt` (no store)."""
    cache = space.new_cache()
    logits = model.forward(prompt, cache, 0, model.embed(prompt, 0))[0, -1]
    mx.eval(logits)
    return logits


def continued_logits(model: VisionModel, hit, prompt: VisionPrompt) -> mx.array:
    """The last position's logits after prefilling `prompt` past `hit`."""
    logits = model.forward(prompt, hit.cache, hit.length, model.embed(prompt, hit.length))[0, -1]
    mx.eval(logits)
    return logits


def greedy(model: VisionModel, cache, prompt: VisionPrompt, start: int, n: int = 8) -> list[int]:
    """n greedy tokens after prefilling `prompt` from `start` into `cache`."""
    logits = model.forward(prompt, cache, start, model.embed(prompt, start))[:, -1]
    decoder, out = model.decoder(prompt), []
    for _ in range(n):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = decoder(mx.array([[token]]), cache=cache)[:, -1]
    return out


def prefilled(model: VisionModel, space, prompt: VisionPrompt, upto: int | None = None) -> None:
    """Fetch, prefill and insert `prompt` but its last token (or its first `upto`
    positions), as generation does before it decodes."""
    end = len(prompt) - 1 if upto is None else upto
    hit = space.fetch(prompt.keys[:end])
    if hit.length < end:
        model.forward(prompt, hit.cache, hit.length, model.embed(prompt, hit.length)[:, : end - hit.length])
    space.insert(prompt.keys[:end], hit.cache)
