"""`python -m promptstore.testing.model_dir OUT`, as the README has a newcomer run it
before `promptstore serve --model OUT`: one line out, and a directory mlx_lm.load reads."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx

from .conftest import TIMEOUT_S, cli_env


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "promptstore.testing.model_dir", *args],
        capture_output=True,
        text=True,
        env=cli_env(tmp_path),
        cwd=tmp_path,
        timeout=TIMEOUT_S,
    )


def test_writes_a_directory_mlx_lm_loads(tmp_path):
    from mlx_lm import load

    done = run(tmp_path, "model")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["wrote a random-weight llama model and its tokenizer to model"]
    model, tokenizer = load(str(tmp_path / "model"))
    assert model.model_type == "llama"
    tokens = tokenizer.encode("Do you have any books about sailing?")
    logits = model(mx.array(tokens)[None])
    assert logits.shape[:2] == (1, len(tokens))


def test_a_directory_in_use_is_one_line_and_left_as_it_was(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("mine")
    done = run(tmp_path, "model", "--family", "qwen3_next")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "exists and is not an empty directory" in done.stderr, done.stderr
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["notes.txt"]


def test_an_unknown_family_is_a_usage_error(tmp_path):
    done = run(tmp_path, "model", "--family", "gpt2")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "invalid choice" in done.stderr, done.stderr
    assert not (tmp_path / "model").exists()


def test_writes_a_vision_language_folder_mlx_vlm_loads_and_serve_takes(tmp_path):
    from PIL import Image

    from promptstore.vision import VisionModel

    done = run(tmp_path, "vlm", "--family", "qwen2_vl")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "wrote a random-weight qwen2_vl vision-language model, its processor and its tokenizer to vlm"
    ]
    model = VisionModel.load(tmp_path / "vlm")
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    prompt = model.prompt(
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "?"}]}]
    )
    assert len(prompt.spans) == 1 and prompt.spans[0].end > prompt.spans[0].start
    logits = model.forward(prompt, model.make_cache(), 0, model.embed(prompt))
    assert logits.shape[:2] == (1, len(prompt))
