"""The soak's compact_crash section: compact SIGKILLed at random instants of its
work, a writer growing the store between kills; then a compact let finish."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .common import now


def compact_crash(args, work: Path) -> dict:
    from tests.reliability.test_compact_crash import kill_compact, repaired_for_good
    from tests.store.test_crash import Checker

    started, stats = now(), Counter()
    root = work / "compact-crash"
    checker = kill_compact(root, kills=args.compact_kills, seed=args.seed, stats=stats)
    after = repaired_for_good(root)
    final = Checker(args.seed + 1)
    final.check(root)
    result = {
        "kills": stats["killed"],
        "finished": stats["finished"],
        "compact_errors": stats["compact_errors"],
        **{k: checker.stats.get(k, 0) for k in ("fetches", "hits", "corrupt_hits", "failed_opens", "fetch_errors")},
        "after": after,
        "leftovers": after["temp_files"] + after["unnamed_files"] + after["missing_files"],
        "repairs_left": len(after["second_repairs"]),
        "final_hits": final.stats.get("hits", 0),
        "final_corrupt_hits": final.stats.get("corrupt_hits", 0),
        "problems": [repr(r)[:300] for r in checker.reports if r[0] != "report" or r[1][0] != "missing"][:10],
        "seconds": round(now() - started, 1),
    }
    print(
        f"  compact_crash: kills={result['kills']} (finished {result['finished']}) fetches={result['fetches']} "
        f"hits={result['hits']} corrupt_hits={result['corrupt_hits']} failed_opens={result['failed_opens']} "
        f"fetch_errors={result['fetch_errors']} compact_errors={result['compact_errors']} | then compact "
        f"{after['first']}, leftovers={result['leftovers']}, next compact repairs={after['second_repairs']}, "
        f"corrupt hits after={result['final_corrupt_hits']} ({result['seconds']} s)",
        flush=True,
    )
    return result
