"""What a server does at start so its first requests find their kernels built:
which attention kernels MLX uses on CUDA; its prefill step; the kernel warm-up's
paths through mlx-lm's batch generator."""

import mlx.core as mx
import pytest
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from promptstore.serve import kernels
from promptstore.serve.kernels import warm_up
from promptstore.serve.options import build_parser
from promptstore.testing import models


@pytest.mark.parametrize("cuda", [False, True])
def test_attention_kernels_on_cuda_are_mlx_own_unless_the_operator_chose(monkeypatch, cuda):
    monkeypatch.setattr(kernels, "CUDA", cuda)
    parse = lambda *flags: build_parser().parse_args(["--model", "m", *flags]).cudnn_attention  # noqa: E731
    assert (parse(), parse("--cudnn-attention"), parse("--no-cudnn-attention")) == (None, True, False)
    env: dict[str, str] = {}
    kernels.attention_kernels(None, env)
    assert env == ({"MLX_CUDA_USE_CUDNN_SDPA": "0"} if cuda else {})  # nothing changes off CUDA
    for set_by_operator in ("0", "1"):
        env = {"MLX_CUDA_USE_CUDNN_SDPA": set_by_operator}
        kernels.attention_kernels(None, env)
        assert env == {"MLX_CUDA_USE_CUDNN_SDPA": set_by_operator}
    for flag, value in ((True, "1"), (False, "0")):  # the option wins over the variable
        env = {"MLX_CUDA_USE_CUDNN_SDPA": "1" if value == "0" else "0"}
        kernels.attention_kernels(flag, env)
        assert env == {"MLX_CUDA_USE_CUDNN_SDPA": value}


@pytest.mark.parametrize("device,default", [(mx.cpu, 512), (mx.gpu, 2048)])
def test_the_prefill_step_defaults_to_the_devices_unless_given(monkeypatch, device, default):
    """Smaller steps on CPU (attention in cache: tools/bench/probe_prefill_step.py, in
    git history at commit e209242), mlx_lm.server's 2,048 elsewhere; an operator's
    own always wins."""
    monkeypatch.setattr(mx, "default_device", lambda: device)
    parse = lambda *flags: build_parser().parse_args(["--model", "m", *flags]).prefill_step_size  # noqa: E731
    assert (parse(), parse("--prefill-step-size", "300")) == (default, 300)


def _watch(monkeypatch, cls, name: str, seen: list, what) -> None:
    """Record what(self, *args, **kwargs) at each call of cls.name, which still runs."""
    real = getattr(cls, name)

    def watched(self, *args, **kwargs):
        seen.append(what(self, *args, **kwargs))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, watched)


def test_the_kernel_warm_up_takes_every_path_a_round_of_a_batching_server_takes(monkeypatch):
    """On CUDA each path builds kernels of its own the first time a machine
    meets it (the round that first met the roll of a right-padded batch took
    8.5 s on an H100), so the warm-up's batch meets them all: new tokens of
    different lengths, answers ending at different steps while others go on,
    a request joining a batch that generates."""
    padded, rolled, kept, joined = [], [], [], []
    _watch(monkeypatch, BatchKVCache, "prepare", padded, lambda c, **kw: max(kw.get("right_padding") or [0]))
    _watch(monkeypatch, BatchKVCache, "finalize", rolled, lambda c: c._right_padding is not None)
    _watch(monkeypatch, GenerationBatch, "filter", kept, lambda b, keep: (len(b.uids), len(keep)))
    _watch(monkeypatch, GenerationBatch, "extend", joined, lambda b, other: (len(b.uids), len(other.uids)))
    model = models.tiny_model("llama")
    seconds = warm_up(model, 256, 4, prefill_batch_size=8, prefill_step_size=512)
    assert seconds > 0
    assert any(p > 0 for p in padded) and any(rolled), (padded, rolled)  # a ragged step, rolled into place
    assert any(0 < k < n for n, k in kept), kept  # some answers ended while others went on
    assert any(n > 0 and m > 0 for n, m in joined), joined  # a request joined a batch already generating
    # A server that never batches (a batch of one) warms what it meets: no padding, one request after another.
    padded.clear()
    warm_up(model, 256, 1, prefill_batch_size=1, prefill_step_size=512)
    assert not any(p > 0 for p in padded), padded
