"""The restore ceilings: the same restored bytes made by one mx.concatenate (the
one-copy floor) and by mx.load of one safetensors file."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from common import timed

from .harness import Outcome, pct
from .models import dtype_of
from .workloads import Profile


def measure_ceiling(sig: list, tmp: Path, runs: int) -> dict:
    """One mx.concatenate producing these arrays, and mx.load of one file of them."""
    key = mx.random.key(7)
    pairs, whole = [], {}
    for i, (shape, dtype) in enumerate(sig):
        key, sub = mx.random.split(key)
        arr = mx.random.uniform(shape=shape, key=sub).astype(dtype_of(dtype))
        axis = int(np.argmax(shape))
        half = max(1, shape[axis] // 2) if shape[axis] > 1 else 0
        if half:
            a, b = mx.split(arr, [half], axis=axis)
            a, b = mx.contiguous(a), mx.contiguous(b)
        else:
            a, b = mx.contiguous(arr), None
        mx.eval(arr, a, b if b is not None else a)
        pairs.append((a, b, axis))
        whole[f"a{i}"] = arr
    nbytes = sum(a.nbytes for a in whole.values())

    def concat():
        return [mx.concatenate([a, b], axis=ax) if b is not None else mx.array(a) for a, b, ax in pairs]

    floor = timed(concat, runs=runs, warmup=1)
    path = tmp / "ceiling.safetensors"
    mx.save_safetensors(str(path), whole)
    load = timed(lambda: list(mx.load(str(path)).values()), runs=runs, warmup=1)
    path.unlink()
    return {"bytes": nbytes, "floor_s": floor["median_s"], "load_s": load["median_s"]}


def ceilings_for(outcomes: dict[str, list[Outcome]], profile: Profile, tmp: Path) -> list[dict]:
    """Time the ceilings for up to `ceiling_samples` distinct restored layouts,
    spread over their sizes; every hit is then matched to the nearest size."""
    sigs = {}
    for outs in outcomes.values():
        for o in outs:
            if o.restored:
                sigs[json.dumps(o.sig)] = (o.restored_bytes, o.sig)
    chosen = sorted(sigs.values(), key=lambda bs: bs[0])
    if len(chosen) > profile.ceiling_samples:
        idx = np.unique(np.linspace(0, len(chosen) - 1, profile.ceiling_samples).round().astype(int))
        chosen = [chosen[i] for i in idx]
    return [measure_ceiling(sig, tmp, profile.ceiling_runs) for _, sig in chosen]


def ceiling_times(nbytes: int, samples: list[dict]) -> tuple[float, float]:
    """(floor_s, load_s) for `nbytes`, scaled from the nearest measured size."""
    s = min(samples, key=lambda x: abs(x["bytes"] - nbytes))
    scale = nbytes / s["bytes"] if s["bytes"] else 1.0
    return s["floor_s"] * scale, s["load_s"] * scale


def ceiling_rows(outs: list[Outcome], samples: list[dict]) -> list[dict]:
    """The ceilings as rows, over the hits of `outs` (promptstore hot's)."""
    hits = [o for o in outs if o.restored]
    if not hits or not samples:
        return []
    rb = sum(o.restored_bytes for o in hits)
    rows = []
    for label, idx in (("ceiling: one mx.concatenate (one-copy floor)", 0), ("ceiling: mx.load of one file", 1)):
        times = [ceiling_times(o.restored_bytes, samples)[idx] for o in hits]
        derived = [o.ttft_s - o.restore_s + t for o, t in zip(hits, times)]
        rows.append(
            {
                "contender": label,
                "ceiling": True,
                "requests": len(hits),
                "hits": len(hits),
                "restored_bytes": rb,
                "restore_s": sum(times),
                "restore_gbps": rb / sum(times) / 1e9,
                "hit_ttft_p50_s": pct(derived, 50),
                "hit_ttft_p95_s": pct(derived, 95),
            }
        )
    return rows
