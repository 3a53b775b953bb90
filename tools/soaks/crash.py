"""The soak's crash section: a writer (tests/store/_crash_worker.py) SIGKILLed at
random instants, then the store reopened and every hit checked."""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

from .common import Budget, now, signature


def crash(args, work: Path) -> dict:
    from promptstore.store.compact import compact
    from tests.store.test_crash import Checker, Writer, leftovers

    out = {}
    for durability in args.crash_durability:
        root, logs = work / f"crash-{durability}", work / f"crash-{durability}-logs"
        logs.mkdir(parents=True)
        rng = random.Random(args.seed)
        checker = Checker(args.seed)
        checker.check(root)  # creates the store; all misses
        budget = Budget(args.crash_trials, args.minutes)
        started = now()
        pending = Writer(root, durability, args.seed * 1000, logs)
        while True:
            writer = pending
            writer.expect("imported", timeout=120)
            writer.go()
            writer.expect("ready", timeout=60)
            budget.done += 1
            last = not budget.more()
            pending = None if last else Writer(root, durability, args.seed * 1000 + budget.done, logs)
            time.sleep(rng.uniform(0.2, 2.5))
            checker.kill_and_check(writer, root)
            if last:
                break
        stats = Counter(checker.stats)
        stats.update(leftovers(root))
        try:
            report = compact(root, verify=True, max_bytes=1 << 30)
            stats["compact_status"] = report.status
            stats["compact_reclaimed_files"] = sum(v["files"] for v in report.actions.values())
        except Exception as e:  # noqa: BLE001 - reported
            stats["compact_status"] = f"raised {signature(e)}"
        after = Checker(args.seed + 1)
        after.check(root)
        stats["after_compact_corrupt_hits"] = after.stats.get("corrupt_hits", 0)
        stats["after_compact_fetch_errors"] = after.stats.get("fetch_errors", 0)
        stats["after_compact_hits"] = after.stats.get("hits", 0)
        stats["seconds"] = round(now() - started, 1)
        problems = [r for r in checker.reports if r[0] != "report" or r[1][0] != "missing"]
        out[durability] = {**dict(stats), "problems": [repr(p)[:300] for p in problems[:10]]}
        print(
            f"  crash[{durability}]: trials={stats['trials']} inserts={stats['inserts']} "
            f"fetches={stats['fetches']} hits={stats['hits']} corrupt_hits={stats.get('corrupt_hits', 0)} "
            f"failed_opens={stats.get('failed_opens', 0)} fetch_errors={stats.get('fetch_errors', 0)} "
            f"quarantined={stats['quarantined']} compact={stats['compact_status']} "
            f"after_compact_corrupt_hits={stats['after_compact_corrupt_hits']} ({stats['seconds']} s)",
            flush=True,
        )
    totals = Counter()
    for d in out.values():
        for k in ("trials", "corrupt_hits", "failed_opens", "fetch_errors", "after_compact_corrupt_hits"):
            totals[k] += d.get(k, 0)
    return {"by_durability": out, "totals": dict(totals)}
