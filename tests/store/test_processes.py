"""Several processes on one store: neither corrupts it nor sees half-written nodes."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from promptstore import PromptStore

from ..conftest import assert_hit_whole

WORKER = Path(__file__).with_name("_two_process_worker.py")


def test_two_processes_insert_and_fetch_at_once(tmp_path, model_of):
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path), str(seed), "12"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "bad=0" in out
    # Afterwards one process sees both processes' inserts, all verified.
    model = model_of("llama")
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        base = mx.random.randint(0, 256, (48,), key=mx.random.key(100))
        for seed in (1, 2):
            tail = mx.random.randint(0, 256, (16,), key=mx.random.key(seed * 1000))
            assert_hit_whole(space, model, mx.concatenate([base, tail]))
        assert not store.reports
