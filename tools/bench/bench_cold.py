"""Cold hits against recomputing them, and against what the host can move.

Side by side in one run, on one model (mlx-lm's llama with random weights)
and one stored prefix: time to first token (TTFT) of a full prefill, of a hot
hit, and of a cold hit with the page cache warm and with it dropped (each
cold hit served both by loading, cold_plan="load", and as the store chooses,
cold_plan="auto"); a cold restore alone against mx.load of the same bytes;
restore GB/s next to the host's page-cache read, memcpy and disk rates (on
CUDA also host-to-device uploads); and the cold tier's write against mlx-lm's
save_prompt_cache of the same cache. Runs of different paths alternate, so
a shared, noisy machine weighs on each alike; medians are quoted.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python tools/bench/bench_cold.py --profile cpu
    python tools/bench/bench_cold.py --profile cuda     # MLX's CUDA backend: Llama-3.1-8B's shape, 32k prefix

Writes bench-results/cold-<profile>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import blas_info, blas_warning, summarize, write_results  # noqa: E402
from mlx_lm.models.cache import save_prompt_cache  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.caches import make_prompt_cache, snapshot_prompt_cache  # noqa: E402
from promptstore.identity import NodeId  # noqa: E402
from promptstore.snapshots.cold import ColdTier  # noqa: E402
from promptstore.testing.models import tiny_model  # noqa: E402

MODEL_ID = "bench-cold"


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
    prefix: int  # tokens stored, then hit
    new: int  # tokens past the prefix in each request
    prefill_step: int
    runs: int
    restore_runs: int
    note: str


PROFILES = {
    "cpu": Profile(
        "cpu", 2, 2048, 32, 8, 64, 8192, 4096, "float32", 2048, 64, 512, 3, 9,
        "float32 on CPU with OpenBLAS (fp16 matmul has no fast CPU kernel); 2 layers of Llama-3.2-1B's shape; "
        "a 2,048-token prefix plus 64 new tokens",
    ),
    "quick": Profile(
        "quick", 1, 256, 4, 2, 64, 512, 512, "float32", 256, 16, 128, 2, 3, "smoke run: figures meaningless"
    ),
    "cuda": Profile(
        "cuda", 32, 4096, 32, 8, 128, 14336, 32000, "bfloat16", 32768, 64, 2048, 3, 5,
        "bfloat16 on the GPU; Llama-3.1-8B's shape (32 layers, hidden 4096, 8 KV heads of 128) with random "
        "weights and a 32,000-token vocabulary; a 32,768-token prefix plus 64 new tokens",
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
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
    )


# --- the paths a request can take -------------------------------------------------------


def first_token(model, tokens: list[int], cache, start: int, step: int) -> int:
    """Prefill tokens[start:] into `cache` in steps; the greedy next token."""
    logits = None
    for lo in range(start, len(tokens), step):
        logits = model(mx.array(tokens[lo : min(lo + step, len(tokens))])[None], cache=cache)[:, -1, :]
        mx.eval(logits)
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    return int(token.item())


def request(model, tokens, step, space=None) -> dict:
    """One request: (fetch, when there is a store) then prefill and the first token."""
    t0 = time.perf_counter()
    hit = space.fetch(tokens) if space is not None else None
    fetched = time.perf_counter() - t0
    cache = hit.cache if hit is not None else make_prompt_cache(model)
    token = first_token(model, tokens, cache, hit.length if hit else 0, step)
    out = {"ttft_s": time.perf_counter() - t0, "fetch_s": fetched, "token": token}
    if hit is not None:
        out.update(length=hit.length, cold_nodes=hit.cold_nodes, computed=hit.computed)
        out["plan"] = hit.choice.mode if hit.choice else None
    return out


def drop_page_cache(root: Path, how: str) -> int:
    """Evict the store's files from the page cache; returns the bytes still resident."""
    files = [p for p in root.rglob("*") if p.is_file()]
    if how == "drop_caches":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    else:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return sum(resident_bytes(p) or 0 for p in files)


