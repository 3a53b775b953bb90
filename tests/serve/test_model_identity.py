"""`promptstore serve` on a store of another model under the same --model-id: the
process exits non-zero with one line and no traceback, unless the operator says
the id spans versions of the weights (--model-id-spans-weights). Real servers,
real model directories, a real store."""

from __future__ import annotations

import subprocess
from pathlib import Path

import mlx.core as mx

from promptstore.testing.model_dir import write_model_dir

from .conftest import QUESTIONS, START_DEADLINE_S, SYSTEM, Server, chat

MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]


def scaled_model_dir(path: Path, factor: float = 1.01) -> Path:
    """The llama of conftest's model_dir with every weight times `factor`."""
    path = write_model_dir(path, "llama")
    weights = path / "model.safetensors"
    arrays = mx.load(str(weights))
    mx.save_safetensors(str(weights), {name: a * factor for name, a in arrays.items()})
    return path


def test_a_model_of_other_weights_under_the_same_model_id_exits_with_one_line(serve, model_dir, tmp_path):
    first = serve(model_dir("llama"), "--model-id", "m")
    assert chat(first.client(), MESSAGES)[2] == 0
    assert first.stop() == 0

    other = scaled_model_dir(tmp_path / "scaled")
    refused = Server(other, first.store, tmp_path / "refused.log", "--model-id", "m")
    refused.launch()
    try:
        code = refused.proc.wait(timeout=START_DEADLINE_S)
    except subprocess.TimeoutExpired:
        refused.kill()
        raise AssertionError(f"the server did not exit:\n{refused.log()[-4000:]}") from None
    log = refused.log()
    assert code != 0, log
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, log
    assert errors[0].startswith("promptstore serve: error: --model-id 'm' was bound to other weights"), log
    assert "--model-id-spans-weights" in errors[0]
    assert "Traceback" not in log

    # The operator says the id spans versions: served, and the store's prompt is restored into it.
    spanning = serve(other, "--model-id", "m", "--model-id-spans-weights", store=first.store)
    assert chat(spanning.client(), MESSAGES)[2] > 0
    assert spanning.stop() == 0
