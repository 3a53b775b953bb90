#!/usr/bin/env python3
"""Soak runs of promptstore's failure handling: crash injection, corruption fuzz,
multi-process load and a shared Redis Cluster, or Sentinel-watched primary, losing
a primary. Prints figures and
writes JSON (bench-results/soak.json; with --quick, bench-results/soak-quick.json).

    tools/soak.py                 300 + 60 SIGKILLs, 200 + 100 fuzz cases, 4 x 150 operations, ...: see make soak
    tools/soak.py --quick         about two minutes
    tools/soak.py --minutes 10    each selected section runs about 10 minutes
    tools/soak.py --only fuzz --fuzz-cases 2000

Sections (goals in brackets):
  crash        a writer (tests/store/_crash_worker.py) SIGKILLed at random instants, then
               the store reopened and every hit checked: corrupt hits [0], failed opens [0],
               fetch errors [0]; afterwards compact --verify [not failed] and a re-check.
  fuzz         a copy of a built store damaged once per case (bit flips, truncation,
               extension, zeroed ranges, swapped or replaced snapshot files; bit flips,
               truncation, swaps, deletion of LMDB values), then opened and probed:
               exceptions escaped [0], wrong state served [0]; detected / harmless counted.
               (Damage to LMDB's own pages is out of scope: LMDB has no page checksums.)
  concurrency  P processes x N mixed fetch / insert / compact / reopen operations on one
               store (tests/reliability/_mixed_worker.py): errors [0], unverified hits [0].
  compact_crash  compact (tests/reliability/_compact_worker.py) SIGKILLed at random instants of
               its work, a writer growing the store between kills; after each kill the store
               opens and every hit is checked: corrupt hits [0], failed opens [0], fetch errors [0],
               compacts failing on their own [0]; then a compact let finish leaves no temporary,
               unnamed or missing file [0] and the next finds nothing to repair [0].
  index_damage  a copy of a built store with one bit flipped in index/data.mdb at a record a
               lookup reads (a node's header or record, its edge, the children entry leading to
               it, the namespace spec; every copy of it in the file), or data.mdb truncated (in a
               child process: a signal counts as escaped), then opened, probed, compacted, probed:
               exceptions escaped [0], wrong state served [0].
  memory       a process whose hot tier is four nodes wide inserts and fetches with write_back
               (tests/reliability/_memory_worker.py): its anonymous RSS after the first half of
               the run grows less than 8 MiB [over bound: 0].
  remote       a Redis Cluster (3 primaries, a replica each, started here; skipped, saying why,
               without redis-server and redis-cli) shared by two processes on two stores, each
               publishing new prompts and fetching the other's; one primary SIGKILLed a third of
               the way in (quick: a quarter): wrong states [0], exceptions [0], hits not resumed
               after the kill [0]; hits, misses, remote errors and seconds to resume counted; then
               a fresh store reads what was published [wrong: 0] (a miss there is a write the
               primary had not replicated).
  sentinel     the same on a primary that three Sentinels watch, with its replica (started
               here; skipped, saying why, without redis-server): the primary SIGKILLed, the
               Sentinels promote the replica, and both stores follow it.
  hostile      a `promptstore serve` (a tiny random-weight model) holding ordinary chats from 3 threads
               while the cases of promptstore.testing.hostile (bad fields, bytes that are not UTF-8,
               wrong Content-Type, no Content-Length, 10 MB bodies) go in round-robin for 60 s (quick 15)
               and /health is polled every 0.5 s: dropped connections [0], health checks not 200 [0],
               ordinary turns failed [0]; answers by status, and answers not as the catalogue expects, counted.
  disk_full    a `promptstore serve` whose store's disk (a tmpfs mounted here; skipped, saying why,
               without the right to mount) fills up while chats go on for 60 s (quick 15), new ones and
               ones splitting the nodes of conversations stored before; then a restart on the full disk:
               stored conversations lost [0], wrong replies [0], failed turns [0], tracebacks in the
               log [0], degraded never seen on /health [0], problems compact --verify finds once the
               disk has room again [0].
  kill_turns   what a SIGKILL costs per durability: a `promptstore serve` holding chats, turn after turn,
               SIGKILLed at a random instant (0-3 s after a reply), started again on its store; each
               conversation's next turn says how many of its finished turns it restored. Turns restored
               counted per durability (admit, write_through, write_back, sync), no goal: the trade-off of
               docs/durability.md's table, measured.

Each section is a module of tools/soaks/ (crash.py, fuzz.py, ...; remote and sentinel share
remote.py); this script holds the options, the table of sections and the goals.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers are reused as they are

from soaks.common import now  # noqa: E402  (tools/ is on the path: this script's folder)
from soaks.compact_crash import compact_crash  # noqa: E402
from soaks.concurrency import concurrency  # noqa: E402
from soaks.crash import crash  # noqa: E402
from soaks.disk_full import disk_full  # noqa: E402
from soaks.fuzz import fuzz  # noqa: E402
from soaks.hostile import hostile  # noqa: E402
from soaks.index_damage import index_damage  # noqa: E402
from soaks.kill_turns import kill_turns  # noqa: E402
from soaks.memory import memory  # noqa: E402
from soaks.remote import RemoteWorker, remote, sentinel  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    p.add_argument("--quick", action="store_true", help="a short run (about two minutes)")
    p.add_argument(
        "--only",
        default="crash,fuzz,concurrency,compact_crash,index_damage,memory,remote,sentinel,hostile,kill_turns,disk_full",
        help="comma-separated sections",
    )
    p.add_argument("--minutes", type=float, help="run each section about this long (counts are then ignored)")
    p.add_argument("--crash-trials", type=int, help="SIGKILL trials per durability (default 100; quick 2)")
    p.add_argument("--crash-durability", default="sync,write_through,write_back")
    p.add_argument("--fuzz-cases", type=int, help="damaged copies to probe (default 200; quick 30)")
    p.add_argument("--procs", type=int, default=4, help="concurrent processes")
    p.add_argument("--ops", type=int, help="operations per process (default 150; quick 40)")
    p.add_argument("--compact-kills", type=int, help="SIGKILLs of compact (default 60; quick 4)")
    p.add_argument("--damage-cases", type=int, help="damaged index copies to probe (default 100; quick 12)")
    p.add_argument("--memory-ops", type=int, help="operations of the memory run (default 4000; quick 800)")
    p.add_argument("--remote-seconds", type=float, help="length of the remote run (default 90; quick 20)")
    p.add_argument(
        "--remote-final", type=int, help="published prompts a fresh store reads back (default 400; quick 100)"
    )
    p.add_argument("--hostile-seconds", type=float, help="length of the hostile run (default 60; quick 15)")
    p.add_argument("--kill-trials", type=int, help="SIGKILLs of a serving process per durability (default 5; quick 1)")
    p.add_argument("--kill-durability", default="admit,write_through,write_back,sync")
    p.add_argument("--disk-full-seconds", type=float, help="chats on the full disk (default 60; quick 15)")
    p.add_argument("--remote-worker", help=argparse.SUPPRESS)  # a worker of the remote run (its spec, JSON)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="the JSON written (default bench-results/soak.json; quick soak-quick.json)")
    p.add_argument("--work", help="scratch directory (default: a new temporary one, removed afterwards)")
    p.add_argument("--verbose", action="store_true", help="show promptstore's warnings (misses are counted either way)")
    args = p.parse_args(argv)
    args.out = args.out or str(REPO / "bench-results" / ("soak-quick.json" if args.quick else "soak.json"))
    args.crash_trials = args.crash_trials or (2 if args.quick else 100)
    args.fuzz_cases = args.fuzz_cases or (30 if args.quick else 200)
    args.ops = args.ops or (40 if args.quick else 150)
    args.compact_kills = args.compact_kills or (4 if args.quick else 60)
    args.damage_cases = args.damage_cases or (12 if args.quick else 100)
    args.memory_ops = args.memory_ops or (800 if args.quick else 4000)
    args.remote_seconds = args.remote_seconds or (60 * args.minutes if args.minutes else 20 if args.quick else 90)
    args.remote_kill_after = args.remote_seconds / (4 if args.quick else 3)
    args.remote_final = args.remote_final or (100 if args.quick else 400)
    args.hostile_seconds = args.hostile_seconds or (60 * args.minutes if args.minutes else 15 if args.quick else 60)
    args.kill_trials = args.kill_trials or (1 if args.quick else 5)
    args.disk_full_seconds = args.disk_full_seconds or (60 * args.minutes if args.minutes else 15 if args.quick else 60)
    args.kill_durability = args.kill_durability.split(",")
    args.crash_durability = args.crash_durability.split(",")
    if args.quick and "--crash-durability" not in " ".join(argv or sys.argv):
        args.crash_durability = ["sync", "write_through"]
    args.only = [s for s in args.only.split(",") if s]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections: {sorted(unknown)}")
    return args


SECTIONS = {
    "crash": crash,
    "fuzz": fuzz,
    "concurrency": concurrency,
    "compact_crash": compact_crash,
    "index_damage": index_damage,
    "memory": memory,
    "remote": remote,
    "sentinel": sentinel,
    "hostile": hostile,
    "kill_turns": kill_turns,
    "disk_full": disk_full,
}


def environment() -> dict:
    import importlib.metadata as md

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mlx": md.version("mlx"),
        "mlx_lm": md.version("mlx-lm"),
        "lmdb": md.version("lmdb"),
    }


def main(argv=None) -> int:
    args = parse(argv)
    if not args.verbose:
        logging.getLogger("promptstore").setLevel(logging.CRITICAL)
    if args.remote_worker:
        return RemoteWorker(json.loads(args.remote_worker)).run()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="promptstore-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "work", "verbose", "remote_worker")}
    print(f"soak: {config}", flush=True)
    result = {"config": config, "environment": environment(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    started = now()
    sections = SECTIONS
    try:
        for name in args.only:
            print(f"{name}:", flush=True)
            t0 = now()
            result[name] = sections[name](args, work)
            print(f"  ({name}: {now() - t0:.0f} s)", flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = round(now() - started, 1)
    goals = {
        "crash_corrupt_hits": result.get("crash", {}).get("totals", {}).get("corrupt_hits"),
        "crash_failed_opens": result.get("crash", {}).get("totals", {}).get("failed_opens"),
        "crash_fetch_errors": result.get("crash", {}).get("totals", {}).get("fetch_errors"),
        "fuzz_exceptions_escaped": result.get("fuzz", {}).get("exceptions_escaped"),
        "fuzz_wrong_state_served": result.get("fuzz", {}).get("wrong_state_served"),
        "concurrency_errors": result.get("concurrency", {}).get("totals", {}).get("errors"),
        "concurrency_unverified": result.get("concurrency", {}).get("totals", {}).get("unverified"),
        **{
            f"compact_crash_{k}": result.get("compact_crash", {}).get(k)
            for k in (
                "corrupt_hits",
                "failed_opens",
                "fetch_errors",
                "compact_errors",
                "leftovers",
                "repairs_left",
                "final_corrupt_hits",
            )
        },
        "index_damage_exceptions_escaped": result.get("index_damage", {}).get("exceptions_escaped"),
        "index_damage_wrong_state_served": result.get("index_damage", {}).get("wrong_state_served"),
        "memory_over_bound": result.get("memory", {}).get("over_bound"),
        "remote_wrong_states": result.get("remote", {}).get("wrong_states"),
        "remote_exceptions": result.get("remote", {}).get("exceptions"),
        "remote_not_resumed": result.get("remote", {}).get("not_resumed"),
        "sentinel_wrong_states": result.get("sentinel", {}).get("wrong_states"),
        "sentinel_exceptions": result.get("sentinel", {}).get("exceptions"),
        "sentinel_not_resumed": result.get("sentinel", {}).get("not_resumed"),
        "hostile_dropped": result.get("hostile", {}).get("dropped"),
        "hostile_health_lost": result.get("hostile", {}).get("health_lost"),
        "hostile_ordinary_failed": result.get("hostile", {}).get("ordinary_failed"),
        **{
            f"disk_full_{k}": result.get("disk_full", {}).get(k)
            for k in ("lost", "wrong_replies", "failed_turns", "tracebacks", "compact_problems")
        },
    }
    if "degraded_seen" in result.get("disk_full", {}):
        goals["disk_full_degraded_not_seen"] = int(not result["disk_full"]["degraded_seen"])
    result["goals"] = {k: v for k, v in goals.items() if v is not None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    met = all(v == 0 for v in result["goals"].values())
    print(f"goals (all 0 is a pass): {result['goals']} -> {'PASS' if met else 'FAIL'}")
    print(f"wrote {out} ({result['seconds']} s)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
