"""Shared helpers for promptstore's benchmarks: timing, BLAS detection, the device
and the page cache, JSON output.

Import from a script in tools/bench/ with `from common import ...` (the script's
directory is on sys.path when it is run as a file).
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata as _md
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

try:
    import resource
except ImportError:  # Windows
    resource = None

REPO_ROOT = Path(__file__).resolve().parents[2]

# Where `make openblas` (Debian/Ubuntu: libopenblas0-pthread) puts it.
OPENBLAS_HINT = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def sync(result: Any = None) -> None:
    """Evaluate `result` (any tree of arrays) and wait for every stream."""
    if result is not None:
        mx.eval(result)
    mx.synchronize()


def minor_faults() -> int:
    """Minor page faults so far (first touches of fresh memory); 0 where unknown."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def cache_limit() -> int:
    """MLX's buffer-cache limit in bytes (freed buffers above it go back to the OS)."""
    old = mx.set_cache_limit(0)
    mx.set_cache_limit(old)
    return int(old)


def summarize(samples: list[float], faults: list[int] | None = None) -> dict:
    s = np.asarray(samples, dtype=float)
    extra = {"minor_faults_median": float(np.median(faults))} if faults else {}
    return {
        "median_s": float(np.median(s)),
        "p95_s": float(np.percentile(s, 95)),
        "min_s": float(s.min()),
        "max_s": float(s.max()),
        "mean_s": float(s.mean()),
        "runs": int(s.size),
        "samples_s": [float(x) for x in s],
        **extra,
    }


def timed(
    fn: Callable[..., Any],
    *,
    runs: int,
    warmup: int = 2,
    setup: Callable[[], Any] | None = None,
) -> dict:
    """Time `fn` `runs` times after `warmup` untimed calls.

    setup: called before each call, untimed; its result is passed to `fn`
    (evaluate any arrays it makes inside it).
    Whatever `fn` returns is evaluated inside the timed region (then
    mx.synchronize), so lazy work is counted; it is freed outside it. MLX's
    buffer cache is emptied first. Returns summarize()'s dict, with the
    median of minor page faults per timed call.
    """
    samples, faults = [], []
    # Start from an empty buffer cache: whether an output reuses a cached buffer
    # or faults fresh pages in must not depend on what ran before.
    mx.clear_cache()
    for i in range(warmup + runs):
        arg = (setup(),) if setup is not None else ()
        mx.synchronize()
        f0 = minor_faults()
        t0 = time.perf_counter()
        out = fn(*arg)
        sync(out)
        dt = time.perf_counter() - t0
        del out  # freeing the result is not timed
        if i >= warmup:
            samples.append(dt)
            faults.append(minor_faults() - f0)
    return summarize(samples, faults)


def time_calls(owner: Any, name: str, label: str, into: dict[str, list[float]]) -> None:
    """Replace `owner.name` (a method or a module's function) with a wrapper that
    appends each call's seconds to `into[label]`, whether the call returns or raises."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.setdefault(label, []).append(time.perf_counter() - started)

    setattr(owner, name, run)


def _provider(symbol: str) -> str | None:
    """The file the process-wide lookup of `symbol` resolves to (what an LD_PRELOAD
    interposes on), or None when no globally visible library exports it."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("fname", ctypes.c_char_p),
            ("fbase", ctypes.c_void_p),
            ("sname", ctypes.c_char_p),
            ("saddr", ctypes.c_void_p),
        ]

    try:
        libc = ctypes.CDLL(None)
        addr = ctypes.cast(getattr(libc, symbol), ctypes.c_void_p)
    except (AttributeError, OSError):
        return None
    info = DlInfo()
    return os.fsdecode(info.fname) if libc.dladdr(addr, ctypes.byref(info)) and info.fname else None


