"""The soak's concurrency section: P processes x N mixed fetch / insert / compact /
reopen operations on one store (tests/reliability/_mixed_worker.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .common import Budget, now


def error_kind(e: str) -> str:
    """'op: Type: message at file:line (function)' -> 'op: Type at file:line (function)'."""
    if e.startswith("worker exited"):
        return e.split(":", 1)[0] + " " + (e.strip().splitlines()[-1][:120] if "\n" in e else "")
    op, _, rest = e.partition(": ")
    kind = rest.split(":", 1)[0]
    where = rest.rsplit(" at ", 1)[1] if " at " in rest else ""
    return f"{op}: {kind} {where}".strip()


def concurrency(args, work: Path) -> dict:
    from tests.reliability.test_concurrency import check_store, run_workers

    rounds, started = [], now()
    budget = Budget(1, args.minutes)
    while budget.more():
        budget.done += 1
        root = work / f"concurrency-{budget.done}"
        run = run_workers(root, ops=args.ops, procs=args.procs, seed=args.seed + budget.done, timeout=3600)
        final = check_store(root)
        errors = Counter(error_kind(e) for w in run["workers"] for e in w["errors"])
        rounds.append(
            {
                **run["totals"],
                "final": final,
                "error_kinds": dict(errors),
                "unverified_examples": [u for w in run["workers"] for u in w["unverified"]][:5],
                "seconds": run["seconds"],
            }
        )
        t = run["totals"]
        print(
            f"  concurrency round {budget.done}: {args.procs}x{args.ops} ops={t.get('ops', 0)} "
            f"fetches={t.get('fetches', 0)} hits={t.get('hits', 0)} inserts={t.get('inserts', 0)} "
            f"compacts={t.get('compacts', 0)} reopens={t.get('reopens', 0)} errors={t['errors']} "
            f"unverified={t['unverified']} | after: unverified={final['unverified']} "
            f"quarantined={final['quarantined']} compact_failed={final['compact_failed']} ({run['seconds']} s)",
            flush=True,
        )
        for k, v in errors.items():
            print(f"    error x{v}: {k}")
    totals = Counter()
    for r in rounds:
        for k in ("ops", "errors", "unverified"):
            totals[k] += r.get(k, 0)
        totals["final_unverified"] += r["final"]["unverified"]
        totals["quarantined"] += r["final"]["quarantined"]
    return {
        "procs": args.procs,
        "ops_per_proc": args.ops,
        "rounds": rounds,
        "totals": dict(totals),
        "seconds": round(now() - started, 1),
    }
