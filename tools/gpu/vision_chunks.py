"""How far a prompt with images, prefilled in two parts (a restored prefix, then the
rest), is from the same prompt in one forward, with no store at all: the floor
under any cache's fidelity on this device and dtype.

    python tools/gpu/vision_chunks.py MODEL_DIR [--out FILE]

MODEL_DIR: a promptstore.vision model folder (bench_vision.py --model-dir writes
one). For each dtype (the folder's, and float32), a two-turn image chat of
about 7k tokens is run whole, in 2,048-token steps from the start (what a
server without a cache does), and split where its first turn ends (what a
restored first turn does). Reports the largest logit difference at the last
position, the gap between its two best logits, and whether greedy's first 16
tokens agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_vision import picture, system_prompt, user_turn  # noqa: E402

from promptstore.serve.vision import chat_parts  # noqa: E402
from promptstore.vision import VisionModel  # noqa: E402


def run(model: VisionModel, prompt, splits: list[int], n: int = 16):
    """(last logits, greedy tokens) prefilling in pieces ending at `splits`."""
    cache, start, logits = model.make_cache(), 0, None
    for end in [*splits, len(prompt)]:
        logits = model.forward(prompt, cache, start, model.embed(prompt, start)[:, : end - start])[:, -1]
        mx.eval(logits, [c.state for c in cache])
        start = end
    first, decoder, out = logits, model.decoder(prompt), []
    for _ in range(n):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = decoder(mx.array([[token]]), cache=cache)[:, -1]
    return first.astype(mx.float32), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for dtype in ("folder", "float32"):
        model = VisionModel.load(args.model_dir)
        if dtype == "float32":
            model.vlm.set_dtype(mx.float32)
        system = system_prompt(model.tokenizer, 4000)
        one = [{"role": "system", "content": system}, user_turn("Describe this.", [picture(1, (1024, 768))])]
        first = model.prompt(chat_parts(one))
        two = [*one, {"role": "assistant", "content": "A picture."}]
        two.append(user_turn("And these?", [picture(2, (1024, 768)), picture(3, (1024, 768))]))
        prompt = model.prompt(chat_parts(two))
        cut = len(first) - 1
        whole, g_whole = run(model, prompt, [])
        steps, g_steps = run(model, prompt, list(range(2048, len(prompt), 2048)))
        split, g_split = run(model, prompt, [cut, *range(cut + 2048, len(prompt), 2048)])
        best = mx.sort(whole[0])
        rows.append(
            {
                "dtype": str(model.vlm.language_model.lm_head.weight.dtype) if dtype == "folder" else "float32",
                "prompt_tokens": len(prompt),
                "split_at": cut,
                "max_logit_diff_steps_vs_whole": float(mx.abs(steps - whole).max()),
                "max_logit_diff_split_vs_whole": float(mx.abs(split - whole).max()),
                "top2_gap_whole": float(best[-1] - best[-2]),
                "greedy_equal_steps_vs_whole": g_steps == g_whole,
                "greedy_equal_split_vs_whole": g_split == g_whole,
                "greedy_equal_split_vs_steps": g_split == g_steps,
            }
        )
        print(json.dumps(rows[-1]))
        del model
        mx.clear_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
