"""Cold hits against recomputing them, and against what the host can move.

Side by side in one run, on one model (mlx-lm's llama with random weights) and
prefixes of several lengths: time to first token (TTFT) of a full prefill, of a
hot hit, and of cold hits served by each plan (load, recompute, overlap, and auto,
the store's own choice) with the page cache warm and dropped; a cold restore
alone against mx.load of the same bytes; restore GB/s beside the host's limits
(page cache and disk read by dd and by the reading threads' pattern, memcpy,
and on CUDA host-to-device uploads); the cold tier's write against mlx-lm's
save_prompt_cache + fsync of the same cache. Runs of
different paths alternate, so a shared machine weighs on each alike; medians
are quoted.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python tools/bench/bench_cold.py --profile cpu
    python tools/bench/bench_cold.py --profile cuda     # MLX's CUDA backend: Llama-3.1-8B's shape

Writes bench-results/cold-<profile>.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    blas_info,
    blas_warning,
    describe_device,
    drop_page_cache,
    evict_files,
    print_goals,
    summarize,
    write_results,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlx_lm.models.cache import save_prompt_cache  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.caches import make_prompt_cache, snapshot_prompt_cache  # noqa: E402
from promptstore.identity import NodeId  # noqa: E402
from promptstore.snapshots import cold, device, reader  # noqa: E402
from promptstore.snapshots.cold import ColdTier  # noqa: E402
from promptstore.snapshots.page_cache import resident_bytes  # noqa: E402
from promptstore.testing.models import tiny_model  # noqa: E402

MODEL_ID = "bench-cold"
PLANS = ("load", "recompute", "overlap", "auto")


@dataclass(frozen=True)
class Profile:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str
    prefixes: tuple[int, ...]  # tokens stored, then hit
    new: int  # tokens past the prefix in each request
    prefill_step: int
    runs: int  # runs of each path at the longest prefix
    short_runs: int  # at the shorter ones: a hit of tens of ms moves by several between runs
    # (on CUDA, a 2k cell's seven runs spread as wide as the gap between two plans: 15 there)
    write_runs: int
    note: str


PROFILES = {
    "cpu": Profile(
        "cpu", 2, 2048, 32, 8, 64, 8192, 4096, "float32", (512, 2048, 4096), 64, 512, 3, 3, 9,
        "float32 on CPU with OpenBLAS (fp16 matmul has no fast CPU kernel); 2 layers of Llama-3.2-1B's shape",
    ),
    "quick": Profile(
        "quick", 1, 256, 4, 2, 64, 512, 512, "float32", (256, 1024), 16, 128, 2, 2, 2, "smoke run: figures meaningless"
    ),
    "cuda": Profile(
        "cuda", 32, 4096, 32, 8, 128, 14336, 32000, "bfloat16", (2048, 8192, 32768), 64, 2048, 3, 15, 2,
        "bfloat16 on the GPU; Llama-3.1-8B's shape (32 layers, hidden 4096, 8 KV heads of 128) with random "
        "weights and a 32,000-token vocabulary; prefixes plus 64 new tokens",
    ),
}  # fmt: skip


def build_model(p: Profile):
    return tiny_model(
        "llama",
        dtype=getattr(mx, p.dtype),
        num_hidden_layers=p.layers,
        hidden_size=p.hidden,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        head_dim=p.head_dim,
        intermediate_size=p.intermediate,
        vocab_size=p.vocab,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )


# --- one request on each path ------------------------------------------------------------


def first_token(model, tokens: list[int], cache, start: int, step: int) -> int:
    """Prefill tokens[start:] into `cache` in steps; the greedy next token."""
    logits = None
    for lo in range(start, len(tokens), step):
        logits = model(mx.array(tokens[lo : min(lo + step, len(tokens))])[None], cache=cache)[:, -1, :]
        mx.eval(logits)
    return int(mx.argmax(logits, axis=-1).item())


def request(model, tokens, step, space=None) -> dict:
    """One request as generate() makes it: fetch (with a store), prefill the rest
    (telling the store how long that took), the first token."""
    mx.synchronize()
    t0 = time.perf_counter()
    hit = space.fetch(tokens) if space is not None else None
    fetched = time.perf_counter() - t0
    cache = hit.cache if hit is not None else make_prompt_cache(model)
    start = hit.length if hit is not None else 0
    t1 = time.perf_counter()
    token = first_token(model, tokens, cache, start, step)
    if space is not None:
        space.record_prefill(start, len(tokens), time.perf_counter() - t1)
    out = {"ttft_s": time.perf_counter() - t0, "fetch_s": fetched, "token": token}
    if hit is not None:
        out.update(length=hit.length, computed=hit.computed, cold_nodes=hit.cold_nodes)
        out["plan"] = hit.plan.mode if hit.plan is not None else "memory"
    return out


def evict_store(root: Path, how: str) -> int:
    """Evict the store's files from the page cache; returns the bytes still resident."""
    files = [p for p in root.rglob("*.safetensors") if p.is_file()]
    if how == "drop_caches":
        if not drop_page_cache():
            raise SystemExit("--drop drop_caches: the page cache was not dropped")
    else:
        evict_files(files)
    return sum(resident_bytes(p) or 0 for p in files)


