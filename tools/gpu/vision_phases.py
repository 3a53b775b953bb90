"""Where a turn with a new image spends its time, piece by piece, with no server:
the floor under any server's turn on this device.

    python tools/gpu/vision_phases.py MODEL_DIR [--profile cuda] [--out FILE]

MODEL_DIR: a promptstore.vision model folder; written at the bench's profile
shape (tools/bench/bench_vision.py) if it holds none. The turn is the bench's
"new image": a ~4k-token system prompt already in the cache, then one user
message with one 1024x768 image. Timed, each the median of --repeat runs after
a warm-up:
- decoding the image's data URL, hashing its pixels, processing it (CPU);
- rendering the whole prompt (template, tokens, processing, mrope positions);
- the vision tower alone over the image (batched by window length, as
  promptstore runs it, and window by window, as mlx-vlm does);
- the language model over the image's message, from a cache holding the system
  prompt (one forward, and in the server's steps);
- one decode step (the first generated token);
- the system prompt prefilled from nothing (what the cache saves).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_vision import PROFILES, picture, profile_model, system_prompt, user_turn  # noqa: E402

from promptstore.serve.vision import chat_parts  # noqa: E402
from promptstore.vision import VisionModel  # noqa: E402
from promptstore.vision.keys import image_digest  # noqa: E402


def timed(fn, repeat: int) -> float:
    """Median milliseconds of `fn()` (evaluated) over `repeat` runs after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--profile", default="cuda", choices=sorted(PROFILES))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    profile = PROFILES[args.profile]
    model = VisionModel.load(profile_model(Path(args.model_dir), profile))
    url = picture(7, tuple(profile["image"]))
    system = system_prompt(model.tokenizer, profile["system_tokens"])
    messages = [{"role": "system", "content": system}, user_turn("Describe this.", [url])]
    raw = base64.b64decode(url.split(",", 1)[1])
    inner = model.processor.image_processor.inner

    def decode():
        from PIL import Image

        im = Image.open(io.BytesIO(raw))
        im.load()
        return im.convert("RGB")

    image = decode()
    rows = {
        "b64_ms": timed(lambda: base64.b64decode(url.split(",", 1)[1]) and [], args.repeat),
        "decode_ms": timed(lambda: decode() and [], args.repeat),
        "pixel_hash_ms": timed(lambda: image_digest(image) and [], args.repeat),
        "process_ms": timed(lambda: inner(images=[image]) and [], args.repeat),
    }
    prompt = model.prompt(chat_parts(messages))
    rows["render_ms"] = timed(lambda: model.prompt(chat_parts(messages)).ids is not None and [], args.repeat)
    start = prompt.spans[0].start
    every = model.inputs(prompt)
    pixels = every["pixel_values"].astype(model.vlm.vision_tower.patch_embed.proj.weight.dtype)
    grid = every["image_grid_thw"]
    tower = model.vlm.vision_tower
    batched = type(tower.blocks[0].attn)
    rows["tower_ms"] = timed(lambda: tower(pixels, grid, output_hidden_states=False), args.repeat)
    if model.windows_batched:  # and as mlx-vlm runs it, window by window
        mine = tower(pixels, grid, output_hidden_states=False)
        for block in tower.blocks:
            block.attn.__class__ = batched.__mro__[1]
        rows["tower_mlx_vlm_ms"] = timed(lambda: tower(pixels, grid, output_hidden_states=False), args.repeat)
        theirs = tower(pixels, grid, output_hidden_states=False)
        rows["tower_max_diff"] = float(mx.abs(mine.astype(mx.float32) - theirs.astype(mx.float32)).max())
        for block in tower.blocks:
            block.attn.__class__ = batched
    rows["embed_ms"] = timed(lambda: model.embed(prompt, start), args.repeat)

    base = model.make_cache()
    model.forward(prompt, base, 0, model.embed(prompt, 0)[:, :start])
    mx.eval([c.state for c in base])

    def fresh():
        out = model.make_cache()
        for c, b in zip(out, base, strict=True):
            c.keys, c.values, c.offset = mx.array(b.keys), mx.array(b.values), b.offset
        mx.eval([c.state for c in out])
        return out

    embeddings = model.embed(prompt, start)
    mx.eval(embeddings)
    n = len(prompt) - 1 - start

    def rest_once():
        cache = fresh()
        t = time.perf_counter()
        out = model.forward(prompt, cache, start, embeddings[:, :n])
        mx.eval(out, [c.state for c in cache])
        return time.perf_counter() - t, cache

    rest = []
    rest_once()
    for _ in range(args.repeat):
        rest.append(rest_once()[0] * 1e3)
    rows["prefill_rest_ms"] = statistics.median(rest)
    _, cache = rest_once()
    last, at = mx.array(prompt.ids[None, -1:]), len(prompt) - 1
    rows["first_token_ms"] = timed(
        lambda: model.language_forward(last, None, fresh_at(cache, at), at, prompt), args.repeat
    )

    def system_prefill():
        c = model.make_cache()
        return [model.forward(prompt, c, 0, model.embed(prompt, 0)[:, :start]), [x.state for x in c]]

    rows["prefill_system_ms"] = timed(system_prefill, args.repeat)
    rows.update(prompt_tokens=len(prompt), system_tokens=start, image_tokens=prompt.spans[0].end - start, rest_tokens=n)
    print(json.dumps(rows, indent=1))
    if args.out:
        out = {"device": str(mx.default_device()), "dtype": profile["dtype"], "profile": args.profile, "rows": rows}
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def fresh_at(cache, offset):
    """`cache` trimmed back to `offset` (a decode step from there, repeatably)."""
    for c in cache:
        c.offset = offset
    return cache


if __name__ == "__main__":
    sys.exit(main())