def resident_bytes(path: Path) -> int | None:
    """Bytes of `path` in the page cache (util-linux fincore), None where unknown."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def alternate(paths: dict, runs: int, before=None) -> dict[str, list[dict]]:
    """Run each path `runs` times, in an order that rotates every round."""
    out = {name: [] for name in paths}
    names = list(paths)
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if before is not None:
                before(name)
            out[name].append(paths[name]())
    return out


# --- the host's limits -------------------------------------------------------------------


def read_rate(path: Path, chunk: int = 8 << 20) -> float:
    """GB/s of a Python preadv loop over `path` into one reused buffer."""
    buf = memoryview(bytearray(chunk))
    fd = os.open(path, os.O_RDONLY)
    t0, done = time.perf_counter(), 0
    try:
        while (n := os.preadv(fd, [buf], done)) > 0:
            done += n
    finally:
        os.close(fd)
    return done / (time.perf_counter() - t0) / 1e9


def dd_rate(path: Path) -> float | None:
    try:
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M"], capture_output=True, timeout=600, check=True)
        return path.stat().st_size / (time.perf_counter() - t0) / 1e9
    except (OSError, subprocess.SubprocessError):
        return None


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
    """Host-to-device GB/s where MLX runs on a GPU: mx.array of host memory, and
    torch from pinned and pageable memory when torch with CUDA is installed."""
    if mx.default_device() != mx.gpu:
        return {}
    host = np.ones(nbytes // 2, np.float16)
    out = {}
    mx.eval(mx.array(host))
    t0 = time.perf_counter()
    mx.eval(mx.array(host))
    out["mx_array_from_numpy_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
    try:
        import torch
    except ImportError:
        return {**out, "torch": "not installed: pinned and pageable uploads not measured"}
    if not torch.cuda.is_available():
        return {**out, "torch": "no CUDA in torch: pinned and pageable uploads not measured"}
    for name, pin in (("torch_pinned_h2d_gbps", True), ("torch_pageable_h2d_gbps", False)):
        src = torch.ones(nbytes // 2, dtype=torch.float16, pin_memory=pin)
        src.to("cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        src.to("cuda", non_blocking=pin)
        torch.cuda.synchronize()
        out[name] = nbytes / (time.perf_counter() - t0) / 1e9
    return out


def host_limits(files: list[Path], drop: str) -> dict:
    total = sum(p.stat().st_size for p in files)

    def rate() -> float:  # GB/s over all the files, each read once
        return total / sum(p.stat().st_size / (read_rate(p) * 1e9) for p in files) / 1e9

    rate()  # makes them resident
    warm, dd = rate(), dd_rate(files[0])
    resident = drop_page_cache(files[0].parents[2], drop)
    disk = rate()
    return {
        "page_cache_read_gbps": warm,
        "dd_page_cache_gbps": dd,
        "disk_read_gbps": disk,
        "resident_bytes_after_drop": resident,
        "memcpy_gbps": memcpy_rate(),
        **upload_rates(),
    }


# --- the benchmark ---------------------------------------------------------------------------


def store_prefix(root: Path, model, tokens: list[int], p: Profile) -> tuple[float, list]:
    """Prefill the prefix as a caller would and store it (one node); returns the
    prefill seconds and the cache, still holding the prefix."""
    with PromptStore.open(root, prefill_step=p.prefill_step) as store:
        space = store.bind(model, model_id=MODEL_ID)
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        first_token(model, tokens[: p.prefix], cache, 0, p.prefill_step)
        seconds = time.perf_counter() - t0
        space.insert(tokens[: p.prefix], cache, prefill_seconds=seconds)
    return seconds, cache


def ttft_rows(root: Path, model, tokens, p: Profile, kv_bytes: int, drop: str) -> dict:
    """TTFT of every path, alternating; cold paths from stores with nothing hot."""
    big = 4 * kv_bytes + (1 << 30)
    hot = PromptStore.open(root, hot_bytes=big, cold_plan="load", prefill_step=p.prefill_step)
    hot_space = hot.bind(model, model_id=MODEL_ID)
    hot_space.fetch(tokens)  # held from now on
    colds = {m: PromptStore.open(root, hot_bytes=0, cold_plan=m, prefill_step=p.prefill_step) for m in ("load", "auto")}
    spaces = {m: s.bind(model, model_id=MODEL_ID) for m, s in colds.items()}
    paths = {
        "full prefill": lambda: request(model, tokens, p.prefill_step),
        "hot hit": lambda: request(model, tokens, p.prefill_step, hot_space),
        "cold hit, page cache warm (load)": lambda: request(model, tokens, p.prefill_step, spaces["load"]),
        "cold hit, page cache warm (auto)": lambda: request(model, tokens, p.prefill_step, spaces["auto"]),
        "cold hit, page cache dropped (load)": lambda: request(model, tokens, p.prefill_step, spaces["load"]),
        "cold hit, page cache dropped (auto)": lambda: request(model, tokens, p.prefill_step, spaces["auto"]),
    }
    for fn in paths.values():  # warm-up: compiled kernels, and the auto plan's rates
        fn()
    resident = {}

    def before(name):
        if "dropped" in name:
            resident.setdefault(name, []).append(drop_page_cache(root / "cold", drop))

    runs = alternate(paths, p.runs, before)
    for s in (hot, *colds.values()):
        s.close()
    rows = {name: {**summarize([r["ttft_s"] for r in rs]), "runs_detail": rs} for name, rs in runs.items()}
    for name, res in resident.items():
        rows[name]["resident_bytes_before"] = res
    return rows


def restore_alone(root: Path, model, tokens, p: Profile, kv_bytes: int, tmp: Path, drop: str) -> dict:
    """A cold fetch (read, verify, into the cache) against mx.load of one file of the
    same bytes; page cache warm, paired runs; then the fetch with the cache dropped."""
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
    nbytes = sum(a.nbytes for a in arrays.values())
    del hit, arrays

    def load():
        got = mx.load(str(same))
        mx.eval(list(got.values()))

    timed = alternate({"fetch": lambda: _time(fetch), "mx.load": lambda: _time(load)}, p.restore_runs)
    dropped = []
    for _ in range(max(2, p.restore_runs // 3)):
        drop_page_cache(root / "cold", drop)
        dropped.append(_time(fetch))
    store.close()
    f, m = float(np.median(timed["fetch"])), float(np.median(timed["mx.load"]))
    return {
        "bytes": nbytes,
        "kv_bytes": kv_bytes,
        "fetch_warm": summarize(timed["fetch"]),
        "mx_load_warm": summarize(timed["mx.load"]),
        "fetch_dropped": summarize(dropped),
        "restore_vs_mx_load": f / m,
        "restore_gbps_warm": nbytes / f / 1e9,
        "restore_gbps_dropped": nbytes / float(np.median(dropped)) / 1e9,
        "mx_load_gbps": nbytes / m / 1e9,
    }


def state_arrays(cache) -> list[mx.array]:
    """The arrays that hold a cache's state at its offset (what a restore makes)."""
    return [a for c in cache for a in c.state if isinstance(a, mx.array)]