def warm_page_cache(root: Path) -> None:
    for path in root.rglob("*.safetensors"):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def settle() -> None:
    """Free what the last run left in MLX's buffer cache: on CUDA that is managed
    memory, and tens of GB of it left cached slow every later run down (a 32k
    prefill measured 1.3 s alone and up to 8.6 s after other paths' runs)."""
    gc.collect()
    mx.clear_cache()


def alternate(paths: dict, runs: int, before=None, groups: list[list[str]] | None = None) -> dict[str, list]:
    """Run each path `runs` times, in an order that rotates every round, each
    run starting from a settled buffer cache. groups: the paths run one group
    after the other in each round, each group's order rotating (default: one)."""
    out = {name: [] for name in paths}
    groups = groups or [list(paths)]
    for r in range(runs):
        for group in groups:
            for name in group[r % len(group) :] + group[: r % len(group)]:
                if before is not None:
                    before(name)
                settle()
                out[name].append(paths[name]())
    return out


# --- the sweep -----------------------------------------------------------------------------


def store_prefix(root: Path, model, tokens: list[int], n: int, p: Profile) -> tuple[float, list]:
    """Prefill tokens[:n] as a caller would and store it (a chain of nodes of at
    most node_bytes each); returns the prefill seconds and the cache."""
    with PromptStore.open(root, prefill_step=p.prefill_step) as store:
        space = store.bind(model, model_id=MODEL_ID)
        cache = make_prompt_cache(model)
        mx.synchronize()
        t0 = time.perf_counter()
        first_token(model, tokens[:n], cache, 0, p.prefill_step)
        seconds = time.perf_counter() - t0
        space.record_prefill(0, n, seconds)
        space.insert(tokens[:n], cache, prefill_seconds=seconds)
    return seconds, cache


def sweep(root: Path, model, tokens: list[int], p: Profile, drop: str, kv_bytes: int, runs: int) -> dict:
    """TTFT of every path for one prefix: full prefill, hot hit, and each plan with
    the page cache warm and dropped."""
    hot = PromptStore.open(root, hot_bytes=4 * kv_bytes + (1 << 30), cold_plan="load", prefill_step=p.prefill_step)
    hot_space = hot.bind(model, model_id=MODEL_ID)
    hot_space.fetch(tokens)  # held from now on
    colds = {m: PromptStore.open(root, hot_bytes=0, cold_plan=m, prefill_step=p.prefill_step) for m in PLANS}
    spaces = {m: s.bind(model, model_id=MODEL_ID) for m, s in colds.items()}
    paths = {
        "prefill": lambda: request(model, tokens, p.prefill_step),
        "hot": lambda: request(model, tokens, p.prefill_step, hot_space),
    }
    for plan in PLANS:
        for page in ("warm", "dropped"):
            paths[f"{plan}/{page}"] = lambda s=spaces[plan]: request(model, tokens, p.prefill_step, s)
    resident: dict[str, list[int]] = {}

    def before(name: str) -> None:
        if name.endswith("/dropped"):
            resident.setdefault(name, []).append(evict_store(root / "cold", drop))
        elif "/" in name:
            warm_page_cache(root / "cold")

    for name in paths:  # warm-up: compiled kernels, and the rates auto plans by
        before(name)
        settle()
        paths[name]()
    # Paths with the page cache warm run before those that drop it, in each round:
    # in one rotating order, each plan's warm run always came right after the same
    # path's drop of the page cache (auto's after overlap's: 7-8 ms more of an 8k
    # fetch on an H200, in two runs of three), which no warm-up of the files undid.
    dropped = [name for name in paths if name.endswith("/dropped")]
    runs = alternate(paths, runs, before, [[n for n in paths if n not in dropped], dropped])
    for s in (hot, *colds.values()):
        s.close()
    rows = {name: {**summarize([r["ttft_s"] for r in rs]), "runs_detail": rs} for name, rs in runs.items()}
    for name, res in resident.items():
        rows[name]["resident_bytes_before"] = res
    return rows


