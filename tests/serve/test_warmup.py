"""What a server does at start for its first requests: which attention kernels
MLX uses on CUDA; its prefill step; the kernel warm-up's paths through mlx-lm's
batch generator; reading the GPU runtime's libraries (which files, a bounded
read)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from promptstore.serve import server
from promptstore.serve.options import build_parser
from promptstore.serve.warmup import read_libraries, runtime_libraries, warm_up
from promptstore.testing import models


@pytest.mark.parametrize("cuda", [False, True])
def test_attention_kernels_on_cuda_are_mlx_own_unless_the_operator_chose(monkeypatch, cuda):
    monkeypatch.setattr(server, "CUDA", cuda)
    parse = lambda *flags: build_parser().parse_args(["--model", "m", *flags]).cudnn_attention  # noqa: E731
    assert (parse(), parse("--cudnn-attention"), parse("--no-cudnn-attention")) == (None, True, False)
    env: dict[str, str] = {}
    server.attention_kernels(None, env)
    assert env == ({"MLX_CUDA_USE_CUDNN_SDPA": "0"} if cuda else {})  # nothing changes off CUDA
    for set_by_operator in ("0", "1"):
        env = {"MLX_CUDA_USE_CUDNN_SDPA": set_by_operator}
        server.attention_kernels(None, env)
        assert env == {"MLX_CUDA_USE_CUDNN_SDPA": set_by_operator}
    for flag, value in ((True, "1"), (False, "0")):  # the option wins over the variable
        env = {"MLX_CUDA_USE_CUDNN_SDPA": "1" if value == "0" else "0"}
        server.attention_kernels(flag, env)
        assert env == {"MLX_CUDA_USE_CUDNN_SDPA": value}


@pytest.mark.parametrize("device,default", [(mx.cpu, 512), (mx.gpu, 2048)])
def test_the_prefill_step_defaults_to_the_devices_unless_given(monkeypatch, device, default):
    """Smaller steps on CPU (attention in cache: tools/bench/probe_prefill_step.py),
    mlx_lm.server's 2,048 elsewhere; an operator's own always wins."""
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


def _maps(tmp_path, *paths) -> str:
    lines = [f"7f00-7f01 r-xp 00000000 08:01 {i} {p}" for i, p in enumerate(paths)]
    lines.append("7ffd-7ffe rw-p 00000000 00:00 0")  # anonymous: no path
    maps = tmp_path / "maps"
    maps.write_text("\n".join(lines) + "\n")
    return str(maps)


def test_every_library_the_process_maps_is_read_where_a_cuda_library_is_among_them(tmp_path):
    cuda, other = tmp_path / "cuda" / "lib", tmp_path / "python"
    cuda.mkdir(parents=True)
    other.mkdir()
    for name in ("libcudart.so.12", "libcudnn_engines.so.9"):
        (cuda / name).write_bytes(b"x" * 10)
    (other / "libpython3.so").write_bytes(b"p")
    (other / "libmlx.so").write_bytes(b"m")
    (other / "weights.safetensors").write_bytes(b"w")
    mapped = [cuda / "libcudart.so.12", other / "libpython3.so", other / "libmlx.so", other / "weights.safetensors"]
    found = runtime_libraries(_maps(tmp_path, *mapped, cuda / "libcudart.so.12"))
    # Only what is mapped (not the unmapped cuDNN library beside it), each once, no data files.
    assert [p.name for p in found] == ["libcudart.so.12", "libmlx.so", "libpython3.so"]


def test_without_a_cuda_library_mapped_nothing_is_read(tmp_path):
    lib = tmp_path / "libmlx.so"
    lib.write_bytes(b"m")
    assert runtime_libraries(_maps(tmp_path, lib, tmp_path / "libpython3.so")) == []
    assert runtime_libraries(tmp_path / "missing") == []


def test_the_read_covers_every_byte_skips_what_is_gone_and_stops_at_its_deadline(tmp_path):
    files = []
    for i, size in enumerate((0, 1, 40 << 20)):
        f = tmp_path / f"lib{i}.so"
        f.write_bytes(b"z" * size)
        files.append(f)
    assert read_libraries([*files, tmp_path / "gone.so"])[:2] == (3, 1 + (40 << 20))
    assert read_libraries(files, deadline_s=0.0)[1] == 0