def _time(fn) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    fn()
    mx.synchronize()
    return time.perf_counter() - t0


def writes(cache, p: Profile, tmp: Path) -> dict:
    """The cold tier's write of the prefix's snapshots against mlx-lm's
    save_prompt_cache of the cache, each to a new file, paired."""
    snaps = snapshot_prompt_cache(cache, 0)
    mx.eval([a for s in snaps for a in s.all_arrays()])
    nbytes = sum(s.nbytes for s in snaps)
    tiers = {True: ColdTier(tmp / "w-sync"), False: ColdTier(tmp / "w-nosync", fsync=False)}
    counter = iter(range(10**9))

    def cold(fsync: bool):
        tier = tiers[fsync]
        ref = tier.write(NodeId(next(counter).to_bytes(16, "big"), b"\0" * 16, 0, p.prefix), snaps)
        return tier.root / ref.path

    def mlx_lm(fsync: bool):
        path = tmp / f"mlx-lm-{next(counter)}.safetensors"
        save_prompt_cache(str(path), cache)
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return path

    def timed(fn, fsync):
        def run():
            t0 = time.perf_counter()
            path = fn(fsync)
            dt = time.perf_counter() - t0
            os.unlink(path)
            return dt

        return run

    paths = {
        "cold write (promptstore, fsync)": timed(cold, True),
        "cold write (promptstore, no fsync)": timed(cold, False),
        "save_prompt_cache (mlx-lm)": timed(mlx_lm, False),
        "save_prompt_cache + fsync": timed(mlx_lm, True),
    }
    for fn in paths.values():
        fn()
    runs = alternate(paths, p.restore_runs)
    rows = {name: {**summarize(ts), "gbps": nbytes / float(np.median(ts)) / 1e9} for name, ts in runs.items()}
    return {"bytes": nbytes, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--drop", choices=["fadvise", "drop_caches"], default="fadvise",
                        help="how to drop the page cache: posix_fadvise(DONTNEED) on the store's files (default), "
                        "or the whole machine's /proc/sys/vm/drop_caches (root)")  # fmt: skip
    parser.add_argument("--dir", help="where the store goes (default: a temporary directory on the disk of /tmp)")
    parser.add_argument("--out", help="JSON path (default bench-results/cold-<profile>.json)")
    args = parser.parse_args(argv)
    p = PROFILES[args.profile]
    blas = blas_info()
    if p.name != "cuda" and (warning := blas_warning(blas)):
        print(warning, file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="promptstore-cold-", dir=args.dir))
    try:
        doc = run(p, tmp, args.drop)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = write_results(args.out or f"bench-results/cold-{p.name}.json", doc, blas)
    print(f"wrote {out}")
    return 0


