"""What a failover of a Sentinel-watched primary costs two stores that share it.

Starts a primary, its replica and three Sentinels on loopback ports
(promptstore.testing.redis_sentinel: down-after-milliseconds 1000), then runs
the loop the tests run: store A inserts a new prompt (published at once) and
store B fetches it, each hit checked against a full prefill. Twice: the primary
SIGKILLed, then (with the old replica as the primary) a failover asked for with
the primary alive (SENTINEL FAILOVER). For each: seconds from the fault until
the Sentinels name the new primary and until B's first hit from it, B's misses
and the longest single fetch meanwhile, and whether any hit was wrong.

    python3 tools/bench/probe_failover.py [--out bench-results/sentinel-failover.json]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import blas_info, write_results  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import promptstore  # noqa: E402
from promptstore.caches import make_prompt_cache  # noqa: E402
from promptstore.snapshots.remote import CHUNK  # noqa: E402
from promptstore.testing.models import tiny_model  # noqa: E402
from promptstore.testing.redis_sentinel import FAILOVER_SECONDS, SERVICE, SentinelGroup, missing  # noqa: E402

PREFIX = CHUNK + 40  # a blob and two records per prompt
SETTINGS = {"remote_timeout": 0.2, "remote_close_seconds": 2.0}
AFTER_SECONDS = 20.0  # the longest the loop runs after a fault for B to hit again


class Loop:
    def __init__(self, model, a, b):
        self.model, self.a, self.b = model, a.bind(model, model_id="m"), b.bind(model, model_id="m")
        self.store_a = a
        self.steps: list[tuple[float, bool, float]] = []  # (started, remote hit, seconds) of B's fetches
        self.wrong = self.n = 0

    def step(self) -> bool:
        self.n += 1
        tokens = mx.random.randint(0, 256, (PREFIX + 20,), key=mx.random.key(1000 + self.n))
        cache = make_prompt_cache(self.model)
        mx.eval(self.model(tokens[None, :PREFIX], cache=cache))
        self.a.insert(tokens[:PREFIX], cache)
        self.store_a.flush()
        at = time.monotonic()
        hit = self.b.fetch(tokens)
        self.steps.append((at, hit.remote_tokens > 0, time.monotonic() - at))
        if hit.length:
            want = self.model(tokens[None], cache=make_prompt_cache(self.model))[:, -1, :]
            got = self.model(tokens[None, hit.length :], cache=hit.cache)[:, -1, :]
            self.wrong += not mx.allclose(got, want, atol=1e-4, rtol=0).item()
        return hit.remote_tokens > 0


def fault(loop: Loop, group: SentinelGroup, how: str) -> dict:
    old = group.primary()
    for _ in range(3):
        loop.step()
    group.wait_synced()
    group.wait_watching()
    started = time.monotonic()
    if how == "kill":
        old.kill()
    else:
        group.live_sentinels()[0].client().execute_command("SENTINEL", "FAILOVER", SERVICE)
    promoted = first_hit = None
    while time.monotonic() - started < FAILOVER_SECONDS + AFTER_SECONDS:
        hit = loop.step()
        if promoted is None:
            try:
                if group.primary() is not old:
                    promoted = time.monotonic()
            except Exception:  # the Sentinels mid-failover
                pass
        if promoted is not None and hit and loop.steps[-1][0] > promoted:
            first_hit = loop.steps[-1][0]
            break
    during = [s for s in loop.steps if s[0] >= started and (first_hit is None or s[0] < first_hit)]
    return {
        "fault": "primary SIGKILLed" if how == "kill" else "SENTINEL FAILOVER, primary alive",
        "promoted_after_s": None if promoted is None else round(promoted - started, 3),
        "first_remote_hit_after_s": None if first_hit is None else round(first_hit - started, 3),
        "fetches_before_it": len(during),
        "misses_before_it": sum(not remote for _, remote, _ in during),
        "longest_fetch_s": round(max((s for *_, s in during), default=0.0), 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/sentinel-failover.json")
    args = parser.parse_args(argv)
    if missing() is not None:
        print(f"no Sentinels: {missing()}")
        return 2
    logging.getLogger("promptstore").setLevel(logging.ERROR)  # every miss is reported: counted here instead
    model = tiny_model("llama")
    with tempfile.TemporaryDirectory(prefix="probe-failover-") as tmp:
        root = Path(tmp)
        (root / "redis").mkdir()
        group = SentinelGroup(root / "redis").start()
        try:
            settings = {"remote_url": group.url, **SETTINGS}
            with (
                promptstore.PromptStore.open(root / "a", **settings) as a,
                promptstore.PromptStore.open(root / "b", **settings) as b,
            ):
                loop = Loop(model, a, b)
                rows = [fault(loop, group, "kill")]
                group.add_replica()  # the killed primary stays down: the new one gets a replica
                rows.append(fault(loop, group, "failover"))
                wrong = loop.wrong
        finally:
            group.kill()
    for row in rows:
        print(
            f"{row['fault']}: promoted after {row['promoted_after_s']} s, B hit again after "
            f"{row['first_remote_hit_after_s']} s; {row['misses_before_it']} of {row['fetches_before_it']} "
            f"fetches missed, the longest {row['longest_fetch_s']} s"
        )
    print(f"wrong hits: {wrong}")
    out = write_results(
        args.out,
        {
            "benchmark": "sentinel-failover",
            "command": "python3 tools/bench/probe_failover.py",
            "settings": {**SETTINGS, "down_after_milliseconds": 1000, "sentinels": 3, "quorum": 2},
            "rows": rows,
            "wrong_hits": wrong,
        },
        blas_info(),
    )
    print(f"wrote {out}")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
