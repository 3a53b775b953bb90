"""Probe: a cold hit read from one node file, against the same tokens spread over several.

A conversation that comes back after its state left memory is read from disk.
By its third visit its tokens lie in several nodes (the first prompt, each
stored reply, each new message), each a file of its own. This stores one
~4.2k-token conversation three ways (one node; a 4,096-token node and 2 or 4
small ones), opens the store afresh before each fetch (nothing in memory, the
page cache warm, MLX's buffer cache emptied as mlx-lm empties it after each
prefill step; and the five nodes once more with the small ones held in memory,
the large one read from disk, as a third visit in promptstore serve's
memory-pressure run finds them), and times each fetch whole and in phases: starting the reads
(the arrays' allocation included), finishing them (the reads, checksums and
the read-back of each array's ends), and the restore (joining the nodes'
arrays). Then the first token of the 18 tokens past the hit through mlx-lm's
BatchGenerator, as promptstore serve runs it. Variants alternate; medians.

    python3 tools/bench/probe_cold_path.py --profile cuda
    LD_PRELOAD=...openblas... .venv/bin/python tools/bench/probe_cold_path.py --profile cpu

It times; it checks only that each fetch restores the whole hit. Figures go to
stdout and --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cold import PROFILES, build_model  # noqa: E402
from common import describe_device, time_calls  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlx_lm.generate import BatchGenerator  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.caches import make_prompt_cache  # noqa: E402
from promptstore.snapshots import cold, reader  # noqa: E402
from promptstore.store import restore, tiers  # noqa: E402

PHASES: dict[str, list[float]] = defaultdict(list)


def prefill(model, tokens: list[int], step: int):
    cache = make_prompt_cache(model)
    for lo in range(0, len(tokens), step):
        model(mx.array(tokens[lo : lo + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def build(path: Path, model, tokens: list[int], pieces: list[int], step: int) -> int:
    store = PromptStore.open(path, warm_start=False, durability="sync", hot_bytes=4 << 30)
    space = store.bind(model, model_id="probe")
    end = 0
    for piece in pieces:
        end += piece
        space.insert(tokens[:end], prefill(model, tokens[:end], step))
    store.close()
    mx.clear_cache()
    return end


def first_token(model, cache, tokens: list[int], start: int) -> float:
    """Seconds from the BatchGenerator's insert to the first token of tokens[start:]."""
    gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8, prefill_step_size=2048)
    started = time.perf_counter()
    gen.insert_segments(segments=[[tokens[start:]]], max_tokens=[2], caches=[cache], all_tokens=[tokens[:start]])
    for _ in range(1000):
        _, out = gen.next()
        if out:
            break
    seconds = time.perf_counter() - started
    gen.close()
    return seconds


def one_fetch(path: Path, model, tokens: list[int], end: int, hot_bytes: int | None = None) -> dict:
    """A fetch from the store opened afresh. hot_bytes: a memory budget under the
    large node's size, and a fetch before the timed one, so the small nodes are
    held in memory and the large one is read from disk (a conversation's third
    visit in promptstore serve's memory-pressure run)."""
    mx.clear_cache()
    store = PromptStore.open(path, warm_start=False, hot_bytes=hot_bytes or 2 << 30, cold_plan="load")
    space = store.bind(model, model_id="probe")
    if hot_bytes:
        space.fetch(tokens[: end + 18])
        gc.collect()
        mx.clear_cache()
    PHASES.clear()
    started = time.perf_counter()
    hit = space.fetch(tokens[: end + 18])
    mx.eval([c.state for c in hit.cache])
    fetch = time.perf_counter() - started
    assert hit.length == end, (hit.length, end)
    row = {"fetch_ms": fetch * 1e3, "nodes": hit.nodes, "cold_nodes": hit.cold_nodes}
    for label, seconds in PHASES.items():
        row[f"{label}_ms"] = sum(seconds) * 1e3
        row[f"{label}_calls"] = len(seconds)
    mx.clear_cache()
    row["first_token_ms"] = first_token(model, hit.cache, tokens[: end + 18], end) * 1e3
    store.close()
    del hit, space, store
    gc.collect()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    prof = PROFILES[args.profile]
    model = build_model(prof)
    mx.random.seed(0)
    extra = [18, 40, 18, 40]
    tokens = [int(t) for t in mx.random.randint(0, prof.vocab, (4096 + sum(extra) + 64,)).tolist()]
    time_calls(tiers.Tiers, "start_path", "start", PHASES)
    time_calls(tiers.Tiers, "finish_path", "finish", PHASES)
    time_calls(restore.Restorer, "restore_path", "restore", PHASES)
    time_calls(restore.Restorer, "_load", "load", PHASES)
    time_calls(reader._Placement, "allocate", "allocate", PHASES)
    time_calls(reader, "_check_landed", "landed", PHASES)
    time_calls(cold.PendingLoad, "_verify", "verify", PHASES)
    layouts = {"1 node": [4096 + sum(extra)], "3 nodes": [4096, *extra[:2]], "5 nodes": [4096, *extra]}
    work = Path(tempfile.mkdtemp(prefix="probe-cold-path-"))
    folders = {name: work / name.replace(" ", "-") for name in layouts}
    ends = {name: build(folders[name], model, tokens, pieces, prof.prefill_step) for name, pieces in layouts.items()}
    kv_per_token = 2 * prof.layers * prof.kv_heads * prof.head_dim * getattr(mx, prof.dtype).size
    budgets = dict.fromkeys(layouts)
    layouts["5 nodes, the small ones in memory"] = layouts["5 nodes"]  # the same store, read another way
    folders[last := "5 nodes, the small ones in memory"], ends[last] = folders["5 nodes"], ends["5 nodes"]
    budgets[last] = 4096 * kv_per_token // 2
    for name in layouts:  # a first fetch of each: kernels compiled, files in the page cache
        one_fetch(folders[name], model, tokens, ends[name], budgets[name])
    rows = defaultdict(list)
    for i in range(args.runs):
        order = list(layouts) if i % 2 == 0 else list(reversed(layouts))
        for name in order:
            rows[name].append(one_fetch(folders[name], model, tokens, ends[name], budgets[name]))
    out = {"profile": args.profile, "device": describe_device(), "runs": dict(rows), "medians": {}}
    for name, got in rows.items():
        keys = [k for k in got[0] if k.endswith("_ms")]
        med = {k: round(statistics.median(r.get(k, 0.0) for r in got), 2) for k in keys}
        out["medians"][name] = med | {"cold_nodes": got[0]["cold_nodes"], "tokens": ends[name]}
        read = f"{got[0]['cold_nodes']} of {got[0]['nodes']} nodes from disk"
        print(f"{name} ({ends[name]} tokens, {read}): " + ", ".join(f"{k} {v}" for k, v in med.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
