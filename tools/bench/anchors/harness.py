"""What every contender shares: outcomes, the greedy generation, the no-cache reference,
and running a workload's requests through each contender in turn."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

from .workloads import FIRST_CONTENT, Profile, Request, Script


def state_arrays(cache) -> list[mx.array]:
    """The arrays that hold a cache's state at its offset (what a restore makes)."""
    from mlx.utils import tree_flatten

    out = []
    for c in cache:
        if getattr(c, "empty", None) is not None and c.empty():
            continue
        out += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    return out


def signature(arrays: list[mx.array]) -> list:
    return [[list(a.shape), str(a.dtype).rsplit(".", 1)[-1]] for a in arrays]


def tree_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass
class Outcome:
    name: str
    prompt_tokens: int
    restored: int = 0
    matched: int = 0  # promptstore: prompt tokens it stores (where the prompt diverges from them)
    cold_tokens: int = 0
    restore_s: float = 0.0
    restored_bytes: int = 0
    sig: list = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    reply: list = field(default_factory=list)
    margins: list = field(default_factory=list)  # top-2 logprob margin at each generated token
    lp_diff0: float | None = None  # max |logprob - no cache's| over the first token's distribution
    diverge: int | None = None  # first reply token that differs from no cache's
    margin_ref: float | None = None  # no cache's top-2 margin there
    margin_at: float | None = None  # this contender's top-2 margin there


class Engine:
    """The generation every contender shares: mlx-lm's generate_step, greedy."""

    def __init__(self, model, profile: Profile):
        self.model, self.profile = model, profile

    def generate(self, cache, tokens: list[int], t0: float, out: Outcome) -> None:
        """Greedy reply to `tokens` (the prompt past what `cache` holds) into
        `out`: reply, TTFT from `t0`, and (after the first token, untimed
        where it matters) the top-2 logprob margins and the first token's
        logprobs (kept in `last_lp0` to compare with no cache's)."""
        gen = generate_step(
            mx.array(tokens),
            self.model,
            prompt_cache=cache,
            max_tokens=self.profile.reply_tokens,
            prefill_step_size=self.profile.prefill_step,
        )
        reply, margins, ttft = [], [], None
        for token, logprobs in gen:
            if ttft is None:
                ttft = time.perf_counter() - t0
                self.last_lp0 = np.array(logprobs.astype(mx.float32))
            top2 = mx.topk(logprobs.astype(mx.float32), 2)
            margins.append(float(mx.max(top2) - mx.min(top2)))
            reply.append(int(token))
        out.reply, out.ttft_s, out.margins = reply, ttft, margins

    def prefill(self, cache, tokens: list[int], start: int, end: int) -> None:
        """tokens[start:end] through the model in prefill steps (as promptstore's
        stream_generate prefills between checkpoints)."""
        step = self.profile.prefill_step
        for lo in range(start, end, step):
            self.model(mx.array(tokens[lo : min(lo + step, end)])[None], cache=cache)
            mx.eval([c.state for c in cache])


class Contender:
    name = "?"
    persistent = False
    root: Path | None = None  # where a contender that keeps files keeps them

    def __init__(self, engine: Engine):
        self.engine = engine

    def serve(self, req: Request) -> Outcome:
        raise NotImplementedError

    def probe(self, req: Request) -> int:
        """Tokens of `req` this contender could restore right now (nothing is run)."""
        return 0

    def disk_bytes(self) -> int:
        """Bytes of every file it left under its root (0 without one)."""
        return tree_bytes(self.root) if self.root is not None else 0

    def close(self) -> None:
        pass

    @staticmethod
    def _restored(out: Outcome, cache, restored: int, t0: float) -> None:
        arrays = state_arrays(cache) if restored else []
        mx.eval(arrays)
        out.restore_s = time.perf_counter() - t0
        out.restored = restored
        out.restored_bytes = sum(a.nbytes for a in arrays)
        out.sig = signature(arrays)


class NoCache(Contender):
    name = "no cache"

    def serve(self, req):
        out = Outcome(req.name, len(req.prompt))
        t0 = time.perf_counter()
        cache = mlc.make_prompt_cache(self.engine.model)
        self.engine.generate(cache, req.prompt, t0, out)
        out.total_s = time.perf_counter() - t0
        return out


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Reference:
    """No cache's outcomes and first-token logprobs, to compare the others with."""

    def __init__(self):
        self.outs: dict[str, Outcome] = {}
        self.lp0: dict[str, np.ndarray] = {}

    def keep(self, out: Outcome, lp0: np.ndarray) -> None:
        self.outs[out.name], self.lp0[out.name] = out, lp0

    def compare(self, out: Outcome, lp0: np.ndarray) -> None:
        ref = self.outs.get(out.name)
        if ref is None:
            return
        out.lp_diff0 = float(np.max(np.abs(lp0 - self.lp0[out.name])))
        for i, (a, b) in enumerate(zip(out.reply, ref.reply)):
            if a != b:
                out.diverge, out.margin_ref, out.margin_at = i, ref.margins[i], out.margins[i]
                break


def serve_all(contender: Contender, requests, reference: Reference, is_reference: bool, label: str) -> list[Outcome]:
    started = time.perf_counter()
    outs = []
    for req in requests:
        out = contender.serve(req)
        lp0 = contender.engine.last_lp0
        reference.keep(out, lp0) if is_reference else reference.compare(out, lp0)
        outs.append(out)
    log(f"  {label}: {contender.name}: {len(outs)} requests in {time.perf_counter() - started:.1f}s")
    return outs


def run_script(script: Script, contenders: list[Contender]) -> dict:
    """Run every request through every contender; the first (no cache) is
    the reference. Returns {contender: [Outcome]}."""
    results: dict[str, list[Outcome]] = {}
    reference = Reference()
    for i, contender in enumerate(contenders):

        def requests(first=i == 0):
            for build in script.steps():
                req = build(script.replies)
                yield req
                if first:
                    script.replies[req.name] = reference.outs[req.name].reply

        results[contender.name] = serve_all(contender, requests(), reference, i == 0, script.name)
    return results


def warm_up(engine: Engine) -> None:
    """Compile and fault in the model once (untimed)."""
    cache = mlc.make_prompt_cache(engine.model)
    engine.generate(cache, list(range(FIRST_CONTENT, FIRST_CONTENT + 64)), time.perf_counter(), Outcome("warm-up", 64))


def pct(values, q) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None
