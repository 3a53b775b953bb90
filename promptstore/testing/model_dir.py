"""A model directory `mlx_lm.load(dir)` reads: a tiny random-weight model's
config.json and model.safetensors, and the demo tokenizer with its chat
template, so servers and other processes load it as they would a real model.

    python -m promptstore.testing.model_dir OUT [--family FAMILY]

writes one to OUT (a new or empty directory), for `promptstore serve --model OUT`
without a model at hand; FAMILY is one of promptstore.testing.models.FAMILIES
(default llama), or a vision-language family of
promptstore.testing.vision_models.VISION_FAMILIES (an mlx-vlm folder, with its
processor's config, that `mlx_vlm.load` reads). A random-weight model writes
nonsense: what to look at is what the store restores."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .models import FAMILIES, model_args, tiny_model
from .round_trip import round_trip_replies
from .tokenizer import demo_tokenizer
from .vision_models import VISION_FAMILIES, write_vision_dir

REPLIES = ("random", "round-trip")


def write_model_dir(
    path: str | Path,
    family: str = "llama",
    *,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    replies: str = "random",
    **overrides: Any,
):
    """Write `family`'s random-weight model (with `overrides`, in `dtype`) and a
    BPE tokenizer of `vocab_size` tokens to `path`; returns the path.

    `replies`: "random" (random tokens), or "round-trip" (llama only): weights
    whose greedy replies render back to the tokens generated when the next
    turn's chat template holds them (promptstore.testing.round_trip), which
    config.json then says (`promptstore_replies`)."""
    if replies not in REPLIES:
        raise ValueError(f"replies must be one of {REPLIES}, not {replies!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    overrides = dict(overrides, vocab_size=vocab_size)
    model = tiny_model(family, seed=seed, dtype=dtype, **overrides)
    tokenizer = demo_tokenizer(vocab_size)._tokenizer
    if replies == "round-trip":
        round_trip_replies(model, tokenizer)
    config = dataclasses.asdict(model_args(family, **overrides))
    config["model_type"] = family
    if replies != "random":
        config["promptstore_replies"] = replies
    (path / "config.json").write_text(json.dumps(config, indent=1))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    # The index a sharded load (mlx-lm's sharded_load, pipeline parallel) reads to pick each rank's files.
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    tokenizer.save_pretrained(str(path))
    return path


def replies_of(path: str | Path) -> str:
    """The reply mode a model directory was written with ("random" where config.json does not say)."""
    return json.loads((Path(path) / "config.json").read_text()).get("promptstore_replies", "random")


class _Arguments(argparse.ArgumentParser):
    def error(self, message: str):  # a usage error in one line
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def main(argv: list[str] | None = None) -> int:
    prog = "python -m promptstore.testing.model_dir"
    p = _Arguments(prog=prog, description="Write a tiny random-weight model directory that mlx_lm.load reads.")
    p.add_argument("out", metavar="OUT", help="the directory to write (new, or empty)")
    p.add_argument(
        "--family",
        default="llama",
        choices=FAMILIES + VISION_FAMILIES,
        help="the model family (default: llama); qwen2_vl, qwen2_5_vl and gemma3 take images (mlx-vlm)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    written = False
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"{out}: exists and is not an empty directory; expected a new one for the model")
        created = not out.exists()
        written = True
        if args.family in VISION_FAMILIES:
            write_vision_dir(out, args.family)
        else:
            write_model_dir(out, args.family)
        _check_loads(out, args.family)
    except Exception as e:  # noqa: BLE001 - a person gets one line
        if written:  # what this run wrote goes: a directory mlx_lm.load cannot read is no use
            _remove_written(out, created)
        text = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        print(f"{prog}: error: {' '.join(text.split())}", file=sys.stderr)
        return 1
    kind = "vision-language model, its processor" if args.family in VISION_FAMILIES else "model"
    print(f"wrote a random-weight {args.family} {kind} and its tokenizer to {out}")
    return 0


def _check_loads(path: Path, family: str) -> None:
    """mlx_lm.load (mlx_vlm.load for a vision family) reads the directory, or a ValueError says why not."""
    if family in VISION_FAMILIES:
        from mlx_vlm import load

        reader = "mlx_vlm.load"
    else:
        from mlx_lm import load

        reader = "mlx_lm.load"
    try:
        load(str(path))
    except Exception as e:  # noqa: BLE001 - said in the error
        raise ValueError(f"{reader} cannot read the {family} directory written: {e}") from e


def _remove_written(out: Path, created: bool) -> None:
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for child in out.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