def restore_alone(root: Path, model, tokens, p: Profile, kv_bytes: int, tmp: Path, drop: str) -> dict:
    """A cold fetch (read, verify, into the cache) against mx.load of one file of the
    same bytes, page cache warm, paired runs; then the fetch with the cache dropped."""
    store = PromptStore.open(root, hot_bytes=0, cold_plan="load")
    space = store.bind(model, model_id=MODEL_ID)

    def fetch():
        hit = space.fetch(tokens)
        mx.eval([c.state for c in hit.cache])
        return hit

    hit = fetch()
    same = tmp / "same-bytes.safetensors"
    arrays = {f"a{i}": mx.contiguous(a) for i, a in enumerate(state_arrays(hit.cache))}
    mx.save_safetensors(str(same), arrays)
    del hit, arrays

    def load(stream=None):
        got = mx.load(str(same), stream=stream) if stream is not None else mx.load(str(same))
        mx.eval(list(got.values()))

    def load_then_hash():
        """The floor of any verified load: mx.load, then xxh3-128 of every array on
        the store's hashing threads (what a restore checks), no store code around it."""
        got = mx.load(str(same))
        mx.eval(list(got.values()))
        cold.checksums(got)

    hash_pool = ThreadPoolExecutor(1)

    def load_beside_hash():
        """mx.load while another thread hashes the same bytes from the mapped file:
        what hashing beside MLX's loader could at best give."""

        def hash_file():
            with open(same, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                view = memoryview(mapped)
                try:
                    return xxhash.xxh3_128_hexdigest(view[8:])
                finally:
                    view.release()

        hashed = hash_pool.submit(hash_file)
        got = mx.load(str(same))
        mx.eval(list(got.values()))
        hashed.result()

    def load_and_grow():
        """mx.load, then the copy mlx-lm's first decode step makes of a cache loaded
        without room to write (what a restore does up front)."""
        got = mx.load(str(same))
        mx.eval([mx.concatenate([a, mx.zeros((*a.shape[:2], 256, a.shape[3]), a.dtype)], axis=2) for a in got.values()])

    paths = {
        "fetch": lambda: _time(fetch),
        "mx.load": lambda: _time(load),
        "mx.load + first-step copy": lambda: _time(load_and_grow),
        "mx.load, then its checksums": lambda: _time(load_then_hash),
        "mx.load beside a hash of the file": lambda: _time(load_beside_hash),
    }
    if device.CUDA:
        paths["mx.load (CPU stream)"] = lambda: _time(lambda: load(mx.cpu))
    warm_page_cache(root / "cold")
    # A restore of tens of MB takes a few ms, and moves by as much between runs
    # (where its memory comes from): such a one is run many times.
    timed = alternate(paths, max(3, p.runs) if kv_bytes >= 1 << 30 else max(15, p.runs))
    dropped = []
    for _ in range(2):
        evict_store(root / "cold", drop)
        dropped.append(_time(fetch)[0])
    store.close()
    wall = {k: [w for w, _ in v] for k, v in timed.items()}
    f, m = float(np.median(wall["fetch"])), float(np.median(wall["mx.load"]))
    out = {
        "bytes": kv_bytes,
        "fetch_warm": summarize(wall["fetch"]),
        "mx_load_warm": summarize(wall["mx.load"]),
        "fetch_dropped": summarize(dropped),
        "restore_vs_mx_load": f / m,
        "cpu_seconds_median": {k: float(np.median([c for _, c in v])) for k, v in timed.items()},
        "restore_gbps_warm": kv_bytes / f / 1e9,
        "restore_gbps_dropped": kv_bytes / float(np.median(dropped)) / 1e9,
        "mx_load_gbps": kv_bytes / m / 1e9,
        "mx_load_and_copy_warm": summarize(wall["mx.load + first-step copy"]),
        "restore_vs_mx_load_and_copy": f / float(np.median(wall["mx.load + first-step copy"])),
        # The floor of a verified load on this host, beside mx.load in the same runs.
        "mx_load_then_checksums_warm": summarize(wall["mx.load, then its checksums"]),
        "load_then_checksums_vs_mx_load": float(np.median(wall["mx.load, then its checksums"])) / m,
        "mx_load_beside_hash_warm": summarize(wall["mx.load beside a hash of the file"]),
        "load_beside_hash_vs_mx_load": float(np.median(wall["mx.load beside a hash of the file"])) / m,
    }
    hash_pool.shutdown()
    if "mx.load (CPU stream)" in wall:
        c = float(np.median(wall["mx.load (CPU stream)"]))
        out.update(mx_load_cpu_stream_warm=summarize(wall["mx.load (CPU stream)"]), restore_vs_mx_load_cpu_stream=f / c)
    return out


def state_arrays(cache) -> list[mx.array]:
    return [a for c in cache for a in c.state if isinstance(a, mx.array)]


def _time(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of fn(), its work synchronised."""
    mx.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    mx.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def writes(cache, p: Profile, tmp: Path, n: int) -> dict:
    """The cold tier's write of a prefix's snapshots against mlx-lm's save_prompt_cache
    of the cache, each to a new file, with and without fsync, paired. Every run
    writes a fresh copy of the cache, where a just-prefilled cache lives (on CUDA,
    in device memory): a save moves the arrays it writes to host memory for good,
    so a second save of the same arrays would skip a copy a real save makes.

    The cold write is timed from snapshots already taken, as a spill writes them
    (the insert took them, a copy of the cache's span, into the hot tier);
    "snapshot + cold write" times the snapshot's copy too."""
    nbytes = sum(a.nbytes for a in state_arrays(cache))
    tiers = {True: ColdTier(tmp / "w-sync"), False: ColdTier(tmp / "w-nosync", fsync=False)}
    counter = iter(range(10**9))

    def snapshots(fresh):
        snaps = snapshot_prompt_cache(fresh, 0)
        mx.eval([a for s in snaps if s is not None for a in s.all_arrays()])
        return snaps

    def cold(snaps, fsync: bool):
        tier = tiers[fsync]
        ref = tier.write(NodeId(next(counter).to_bytes(16, "big"), b"\0" * 16, 0, n), snaps)
        return tier.root / ref.path

    def snapshot_and_cold(fresh, fsync: bool):
        return cold(snapshot_prompt_cache(fresh, 0), fsync)

    def mlx_lm(fresh, fsync: bool):
        path = tmp / f"mlx-lm-{next(counter)}.safetensors"
        save_prompt_cache(str(path), fresh)
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return path

    def timed(fn, fsync, given=lambda fresh: fresh):
        def run():
            source = given(copied(cache))
            settle()
            t0 = time.perf_counter()
            path = fn(source, fsync)
            dt = time.perf_counter() - t0
            os.unlink(path)
            return dt

        return run

    paths = {
        "cold write (promptstore, fsync)": timed(cold, True, snapshots),
        "cold write (promptstore, no fsync)": timed(cold, False, snapshots),
        "snapshot + cold write (promptstore, fsync)": timed(snapshot_and_cold, True),
        "save_prompt_cache (mlx-lm)": timed(mlx_lm, False),
        "save_prompt_cache + fsync": timed(mlx_lm, True),
    }
    runs = alternate(paths, p.write_runs)
    rows = {name: {**summarize(ts), "gbps": nbytes / float(np.median(ts)) / 1e9} for name, ts in runs.items()}
    return {"bytes": nbytes, "rows": rows}


def copied(cache) -> list:
    """The cache with every array copied into a new buffer (evaluated)."""
    out = []
    for c in cache:
        twin = copy.copy(c)
        twin.state = tuple(mx.array(a) if isinstance(a, mx.array) else a for a in c.state)
        out.append(twin)
    mx.eval([a for c in out for a in c.state if isinstance(a, mx.array)])
    return out


# --- the host's limits ---------------------------------------------------------------------


def dd_rate(path: Path) -> float | None:
    """GB/s that dd reports reading `path`."""
    try:
        done = subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=8M"], capture_output=True, text=True, timeout=600
        )
        line = [ln for ln in done.stderr.splitlines() if "copied" in ln][-1]
        nbytes, seconds = int(line.split()[0]), float(line.split("copied,")[1].split()[0])
        return nbytes / seconds / 1e9 if seconds > 0 else None
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def parallel_read_rate(files: list[Path]) -> float:
    """GB/s of promptstore's reading threads' pattern alone (THREADS threads, pread
    in CHUNK pieces into buffers of their own), without hashing or copying: the
    page cache's or disk's limit for the cold tier's reader."""
    pieces = [
        (f, at, min(reader.CHUNK, f.stat().st_size - at))
        for f in files
        for at in range(0, f.stat().st_size, reader.CHUNK)
    ]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    local = threading.local()

    def read(piece):
        path, at, n = piece
        if getattr(local, "buffer", None) is None:
            local.buffer = memoryview(bytearray(reader.CHUNK))
        return os.preadv(fds[path], [local.buffer[:n]], at)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(reader.THREADS) as pool:
            total = sum(pool.map(read, pieces))
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        for fd in fds.values():
            os.close(fd)


def memcpy_rate(nbytes: int = 256 << 20) -> float:
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9


def upload_rates(nbytes: int = 1 << 30) -> dict:
    """Host-to-device GB/s on a GPU: torch from pinned and pageable memory, when
    torch with CUDA is installed (MLX has no pinned allocation of its own)."""
    if not device.CUDA:
        return {}
    try:
        import torch
    except ImportError:
        return {"torch": "not installed: pinned and pageable uploads not measured"}
    if not torch.cuda.is_available():
        return {"torch": "no CUDA in torch"}
    out = {}
    for name, pin in (("torch_pinned_h2d_gbps", True), ("torch_pageable_h2d_gbps", False)):
        src = torch.ones(nbytes // 2, dtype=torch.float16, pin_memory=pin)
        src.to("cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        src.to("cuda", non_blocking=pin)
        torch.cuda.synchronize()
        out[name] = nbytes / (time.perf_counter() - t0) / 1e9
        del src
    torch.cuda.empty_cache()
    return out


def host_limits(root: Path, drop: str) -> dict:
    files = sorted(root.rglob("*.safetensors"), key=lambda f: -f.stat().st_size)
    big = files[0]
    warm_page_cache(root)
    warm = dd_rate(big)
    threads_warm = parallel_read_rate(files)
    evict_store(root, drop)
    disk = dd_rate(big)
    evict_store(root, drop)
    threads_disk = parallel_read_rate(files)
    return {
        "dd_page_cache_gbps": warm,
        "dd_disk_gbps": disk,
        f"pread_{reader.THREADS}_threads_page_cache_gbps": threads_warm,
        f"pread_{reader.THREADS}_threads_disk_gbps": threads_disk,
        "memcpy_gbps": memcpy_rate(),
        **upload_rates(),
    }


# --- the run --------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--drop", choices=["auto", "fadvise", "drop_caches"], default="auto",
                        help="how to drop the page cache: the whole machine's /proc/sys/vm/drop_caches when "
                        "writable (root), else posix_fadvise(DONTNEED) on the store's files")  # fmt: skip
    parser.add_argument("--prefixes", help="comma-separated prefix lengths (default: the profile's)")
    parser.add_argument(
        "--short-runs", type=int, help="runs of each path at the shorter prefixes (default: the profile's)"
    )
    parser.add_argument("--dir", help="where the stores go (default: a temporary directory)")
    parser.add_argument("--out", help="JSON path (default bench-results/cold-<profile>.json)")
    args = parser.parse_args(argv)
    p = PROFILES[args.profile]
    if args.prefixes:
        p = Profile(**{**asdict(p), "prefixes": tuple(int(x) for x in args.prefixes.split(","))})
    if args.short_runs:
        p = Profile(**{**asdict(p), "short_runs": args.short_runs})
    drop = args.drop
    if drop == "auto":
        drop = "drop_caches" if os.access("/proc/sys/vm/drop_caches", os.W_OK) else "fadvise"
    blas = blas_info()
    if p.name != "cuda" and (warning := blas_warning(blas)):
        print(warning, file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="promptstore-cold-", dir=args.dir))
    load_before = os.getloadavg()
    try:
        doc = run(p, tmp, drop)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["load_average"] = {"before": load_before, "after": os.getloadavg(), "cores": os.cpu_count()}
    out = write_results(args.out or f"bench-results/cold-{p.name}.json", doc, blas)
    print(f"wrote {out}")
    return 0


def run(p: Profile, tmp: Path, drop: str) -> dict:
    dev = describe_device()
    print(f"{p.name}: {p.note}\ndevice: {dev}; page cache dropped by {drop}", flush=True)
    model = build_model(p)
    rng = np.random.default_rng(5)
    tokens = rng.integers(16, p.vocab, max(p.prefixes) + p.new).tolist()
    first_token(model, tokens[: p.prefill_step], make_prompt_cache(model), 0, p.prefill_step)  # kernels compiled
    cells, per_prefix = [], {}
    restore = write = limits = None
    for n in p.prefixes:
        root = tmp / f"store-{n}"
        prefill_s, cache = store_prefix(root, model, tokens, n, p)
        kv_bytes = sum(a.nbytes for a in state_arrays(cache))
        files = len(list((root / "cold").rglob("*.safetensors")))
        print(
            f"prefix {n}: {kv_bytes / 1e9:.3f} GB of KV in {files} files; its prefill took {prefill_s:.2f} s",
            flush=True,
        )
        request_tokens = tokens[:n] + tokens[max(p.prefixes) : max(p.prefixes) + p.new]
        if n == max(p.prefixes):
            write = writes(cache, p, tmp, n)
        del cache
        rows = sweep(root, model, request_tokens, p, drop, kv_bytes, p.runs if n == max(p.prefixes) else p.short_runs)
        per_prefix[n] = {"kv_bytes": kv_bytes, "files": files, "rows": rows}
        cells += cells_of(n, rows)
        print_prefix(n, rows)
        if n == max(p.prefixes):
            restore = restore_alone(root, model, request_tokens, p, kv_bytes, tmp, drop)
            limits = host_limits(root / "cold", drop)
        shutil.rmtree(root, ignore_errors=True)
    return report(p, dev, drop, per_prefix, cells, restore, write, limits)


def cells_of(n: int, rows: dict) -> list[dict]:
    prefill = rows["prefill"]["median_s"]
    out = []
    for name, r in rows.items():
        if "/" not in name:
            continue
        plan, page = name.split("/")
        out.append(
            {
                "prefix": n,
                "page_cache": page,
                "plan": plan,
                "ttft_s": r["median_s"],
                "runs": len(r["runs_detail"]),
                "vs_prefill": r["median_s"] / prefill,
                "plans_taken": sorted({d.get("plan") for d in r["runs_detail"]}),
                "computed_tokens": sorted({d.get("computed", 0) for d in r["runs_detail"]}),
            }
        )
    return out


def report(p, dev, drop, per_prefix, cells, restore, write, limits) -> dict:
    n = max(p.prefixes)
    rows = per_prefix[n]["rows"]
    med = {name: r["median_s"] for name, r in rows.items()}
    tokens = {r["token"] for pp in per_prefix.values() for rs in pp["rows"].values() for r in rs["runs_detail"]}
    w = write["rows"]
    doc = {
        "benchmark": "cold",
        "profile": asdict(p),
        "device": dev,
        "page_cache_drop": drop,
        "prefix_tokens": n,
        "kv_bytes": per_prefix[n]["kv_bytes"],
        "files": per_prefix[n]["files"],
        "prefill_ttft_s": med["prefill"],
        "hot_ttft_s": med["hot"],
        "cold_warm_ttft_s": med["auto/warm"],
        "cold_disk_ttft_s": med["auto/dropped"],
        "restore_gbps_warm": restore["restore_gbps_warm"],
        "restore_gbps_dropped": restore["restore_gbps_dropped"],
        "restore_vs_mx_load": restore["restore_vs_mx_load"],
        "write_gbps": w["cold write (promptstore, fsync)"]["gbps"],
        "write_gbps_no_fsync": w["cold write (promptstore, no fsync)"]["gbps"],
        "mlx_lm_save_gbps": w["save_prompt_cache (mlx-lm)"]["gbps"],
        "mlx_lm_save_fsync_gbps": w["save_prompt_cache + fsync"]["gbps"],
        "host_limits": limits,
        "first_token_per_prefix_equal": len(tokens) == len(p.prefixes) or None,
        "sweep": cells,
        "per_prefix": {str(k): v for k, v in per_prefix.items()},
        "restore_alone": restore,
        "writes": write,
    }
    doc["first_token_equal_everywhere"] = all(
        len({r["token"] for rs in pp["rows"].values() for r in rs["runs_detail"]}) == 1 for pp in per_prefix.values()
    )
    doc["goals"] = goals(doc)
    print_summary(doc)
    return doc


def goals(d: dict) -> list[dict]:
    rows = [
        ("cold hit, page cache warm <= 0.35x full prefill", d["cold_warm_ttft_s"] / d["prefill_ttft_s"], 0.35),
        ("cold hit, page cache dropped <= 0.8x full prefill", d["cold_disk_ttft_s"] / d["prefill_ttft_s"], 0.8),
        (
            "write >= mlx-lm save_prompt_cache + fsync (ratio of GB/s)",
            d["mlx_lm_save_fsync_gbps"] / d["write_gbps"],
            1.0,
        ),
    ]
    by_cell: dict[tuple, dict] = {}
    for c in d["sweep"]:
        by_cell.setdefault((c["prefix"], c["page_cache"]), {})[c["plan"]] = c["ttft_s"]
    worst = max(t["auto"] / min(v for k, v in t.items() if k != "auto") for t in by_cell.values())
    rows.append(("auto within 1.1x of the best plan in every cell", worst, 1.1))
    if d["profile"]["name"] == "cuda":
        rows.append(("restore >= 8 GB/s from page cache (inverse, s per 8 GB)", 8 / d["restore_gbps_warm"], 1.0))
    else:
        rows.append(("cold restore alone <= 1.5x mx.load of the same bytes", d["restore_vs_mx_load"], 1.5))
    return [{"goal": g, "value": v, "limit": lim, "met": v <= lim} for g, v, lim in rows]


def print_prefix(n: int, rows: dict) -> None:
    prefill = rows["prefill"]["median_s"]
    print(f"\nprefix {n}: {'path':18} {'TTFT median s':>14} {'vs prefill':>11}  plans taken (computed tokens)")
    for name, r in rows.items():
        plans = sorted({d.get("plan") for d in r["runs_detail"]} - {None})
        computed = sorted({d.get("computed", 0) for d in r["runs_detail"]} - {0})
        print(f"{'':10}{name:18} {r['median_s']:14.4f} {r['median_s'] / prefill:10.3f}x  {plans} {computed or ''}")


def print_summary(d: dict) -> None:
    r = d["restore_alone"]
    print(
        f"\nrestore alone: {r['fetch_warm']['median_s'] * 1e3:.1f} ms ({r['restore_gbps_warm']:.2f} GB/s) vs mx.load "
        f"{r['mx_load_warm']['median_s'] * 1e3:.1f} ms ({r['mx_load_gbps']:.2f} GB/s): {r['restore_vs_mx_load']:.2f}x; "
        f"page cache dropped {r['restore_gbps_dropped']:.2f} GB/s; vs mx.load and the copy mlx-lm's first step "
        f"makes: {r['restore_vs_mx_load_and_copy']:.2f}x"
    )
    if "load_then_checksums_vs_mx_load" in r:
        print(
            f"the floor of a verified load: mx.load then its checksums {r['load_then_checksums_vs_mx_load']:.2f}x "
            f"mx.load, mx.load beside a hash of the file {r['load_beside_hash_vs_mx_load']:.2f}x"
        )
    print("host:", {k: round(v, 2) if isinstance(v, float) else v for k, v in (d["host_limits"] or {}).items()})
    for name, row in d["writes"]["rows"].items():
        print(f"{name:40} {row['median_s'] * 1e3:9.1f} ms {row['gbps']:6.2f} GB/s")
    print_goals([(g["goal"], g["value"], f"<= {g['limit']}") for g in d["goals"]])
    print(f"first token equal on every path of each prefix: {d['first_token_equal_everywhere']}")


if __name__ == "__main__":
    sys.exit(main())