def run(p: Profile, tmp: Path, drop: str) -> dict:
    device = describe_device()
    print(f"{p.name}: {p.note}\ndevice: {device}", flush=True)
    model = build_model(p)
    rng = np.random.default_rng(5)
    tokens = rng.integers(16, p.vocab, p.prefix + p.new).tolist()
    root = tmp / "store"
    prefill_s, cache = store_prefix(root, model, tokens, p)
    kv_bytes = sum(a.nbytes for a in state_arrays(cache))
    print(f"stored a {p.prefix}-token prefix ({kv_bytes / 1e9:.3f} GB of KV; its prefill took {prefill_s:.2f} s)")
    write = writes(cache, p, tmp)
    del cache
    files = sorted((root / "cold").rglob("*.safetensors"))
    limits = host_limits(files, drop)
    rows = ttft_rows(root, model, tokens, p, kv_bytes, drop)
    restore = restore_alone(root, model, tokens, p, kv_bytes, tmp, drop)
    return report(p, device, drop, kv_bytes, rows, restore, write, limits)


def describe_device() -> str:
    if mx.default_device() == mx.gpu:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            if out:
                return f"GPU: {out.splitlines()[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
        return f"GPU: {mx.device_info().get('device_name', 'unknown')}"
    return f"CPU: {os.cpu_count()} cores ({mx.default_device()})"


