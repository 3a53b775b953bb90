"""The heap a server on MLX's CPU backend keeps (serve/heap.py): the option, and
what it changes: the model's new arrays come from memory touched at start
instead of pages faulted in one at a time."""

import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from promptstore.serve import heap
from promptstore.serve.options import build_parser

FAULTS = textwrap.dedent(
    """
    import resource, sys
    import mlx.core as mx
    from promptstore.serve.heap import keep_heap

    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    mx.eval(mx.random.normal((1024,)) * 2)  # the kernels' own first use, outside the count
    kept = keep_heap(int(sys.argv[1]))
    before = faults()
    arrays = [mx.random.normal((2 << 20,)) * 2 for _ in range(8)]  # 64 MiB the process never had
    mx.eval(arrays)
    print(kept[0] if kept else 0, faults() - before)
    """
)


def _faults(reserve: int) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, str(reserve)], capture_output=True, text=True, timeout=120, check=True
    )
    kept, faults = out.stdout.split()
    return int(kept), int(faults)


@pytest.mark.skipif(mx.default_device() != mx.cpu or heap._glibc() is None, reason="MLX's CPU backend with glibc")
def test_a_kept_heap_gives_new_arrays_memory_touched_at_start():
    """64 MiB of new arrays (16,384 pages): each page a fault without a reserve
    (and a page the kernel zeroes), next to none after a 128 MiB one."""
    bare_kept, bare = _faults(0)
    kept, faults = _faults(128 << 20)
    assert (bare_kept, kept) == (0, 128 << 20)
    assert bare >= 16_000, bare
    assert faults < 1_000, faults


def test_nothing_changes_without_a_reserve_or_off_the_cpu(monkeypatch):
    assert heap.keep_heap(0) is None
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert heap.keep_heap(64 << 20) is None  # MLX's GPU allocators keep their own buffers


def test_the_heap_reserve_option_takes_sizes_and_refuses_anything_else(capsys):
    parse = lambda *flags: build_parser().parse_args(["--model", "m", *flags]).heap_reserve  # noqa: E731
    assert parse() == heap.DEFAULT_RESERVE == 512 << 20
    assert (parse("--heap-reserve", "0"), parse("--heap-reserve", "1GiB"), parse("--heap-reserve=4096")) == (
        0,
        1 << 30,
        4096,
    )
    for bad in ("lots", "-1", "12 parsecs", ""):
        with pytest.raises(SystemExit):
            parse(f"--heap-reserve={bad}")
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "--heap-reserve" in err and "is not a size" in err, err
