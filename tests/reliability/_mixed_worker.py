"""A process that runs a random mix of fetch / insert / compact / reopen on a
shared store and checks every hit against a full prefill.

Run as: python _mixed_worker.py STORE_DIR SEED OPS [options]
(see --help). Used by tests/reliability/test_concurrency.py and
tools/soak.py, several copies at once on one store.

It prints "ready" once the model is built and the store is open, then one JSON
line (prefixed "result ") at the end:
  ops, fetches, hits, tokens_served, inserts, compacts, reopens,
  errors (a list of "op: exception" strings; goal: empty),
  unverified (hits whose continuation differs from a full prefill; goal: empty),
  reports (miss reports of this process's tiers, by reason).
Exit status: 0 when errors and unverified are both empty, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from collections import Counter

import numpy as np

MODEL_ID = "mixed"
TOL = 1e-4


def sequences(n_roots: int = 2) -> list[list[int]]:
    """Shared-prefix token sequences, the same in every process: per root 24
    tokens, 2 branches of 16, 4 of 16 more, then 8 tails of 0-40 tokens."""
    rng = np.random.default_rng(20250101)

    def draw(n):
        return [int(t) for t in rng.integers(0, 256, n)]

    out = []
    for _ in range(n_roots):
        root = draw(24)
        level1 = [root + draw(16) for _ in range(2)]
        level2 = [level1[i // 2] + draw(16) for i in range(4)]
        out += [level2[i // 2] + draw(int(rng.integers(0, 41))) for i in range(8)]
    return out


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("seed", type=int)
    p.add_argument("ops", type=int)
    p.add_argument("--family", default="llama")
    p.add_argument("--durability", default="write_through", choices=["write_back", "write_through", "sync"])
    p.add_argument("--hot-bytes", type=int, default=1 << 16, help="small: evictions and cold loads happen often")
    p.add_argument("--map-size", type=int, default=64 << 10, help="tiny: the LMDB map grows under load")
    p.add_argument("--compact", type=float, default=0.06, help="share of ops that run compact")
    p.add_argument("--reopen", type=float, default=0.03, help="share of ops that close and reopen the store")
    return p.parse_args(argv)


def describe(e: BaseException) -> str:
    """The exception and the innermost promptstore frame that raised it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "promptstore" in f.filename]
    where = (
        f" at {'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    )
    return f"{type(e).__name__}: {e}{where}"


class Worker:
    def __init__(self, args):
        import mlx.core as mx

        from promptstore import PromptStore
        from promptstore.testing.models import tiny_model

        self.mx, self.PromptStore = mx, PromptStore
        self.args = args
        self.rng = random.Random(args.seed)
        self.model = tiny_model(args.family)
        self.seqs = [mx.array(s, dtype=mx.uint32) for s in sequences()]
        self.want: dict = {}
        self.stats: Counter = Counter()
        self.errors: list[str] = []
        self.unverified: list = []
        self.reports: Counter = Counter()
        self.store = self.space = None
        self.open()

    # --- the store ---------------------------------------------------------------

    def open(self):
        a = self.args
        self.store = self.PromptStore.open(a.store, durability=a.durability, hot_bytes=a.hot_bytes, map_size=a.map_size)
        self.space = self.store.bind(self.model, model_id=MODEL_ID)

    def close(self):
        if self.store is not None:
            for r in self.store.reports:
                self.reports[r.reason] += 1
            self.store.close()
            self.store = self.space = None

    # --- checking ----------------------------------------------------------------

    def forward(self, cache, tokens):
        logits = self.model(tokens[None], cache=cache)[:, -1, :]
        self.mx.eval(logits)
        return logits

    def reference(self, i, n):
        from promptstore.caches import make_prompt_cache

        if (i, n) not in self.want:
            self.want[i, n] = self.forward(make_prompt_cache(self.model), self.seqs[i][:n])
        return self.want[i, n]

    def fetch_checked(self, i, n):
        """Fetch seqs[i][:n]; check the hit; returns the cache, now holding all n tokens."""
        prefix = self.seqs[i][:n]
        hit = self.space.fetch(prefix)
        self.stats["fetches"] += 1
        if not 0 <= hit.length <= n - 1:
            self.unverified.append({"seq": i, "n": n, "length": hit.length, "why": "length out of range"})
        got = self.forward(hit.cache, prefix[hit.length :])
        if hit.length:
            self.stats["hits"] += 1
            self.stats["tokens_served"] += hit.length
            diff = self.mx.abs(got - self.reference(i, n)).max().item()
            if not diff < TOL:
                self.unverified.append({"seq": i, "n": n, "length": hit.length, "diff": diff})
        return hit, prefix

    # --- operations --------------------------------------------------------------

    def op_fetch_insert(self):
        i = self.rng.randrange(len(self.seqs))
        n = self.rng.randint(2, self.seqs[i].size)
        hit, prefix = self.fetch_checked(i, n)
        self.space.insert(prefix, hit.cache)
        self.stats["inserts"] += 1

    def op_checkpointed_insert(self):
        """Prefill following hit.checkpoints, inserting at each (hybrid models need them)."""
        i = self.rng.randrange(len(self.seqs))
        n = self.rng.randint(2, self.seqs[i].size)
        prefix = self.seqs[i][:n]
        hit = self.space.fetch(prefix)
        self.stats["fetches"] += 1
        pos, logits = hit.length, None
        if pos:
            self.stats["hits"] += 1
            self.stats["tokens_served"] += pos
        for point in (*hit.checkpoints, n):
            if point > pos:
                logits = self.forward(hit.cache, prefix[pos:point])
                self.space.insert(prefix[:point], hit.cache)
                self.stats["inserts"] += 1
                pos = point
        if hit.length and logits is not None:  # the restored state, continued, equals a full prefill
            diff = self.mx.abs(logits - self.reference(i, n)).max().item()
            if not diff < TOL:
                self.unverified.append({"seq": i, "n": n, "length": hit.length, "diff": diff, "op": "checkpointed"})

    def op_fetch(self):
        i = self.rng.randrange(len(self.seqs))
        self.fetch_checked(i, self.rng.randint(2, self.seqs[i].size))

    def op_compact(self):
        from promptstore.store.compact import compact

        budget = self.rng.choice([None, 1 << 30, self.rng.randint(20_000, 200_000)])
        report = compact(
            self.args.store, max_bytes=budget, verify=self.rng.random() < 0.5, merge=self.rng.random() < 0.7
        )
        self.stats["compacts"] += 1
        if report.status == "failed":
            self.errors.append(f"compact: {report.errors}")

    def op_reopen(self):
        self.close()
        if self.rng.random() < 0.5:
            self.op_compact()  # with this process's store closed: the store may be idle
        self.open()
        self.stats["reopens"] += 1

    def run(self, ops: int):
        table = [(self.op_fetch_insert, 0.55), (self.op_checkpointed_insert, 0.15), (self.op_fetch, 0.30)]
        a = self.args
        for _ in range(ops):
            r = self.rng.random()
            if r < a.compact:
                op = self.op_compact
            elif r < a.compact + a.reopen:
                op = self.op_reopen
            else:
                op = self.rng.choices([f for f, _ in table], [w for _, w in table])[0]
            try:
                op()
            except Exception as e:  # noqa: BLE001 - counted: the goal is none
                self.errors.append(f"{op.__name__}: {describe(e)}")
                traceback.print_exc()
                if self.store is None:  # a failed reopen: try once more, else stop
                    try:
                        self.open()
                    except Exception as e2:  # noqa: BLE001
                        self.errors.append(f"open: {describe(e2)}")
                        break
            self.stats["ops"] += 1


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    started = time.monotonic()
    worker = Worker(args)
    print("ready", flush=True)
    worker.run(args.ops)
    try:
        worker.close()
    except Exception as e:  # noqa: BLE001
        worker.errors.append(f"close: {type(e).__name__}: {e}")
    result = {
        **worker.stats,
        "errors": worker.errors,
        "unverified": worker.unverified,
        "reports": dict(worker.reports),
        "seconds": round(time.monotonic() - started, 2),
    }
    print("result " + json.dumps(result), flush=True)
    return 0 if not worker.errors and not worker.unverified else 1


if __name__ == "__main__":
    sys.exit(main())