def blas_info() -> dict:
    """Which BLAS MLX's float32 matmuls use (Linux: /proc/self/maps).

    OpenBLAS counts when a libopenblas is mapped; numpy's bundled
    scipy_openblas does not (it exports only prefixed symbols MLX never calls).
    """
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({ln.split()[-1] for ln in f if "blas" in ln.lower() and "/" in ln})
    except OSError:  # no procfs (macOS): MLX uses Accelerate there
        return {"openblas": None, "name": f"not checked ({platform.system()})", "libraries": []}
    usable = [p for p in libs if "openblas" in p.lower() and "scipy_openblas" not in p.lower()]
    bundled = [p for p in libs if "mlx" in p.lower()]
    name = "OpenBLAS" if usable else ("MLX's bundled reference BLAS" if bundled else "none mapped")
    return {
        "openblas": bool(usable),
        "name": name,
        "libraries": libs,
        "cblas_sgemm_from": _provider("cblas_sgemm"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }


def blas_warning(info: dict) -> str | None:
    """A loud warning when float32 matmuls run on a slow reference BLAS (Linux)."""
    if info["openblas"] is not False:
        return None
    bar = "!" * 78
    return (
        f"{bar}\n"
        f"!! WARNING: OpenBLAS is NOT loaded ({info['name']}).\n"
        "!! float32 matmuls run on a slow reference BLAS: prefill baselines are UNFAIR\n"
        "!! (far too slow, flattering any cache). Rerun with\n"
        f"!!   LD_PRELOAD={OPENBLAS_HINT} ...   (install: `make openblas`)\n"
        f"{bar}"
    )


def machine_info() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return _md.version(pkg)
        except _md.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "mlx_device": str(mx.default_device()),
        "mlx_cache_limit_bytes": cache_limit(),
    }


def nvidia_smi_gpu() -> str | None:
    """The first GPU's "name, memory" as nvidia-smi says them; None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def gpu_name() -> str | None:
    """The GPU's name where MLX runs on one (nvidia-smi, else MLX's name), else None."""
    if mx.default_device() != mx.gpu:
        return None
    return nvidia_smi_gpu() or str(mx.device_info().get("device_name", "gpu"))


def describe_device() -> str:
    """Where MLX runs, in words: "GPU: <name, memory>" or "CPU: <n> cores (<device>)"."""
    if mx.default_device() == mx.gpu:
        return f"GPU: {nvidia_smi_gpu() or mx.device_info().get('device_name', 'unknown')}"
    return f"CPU: {os.cpu_count()} cores ({mx.default_device()})"


def drop_page_cache() -> bool:
    """Empty the whole machine's page cache (root); False, said on stderr, where
    that is not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError as e:
        print(f"page cache not dropped: {e}", file=sys.stderr)
        return False


def write_back() -> dict:
    """Write the machine's dirty pages back to disk (os.sync, which returns once
    they are written): what was pending (/proc/meminfo's Dirty and Writeback,
    where it can be read) and the seconds it took."""
    pending = None
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        pending = sum(int(fields[k].split()[0]) * 1024 for k in ("Dirty", "Writeback"))
    except (OSError, KeyError, ValueError):
        pass
    started = time.perf_counter()
    os.sync()
    return {"dirty_bytes": pending, "sync_s": round(time.perf_counter() - started, 3)}


def evict_files(files: list[Path]) -> None:
    """Write these files back and evict their pages alone (no root needed)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def print_goals(rows: list[tuple[str, float | None, str]]) -> None:
    """Figures beside their goals, a row each: (what, figure or None, goal such as "<= 0.35")."""
    width = max([len("what"), *(len(r[0]) for r in rows)])
    print(f"  {'what':{width}}  {'figure':>9}  goal")
    for what, figure, goal in rows:
        shown = "-" if figure is None else f"{figure:.3f}"
        print(f"  {what:{width}}  {shown:>9}  {goal}")


def write_device_results(stem: str, script: str, blas: dict, args, **payload) -> Path:
    """`payload`, with this device, the command (`script` and this process's
    arguments) and `args.runs`, written to `args.out` or to
    bench-results/chat-users/<stem>-<cpu|cuda>.json (the probes of issue 62); says where."""
    device = "cpu" if mx.default_device() == mx.cpu else "cuda"
    argv = sys.argv[1:]  # less --out and its path: where it wrote is not said
    kept = [a for i, a in enumerate(argv) if not a.startswith("--out") and argv[i - 1 : i] != ["--out"]]
    command = " ".join(["python", str(Path(script).resolve().relative_to(REPO_ROOT)), *kept])
    path = args.out or f"bench-results/chat-users/{stem}-{device}.json"
    out = write_results(path, {"device": describe_device(), "command": command, "runs": args.runs, **payload}, blas)
    print(f"wrote {out}")
    return out


def write_results(path: str | Path, payload: dict, blas: dict) -> Path:
    """Write `payload` as JSON with the date, machine and BLAS added; relative
    paths are taken from the repository root."""
    out = Path(path)
    if not out.is_absolute():
        out = REPO_ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    blas = dict(blas, libraries=sorted({Path(p).name for p in blas.get("libraries", [])}))
    for key in ("cblas_sgemm_from", "ld_preload"):  # LD_PRELOAD may name several
        if blas.get(key):
            blas[key] = " ".join(Path(p).name for p in str(blas[key]).split())
    doc = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "blas": blas,  # library file names only: no paths of the machine that ran it
        **payload,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out
