"""A hot chat round through mlx-lm's BatchGenerator, step by step: where the
time to a round's first tokens goes, with no server.

    python tools/gpu/batch_round.py [--profile cuda] [--users 8 16] [--runs 3] [--out FILE]

Each user's conversation (a context of its own, --context tokens) is prefilled
once. A round then sends every user's next turn (--new tokens, a little longer
for each user, as a chat's turns are) with its conversation's cache, and runs
mlx-lm's BatchGenerator, as both servers do, until every user has its first
token. Four ways:
- kept: the caches as the process computed them (mlx_lm.server holds its
  prompt cache so), copied for the round;
- restored: stored in a promptstore store and fetched back from its memory
  tier, as promptstore serve hands a hit to mlx-lm;
- kept, staggered and restored, staggered: one request joins per step, as a
  burst reaches a server (the first alone, the rest joining the batch under way).
Every step (`next()`) is timed with the device synchronized, with the prompts it
advanced and the tokens it produced. Each way runs --runs rounds; the first
holds the process's first kernel builds for its shapes and is reported apart.
Prints a table and writes bench-results/chat-users/batch-round-<device>.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_serve import PROFILES as SERVE_PROFILES  # noqa: E402
from common import blas_info, write_device_results  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore import caches as C  # noqa: E402
from promptstore.generation import prefill  # noqa: E402
from promptstore.serve.cache import StoreCache  # noqa: E402
from promptstore.serve.tenants import PUBLIC  # noqa: E402
from promptstore.testing.model_dir import write_model_dir  # noqa: E402
from promptstore.testing.models import DEMO_LLAMA  # noqa: E402

PROFILES = {
    "cpu": dict(
        model=dict(DEMO_LLAMA), dtype="float32", context=700, note="the demo's llama (4 layers, hidden 256), float32"
    ),
    "cuda": dict(
        model=SERVE_PROFILES["cuda"]["model"], dtype="bfloat16", context=4800, note=SERVE_PROFILES["cuda"]["note"]
    ),
}
WAYS = ("kept", "restored", "kept, staggered", "restored, staggered")
VOCAB = 1024
MAX_STEPS = 400  # bounded: a round takes a handful


def tokens(seed: int, n: int) -> list[int]:
    return [1 + (seed * 7919 + i * 104729) % (VOCAB - 1) for i in range(n)]


def prefilled(model, ids: list[int]) -> list:
    """A new cache holding `ids` (the server's 2,048-token steps)."""
    cache = C.make_prompt_cache(model)
    prefill(model, cache, ids, 0, len(ids), 2048)
    return cache


def copied(model, cache: list, n: int) -> list:
    """A copy of `cache` (holding n tokens), evaluated: the round's own arrays."""
    held = C.make_prompt_cache(model)
    if not C.restore_prompt_cache(held, C.snapshot_prompt_cache(cache), n):
        raise RuntimeError("a cache could not be copied")
    mx.eval([c.state for c in held])
    return held


def one_round(model, contexts, caches, store: StoreCache | None, new: list[list[int]], staggered: bool) -> dict:
    """Seconds to every user's first token (all, and the median), each step's
    milliseconds, prompts and tokens, and each user's first token."""
    users = len(contexts)
    if store is None:
        # (cache, tokens after it, a list of those it holds: mlx-lm's batch appends to it)
        handed = [(copied(model, caches[u], len(contexts[u])), new[u], list(contexts[u])) for u in range(users)]
    else:
        handed, held = [], []
        for u in range(users):
            prompt = contexts[u] + new[u]
            held.append(store.begin(PUBLIC, prompt, None, ())[0])  # in flight for the round
            cache, rest = store.fetch_nearest_cache(store.model_key, prompt)
            if cache is None:
                raise RuntimeError("the store missed a conversation it holds")
            handed.append((cache, rest, prompt[: len(prompt) - len(rest)]))
    generator = BatchGenerator(
        model,
        completion_batch_size=max(32, users),
        prefill_batch_size=8,
        prefill_step_size=2048,
        stream=mx.default_stream(mx.default_device()),
    )
    waiting, uids, first, token, steps = list(range(users)), [], {}, {}, []

    def insert(which: list[int]) -> None:
        uids.extend(
            generator.insert_segments(
                segments=[[handed[u][1]] for u in which],
                max_tokens=[2] * len(which),
                caches=[handed[u][0] for u in which],
                all_tokens=[handed[u][2] for u in which],
            )
        )

    started = time.perf_counter()
    try:
        for _ in range(MAX_STEPS):
            if waiting:
                take, waiting = (waiting[:1], waiting[1:]) if staggered else (waiting, [])
                insert(take)
            t = time.perf_counter()
            prompt_responses, responses = generator.next()
            mx.synchronize()
            now = time.perf_counter()
            for r in responses:
                if r.uid not in first:
                    first[r.uid] = now - started
                    token[r.uid] = r.token
            steps.append(dict(ms=(now - t) * 1e3, prompts=len(prompt_responses), tokens=len(responses)))
            if len(first) == users and not waiting:
                break
    finally:
        generator.close()
    if len(first) < users:
        raise RuntimeError(f"{users - len(first)} of {users} users had no first token in {MAX_STEPS} steps")
    return dict(
        all_s=max(first.values()),
        median_s=statistics.median(first.values()),
        steps=steps,
        first_tokens=[token[uid] for uid in uids],  # by user: the same whichever way the caches came
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--users", type=int, nargs="+", default=[8])
    p.add_argument("--context", type=int, help="tokens of each conversation so far (default: the profile's)")
    p.add_argument("--new", type=int, default=60, help="the first user's new tokens; each next user's 2 more")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", help="JSON path (default bench-results/chat-users/batch-round-<device>.json)")
    args = p.parse_args()
    profile = PROFILES[args.profile]
    context = args.context or profile["context"]
    work = Path(tempfile.mkdtemp(prefix="batch-round-"))
    rows = []
    try:
        folder = write_model_dir(
            work / "model", "llama", vocab_size=VOCAB, dtype=getattr(mx, profile["dtype"]), **profile["model"]
        )
        model, tokenizer = load(str(folder))
        print(f"{profile['note']}; {context}-token conversations; first round apart, then the median of the others")
        print(
            f"{'users':>5}  {'way':<20} {'all first tokens':>22} {'median first token':>22}  steps of the last round (ms)"
        )
        for users in args.users:
            contexts = [tokens(u, context + 16 * u) for u in range(users)]
            caches = [prefilled(model, ids) for ids in contexts]
            with PromptStore.open(work / f"store-{users}") as kept_in:
                store = StoreCache(kept_in, model_id="probe")
                store.attach(model, tokenizer, None, ("m", None, None), prefill_step=2048)
                for ids, cache in zip(contexts, caches):
                    held, _ = store.begin(PUBLIC, ids, None, ())  # in flight while it lives: it owns the insert
                    store.insert_cache(store.model_key, ids, copied(model, cache, len(ids)))
                    store.inserts.run_deferred()
                    del held
                for way in WAYS:
                    rounds = []
                    for run in range(args.runs):
                        new = [tokens(1000 + 100 * run + u, args.new + 2 * u + run) for u in range(users)]
                        restored = way.startswith("restored")
                        rounds.append(
                            one_round(model, contexts, caches, store if restored else None, new, "staggered" in way)
                        )
                        mx.clear_cache()
                    rest = rounds[1:] or rounds
                    row = dict(
                        users=users,
                        way=way,
                        context_tokens=context,
                        first_all_s=rounds[0]["all_s"],
                        all_s=statistics.median(r["all_s"] for r in rest),
                        median_first_s=statistics.median(r["median_s"] for r in rest),
                        rounds=rounds,
                    )
                    rows.append(row)
                    last = ", ".join(f"{s['ms']:.0f}" for s in rounds[-1]["steps"])
                    print(
                        f"{users:>5}  {way:<20} {row['first_all_s'] * 1e3:>8,.0f} / {row['all_s'] * 1e3:>8,.0f} ms"
                        f" {row['median_first_s'] * 1e3:>19,.0f} ms  {last}",
                        flush=True,
                    )
            del caches
            mx.clear_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the cuda profile's model is 16 GB
    note = profile["note"]
    write_device_results("batch-round", __file__, blas_info(), args, benchmark="batch round", model=note, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