def report(p, device, drop, kv_bytes, rows, restore, write, limits) -> dict:
    med = {name: r["median_s"] for name, r in rows.items()}
    prefill = med["full prefill"]
    want = rows["full prefill"]["runs_detail"][0]["token"]
    same = all(r["token"] == want for rs in rows.values() for r in rs["runs_detail"])
    plans = {name: sorted({r.get("plan") for r in rs["runs_detail"]} - {None}) for name, rs in rows.items()}
    w = write["rows"]
    doc = {
        "benchmark": "cold",
        "profile": asdict(p),
        "device": device,
        "page_cache_drop": drop,
        "kv_bytes": kv_bytes,
        "prefill_ttft_s": prefill,
        "hot_ttft_s": med["hot hit"],
        "cold_warm_ttft_s": med["cold hit, page cache warm (auto)"],
        "cold_disk_ttft_s": med["cold hit, page cache dropped (auto)"],
        "cold_warm_load_ttft_s": med["cold hit, page cache warm (load)"],
        "cold_disk_load_ttft_s": med["cold hit, page cache dropped (load)"],
        "restore_gbps_warm": restore["restore_gbps_warm"],
        "restore_gbps_dropped": restore["restore_gbps_dropped"],
        "restore_vs_mx_load": restore["restore_vs_mx_load"],
        "write_gbps": w["cold write (promptstore, fsync)"]["gbps"],
        "write_gbps_no_fsync": w["cold write (promptstore, no fsync)"]["gbps"],
        "mlx_lm_save_gbps": w["save_prompt_cache (mlx-lm)"]["gbps"],
        "mlx_lm_save_fsync_gbps": w["save_prompt_cache + fsync"]["gbps"],
        "host_limits": limits,
        "plans_taken": plans,
        "first_token_equal_everywhere": same,
        "ttft": rows,
        "restore_alone": restore,
        "writes": write,
    }
    doc["goals"] = goals(doc)
    print_table(doc)
    return doc


def goals(d: dict) -> list[dict]:
    rows = [
        ("cold hit, page cache warm <= 0.5x full prefill", d["cold_warm_ttft_s"] / d["prefill_ttft_s"], 0.5),
        ("cold hit, page cache dropped <= 1.0x full prefill", d["cold_disk_ttft_s"] / d["prefill_ttft_s"], 1.0),
        ("restore alone <= 1.5x mx.load of the same bytes", d["restore_vs_mx_load"], 1.5),
        ("write >= mlx-lm save_prompt_cache (ratio of GB/s)", d["write_gbps_no_fsync"] / d["mlx_lm_save_gbps"], None),
    ]
    out = []
    for goal, value, limit in rows:
        met = value <= limit if limit is not None else value >= 1.0
        out.append({"goal": goal, "value": value, "met": met})
    if d["profile"]["name"] == "cuda":
        out.append({"goal": "restore >= 10 GB/s from page cache", "value": d["restore_gbps_warm"],
                    "met": d["restore_gbps_warm"] >= 10})  # fmt: skip
    return out


def print_table(d: dict) -> None:
    print(f"\n{'path':40} {'TTFT median s':>14} {'vs prefill':>11}  plans")
    for name, r in d["ttft"].items():
        print(f"{name:40} {r['median_s']:14.4f} {r['median_s'] / d['prefill_ttft_s']:10.3f}x  {d['plans_taken'][name]}")
    r = d["restore_alone"]
    print(
        f"\nrestore alone: {r['fetch_warm']['median_s'] * 1e3:.1f} ms ({r['restore_gbps_warm']:.2f} GB/s) vs mx.load "
        f"{r['mx_load_warm']['median_s'] * 1e3:.1f} ms ({r['mx_load_gbps']:.2f} GB/s): {r['restore_vs_mx_load']:.2f}x; "
        f"page cache dropped {r['restore_gbps_dropped']:.2f} GB/s"
    )
    print("host:", {k: round(v, 2) if isinstance(v, float) else v for k, v in d["host_limits"].items()})
    for name, row in d["writes"]["rows"].items():
        print(f"{name:40} {row['median_s'] * 1e3:9.1f} ms {row['gbps']:6.2f} GB/s")
    for g in d["goals"]:
        print(f"  {'met   ' if g['met'] else 'MISSED'} {g['goal']}: {g['value']:.3f}")
    print(f"first token equal on every path: {d['first_token_equal_everywhere']}")


if __name__ == "__main__":
    sys.exit(main())
