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
               README's "What the store writes" table, measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers are reused as they are

from soaks.disk_full import disk_full  # noqa: E402  (tools/ is on the path: this script's folder)

TOL = 1e-4


def now() -> float:
    return time.monotonic()


class Budget:
    """A count of cases, or a time limit when minutes are given."""

    def __init__(self, count: int, minutes: float | None):
        self.count, self.deadline = count, (now() + 60 * minutes) if minutes else None
        self.done = 0

    def more(self) -> bool:
        if self.deadline is not None:
            return now() < self.deadline
        return self.done < self.count


def print_tallies(result: dict) -> None:
    """A damage section's escapes, compact's errors (where it ran compact alone) and cases by damage."""
    for k, v in result["escapes"].items():
        print(f"    escaped ({v} times): {k}")
    for k, v in result.get("compact_errors", {}).items():
        print(f"    compact ({v} times): {k}")
    for k, v in result["by_damage"].items():
        print(f"    {k:32s} {v}")


def signature(e: BaseException) -> str:
    """Exception type plus the innermost promptstore frame: groups equal failures."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "promptstore" in f.filename]
    where = f" at {'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}{where}"


# --- crash injection ---------------------------------------------------------------------------


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


# --- corruption fuzz ---------------------------------------------------------------------------


class FuzzStore:
    """A built store, the probes to run against copies of it, and their reference logits."""

    def __init__(self, work: Path, seed: int):
        import mlx.core as mx

        from promptstore import PromptStore
        from promptstore.caches import make_prompt_cache
        from promptstore.testing.models import tiny_model
        from tests.reliability._mixed_worker import sequences

        self.mx, self.PromptStore = mx, PromptStore
        self.model = tiny_model("llama")
        self.root = work / "fuzz-base"
        rng = random.Random(seed)
        seqs = [mx.array(s, dtype=mx.uint32) for s in sequences()[::2]]
        with PromptStore.open(self.root, durability="sync") as store:
            space = store.bind(self.model, model_id="fuzz")
            for tokens in seqs:
                for n in sorted({rng.randint(8, tokens.size - 1), tokens.size}):
                    hit = space.fetch(tokens[:n])
                    self.forward(hit.cache, tokens[hit.length : n])
                    space.insert(tokens[:n], hit.cache)
        self.probes = []
        for tokens in seqs:
            for n in (tokens.size, (tokens.size * 2) // 3, 30):
                self.probes.append(tokens[:n])
        self.want = [self.forward(make_prompt_cache(self.model), p) for p in self.probes]
        self.baseline = self.serve(self.root)["lengths"]
        self.files = sorted((self.root / "cold" / "files").rglob("*.safetensors"))
        assert all(self.baseline) and self.files

    def forward(self, cache, tokens):
        logits = self.model(tokens[None], cache=cache)[:, -1, :]
        self.mx.eval(logits)
        return logits

    def serve(self, root: Path) -> dict:
        """Open, fetch every probe, check every hit. Never raises: outcomes are counted."""
        from promptstore.errors import PromptStoreError

        res = {"lengths": [], "wrong": 0, "escaped": [], "refused": None, "reports": Counter()}
        try:
            store = self.PromptStore.open(root, hot_bytes=0)
        except PromptStoreError as e:
            res["refused"] = signature(e)
            return res
        except Exception as e:  # noqa: BLE001
            res["escaped"].append(f"open: {signature(e)}")
            return res
        try:
            try:
                space = store.bind(self.model, model_id="fuzz")
            except PromptStoreError as e:
                res["refused"] = signature(e)
                return res
            for probe, want in zip(self.probes, self.want):
                try:
                    hit = space.fetch(probe)
                except Exception as e:  # noqa: BLE001 - fetch must never raise
                    res["escaped"].append(f"fetch: {signature(e)}")
                    res["lengths"].append(0)
                    continue
                res["lengths"].append(hit.length)
                if hit.length:
                    got = self.forward(hit.cache, probe[hit.length :])
                    if not self.mx.abs(got - want).max().item() < TOL:
                        res["wrong"] += 1
            for r in store.tiers.reports:
                res["reports"][r.reason] += 1
        except Exception as e:  # noqa: BLE001
            res["escaped"].append(f"namespace: {signature(e)}")
        finally:
            try:
                store.close()
            except Exception as e:  # noqa: BLE001
                res["escaped"].append(f"close: {signature(e)}")
        return res


def _flip_bits(raw: bytes, rng, lo: int = 0) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(lo, len(data))
        data[i] ^= 1 << rng.randrange(8)
    return bytes(data)


def damage_file(case_root: Path, fz: FuzzStore, rng) -> str:
    files = sorted((case_root / "cold" / "files").rglob("*.safetensors"))
    path = rng.choice(files)
    raw = path.read_bytes()
    kind = rng.choice(["bit flips", "bit flips in header", "truncate", "extend", "zero range", "swap", "replace"])
    header = 8 + int.from_bytes(raw[:8], "little") if len(raw) >= 8 else len(raw)
    if kind == "bit flips":
        path.write_bytes(_flip_bits(raw, rng))
    elif kind == "bit flips in header":
        path.write_bytes(_flip_bits(raw[:header], rng) + raw[header:])
    elif kind == "truncate":
        path.write_bytes(raw[: rng.randrange(len(raw))])
    elif kind == "extend":
        path.write_bytes(raw + rng.randbytes(rng.randint(1, 4096)))
    elif kind == "zero range":
        i = rng.randrange(len(raw))
        j = min(len(raw), i + rng.randint(1, 512))
        path.write_bytes(raw[:i] + bytes(j - i) + raw[j:])
    else:
        other = rng.choice([f for f in files if f != path] or [path])
        if kind == "swap":
            other_raw = other.read_bytes()
            other.write_bytes(raw)
        else:
            other_raw = other.read_bytes()
        path.write_bytes(other_raw)
    return f"file {kind}"


def damage_lmdb(case_root: Path, rng) -> str:
    import lmdb

    env = lmdb.open(str(case_root / "index"), max_dbs=16, subdir=True)
    try:
        name = rng.choice(
            [b"nodes"] * 4 + [b"edges"] * 2 + [b"children"] * 2 + [b"namespaces", b"counters", b"access", b"meta"]
        )
        kind = rng.choice(["bit flips", "truncate", "swap", "delete", "garbage"])
        with env.begin(write=True) as txn:
            db = env.open_db(name, txn=txn)
            items = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
            if not items:
                return f"lmdb {name.decode()} empty"
            key, value = rng.choice(items)
            if kind == "bit flips":
                txn.put(key, _flip_bits(value, rng) if value else b"\x01", db=db)
            elif kind == "truncate":
                txn.put(key, value[: rng.randrange(max(1, len(value)))], db=db)
            elif kind == "swap":
                other_key, other_value = rng.choice(items)
                txn.put(key, other_value, db=db)
                txn.put(other_key, value, db=db)
            elif kind == "delete":
                txn.delete(key, db=db)
            else:
                txn.put(key, rng.randbytes(rng.randint(1, 64)), db=db)
        return f"lmdb {name.decode()} {kind}"
    finally:
        env.close()


def fuzz(args, work: Path) -> dict:
    from promptstore.errors import PromptStoreError
    from promptstore.store.compact import compact

    started = now()
    fz = FuzzStore(work, args.seed)
    compact_errors: Counter = Counter()
    rng = random.Random(args.seed)
    budget = Budget(args.fuzz_cases, args.minutes)
    totals: Counter = Counter()
    by_damage: dict[str, Counter] = {}
    escapes: Counter = Counter()
    wrong_cases: list = []
    previous = None
    while budget.more():
        budget.done += 1
        # A fresh path per case: a store whose close() failed stays registered in this
        # process (its LMDB environment and lock), and must not meet the next case's files.
        case_root = work / f"fuzz-case-{budget.done}"
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        previous = case_root
        shutil.copytree(fz.root, case_root)
        what = damage_file(case_root, fz, rng) if rng.random() < 0.6 else damage_lmdb(case_root, rng)
        res = fz.serve(case_root)
        compact_escape = None
        try:
            report = compact(case_root, verify=True, max_bytes=1 << 30)
            compact_found = report.changed
            if report.status == "failed":
                totals["compact_failed"] += 1
                compact_errors[f"{what}: {'; '.join(report.errors)[:160]}"] += 1
        except PromptStoreError as e:  # a typed refusal (e.g. a schema it cannot read)
            totals["compact_refused"] += 1
            compact_found = True
            compact_errors[f"{what}: refused: {signature(e)}"] += 1
        except Exception as e:  # noqa: BLE001
            compact_escape, compact_found = f"compact: {signature(e)}", False
        after = fz.serve(case_root)  # what compact leaves must serve as safely
        escaped = res["escaped"] + after["escaped"] + ([compact_escape] if compact_escape else [])
        wrong = res["wrong"] + after["wrong"]
        shorter = any(a < b for a, b in zip(res["lengths"], fz.baseline))
        detected = bool(res["refused"] or sum(res["reports"].values()) or shorter or compact_found)
        outcome = "escaped" if escaped else "wrong" if wrong else "detected" if detected else "harmless"
        row = by_damage.setdefault(what, Counter())
        row[outcome] += 1
        totals["cases"] += 1
        totals[outcome] += 1
        totals["refused_at_open"] += bool(res["refused"])
        totals["wrong_hits"] += wrong
        for e in escaped:
            escapes[f"{what}: {e}"] += 1
        if wrong and len(wrong_cases) < 10:
            wrong_cases.append(what)
    result = {
        "cases": totals["cases"],
        "detected": totals["detected"],
        "harmless": totals["harmless"],
        "exceptions_escaped": totals["escaped"],
        "wrong_state_served": totals["wrong"],
        "wrong_hits": totals["wrong_hits"],
        "refused_at_open": totals["refused_at_open"],
        "compact_failed": totals["compact_failed"],
        "compact_refused": totals["compact_refused"],
        "compact_errors": dict(compact_errors.most_common(20)),
        "escapes": dict(escapes.most_common(20)),
        "wrong_cases": wrong_cases,
        "by_damage": {k: dict(v) for k, v in sorted(by_damage.items())},
        "nodes_files": len(fz.files),
        "probes": len(fz.probes),
        "seconds": round(now() - started, 1),
    }
    print(
        f"  fuzz: cases={result['cases']} detected={result['detected']} harmless={result['harmless']} "
        f"exceptions_escaped={result['exceptions_escaped']} wrong_state_served={result['wrong_state_served']} "
        f"(refused at open: {result['refused_at_open']}, compact failed: {result['compact_failed']}, "
        f"compact refused: {result['compact_refused']}; "
        f"{result['seconds']} s)",
        flush=True,
    )
    print_tallies(result)
    return result


# --- concurrency ---------------------------------------------------------------------------------


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


# --- compact killed ------------------------------------------------------------------------------


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


# --- index damage ----------------------------------------------------------------------------------


def _lookup_records(fz: FuzzStore, rng) -> list[tuple[str, bytes, bytes]]:
    """(what, key, value) of every record a lookup of a random probe reads."""
    import lmdb

    from promptstore.index import keys

    probe = rng.choice(fz.probes)
    with fz.PromptStore.open(fz.root, hot_bytes=0) as store:
        space = store.bind(fz.model, model_id="fuzz")
        path, ns = store.index.lookup(space.namespace, probe).path, space.namespace.key
    env = lmdb.open(str(fz.root / "index"), max_dbs=16, readonly=True, lock=False)
    out = []
    try:
        with env.begin() as txn:

            def get(db, key):
                return bytes(txn.get(key, db=env.open_db(db, txn=txn, create=False)))

            out.append(("namespace spec", ns, get(b"namespaces", ns)))
            for node in path:
                entry = keys.child_key(node.parent, int(node.tokens[0]))
                out += [
                    ("node record", node.key, get(b"nodes", node.key)),
                    ("edge tokens", node.key, get(b"edges", node.key)),
                    ("children entry", entry, get(b"children", entry)),
                ]
    finally:
        env.close()
    return out


def _flip_record(data: Path, key: bytes, value: bytes, at: int, bit: int) -> int:
    raw = bytearray(data.read_bytes())
    copies, start = 0, 0
    while (i := raw.find(key + value, start)) >= 0:
        raw[i + len(key) + at] ^= 1 << bit
        copies, start = copies + 1, i + 1
    data.write_bytes(bytes(raw))
    return copies


TRUNCATED_OPEN = """
import sys
from promptstore import PromptStore
from promptstore.errors import PromptStoreError
try:
    PromptStore.open(sys.argv[1], hot_bytes=0).close()
    print("opened")
except PromptStoreError as e:
    print("refused", type(e).__name__)
"""


def index_damage(args, work: Path) -> dict:
    from promptstore.errors import PromptStoreError
    from promptstore.store.compact import compact
    from tests.conftest import child_failure, run_isolated

    started = now()
    fz = FuzzStore(work / "index-damage", args.seed)
    rng = random.Random(args.seed)
    totals, by_damage, escapes = Counter(), {}, Counter()
    previous = None
    for case in range(args.damage_cases):
        case_root = work / f"index-damage-case-{case}"
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        previous = case_root
        shutil.copytree(fz.root, case_root)
        data = case_root / "index" / "data.mdb"
        escaped, wrong, detected = [], 0, False
        if rng.random() < 0.15:
            what = "truncated data.mdb"
            size = data.stat().st_size
            data.write_bytes(data.read_bytes()[: rng.choice([0, rng.randrange(1, size)])])
            result = run_isolated(TRUNCATED_OPEN, str(case_root))
            if child_failure(result):
                escaped.append(f"open: {child_failure(result)[:120]}")
            detected = result.stdout.startswith("refused")
            wrong = int(result.stdout.startswith("opened"))  # a cut file served as an empty store
        else:
            what, key, value = rng.choice(_lookup_records(fz, rng))
            if not _flip_record(data, key, value, rng.randrange(len(value)), rng.randrange(8)):
                totals["not_found"] += 1
                continue
            res = fz.serve(case_root)
            try:
                report = compact(case_root, verify=True, max_bytes=1 << 30)
                compact_found = report.changed or report.status == "failed"
            except PromptStoreError:
                compact_found = True
            except Exception as e:  # noqa: BLE001
                escaped.append(f"compact: {signature(e)}")
                compact_found = False
            after = fz.serve(case_root)
            escaped += res["escaped"] + after["escaped"]
            wrong = res["wrong"] + after["wrong"]
            shorter = any(a < b for a, b in zip(res["lengths"], fz.baseline))
            detected = bool(res["refused"] or sum(res["reports"].values()) or shorter or compact_found)
        outcome = "escaped" if escaped else "wrong" if wrong else "detected" if detected else "harmless"
        by_damage.setdefault(what, Counter())[outcome] += 1
        totals["cases"] += 1
        totals[outcome] += 1
        for e in escaped:
            escapes[f"{what}: {e}"] += 1
    result = {
        "cases": totals["cases"],
        "detected": totals["detected"],
        "harmless": totals["harmless"],
        "exceptions_escaped": totals["escaped"],
        "wrong_state_served": totals["wrong"],
        "escapes": dict(escapes.most_common(20)),
        "by_damage": {k: dict(v) for k, v in sorted(by_damage.items())},
        "seconds": round(now() - started, 1),
    }
    print(
        f"  index_damage: cases={result['cases']} detected={result['detected']} harmless={result['harmless']} "
        f"exceptions_escaped={result['exceptions_escaped']} wrong_state_served={result['wrong_state_served']} "
        f"({result['seconds']} s)",
        flush=True,
    )
    print_tallies(result)
    return result


# --- memory under eviction pressure -------------------------------------------------------------

MEMORY_BOUND = 8 << 20


def memory(args, work: Path) -> dict:
    import subprocess

    node = 128 * 2 * 2 * 2 * 16 * 4  # one 128-token node of the tiny llama, float32
    started = now()
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests/reliability/_memory_worker.py"),
            str(work / "memory"),
            str(args.memory_ops),
            str(4 * node),
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=7200,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    samples = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not samples:
        print(f"  memory: worker failed: {run.stderr[-500:]}", flush=True)
        return {"failed": run.stderr[-2000:], "over_bound": 1}
    warm = next(s for s in samples if s["op"] >= args.memory_ops // 2)
    last = samples[-1]
    mib = 1 / 2**20
    result = {
        "ops": args.memory_ops,
        "hot_budget": 4 * node,
        "hot_max": max(s["hot"] for s in samples),
        "spills": last["spills"],
        "cold_loads": last["cold_loads"],
        "rss_anon_mib": [round(s["rss_anon"] * mib, 1) for s in samples],
        "rss_mib": [round(s["rss"] * mib, 1) for s in samples],
        "ops_sampled": [s["op"] for s in samples],
        "anon_growth_second_half_mib": round((last["rss_anon"] - warm["rss_anon"]) * mib, 2),
        "rss_growth_second_half_mib": round((last["rss"] - warm["rss"]) * mib, 2),
        "spills_second_half": last["spills"] - warm["spills"],
        "bound_mib": MEMORY_BOUND * mib,
        "seconds": round(now() - started, 1),
    }
    result["over_bound"] = int(last["rss_anon"] - warm["rss_anon"] >= MEMORY_BOUND)
    print(
        f"  memory: {result['ops']} ops, hot budget {result['hot_budget']} B (max held {result['hot_max']}), "
        f"spills={result['spills']} cold_loads={result['cold_loads']}; anonymous RSS "
        f"{result['rss_anon_mib'][0]} -> {round(warm['rss_anon'] * mib, 1)} (op {warm['op']}) -> "
        f"{result['rss_anon_mib'][-1]} MiB: +{result['anon_growth_second_half_mib']} MiB over the second half "
        f"({result['spills_second_half']} spills; bound {result['bound_mib']:.0f} MiB); all RSS "
        f"+{result['rss_growth_second_half_mib']} MiB (the index's mapped pages grow with it) ({result['seconds']} s)",
        flush=True,
    )
    return result


# --- the remote tier on a Redis Cluster, a primary killed --------------------------------------

REMOTE_SETTINGS = {"remote_timeout": 0.5, "remote_close_seconds": 2.0}
REMOTE_RUN = 3  # remote hits in a row that say hits have resumed after the kill
REMOTE_ERRORS = ("remote_down", "remote_refused", "remote_garbage", "remote_missing", "remote_disk")


def remote_prompt(seed: int, role: int, i: int):
    """Prompt i of worker `role`: a system prefix every prompt shares, then a tail of
    its own (the same tokens in every process); the worker inserts all but the last 8."""
    import mlx.core as mx
    import numpy as np

    system = np.random.default_rng(seed).integers(0, 256, 256)
    rng = np.random.default_rng([seed, role, i])
    return mx.array(np.concatenate([system, rng.integers(0, 256, int(rng.integers(24, 160)))]), dtype=mx.uint32)


class Prefill:
    """The tiny model every process builds alike, and the check of a hit against a full prefill."""

    def __init__(self):
        import mlx.core as mx

        from promptstore.caches import make_prompt_cache
        from promptstore.testing.models import tiny_model

        self.mx, self.new_cache = mx, make_prompt_cache
        self.model = tiny_model("llama")

    def __call__(self, cache, tokens):
        logits = self.model(tokens[None], cache=cache)[:, -1, :]
        self.mx.eval(logits)
        return logits

    def wrong(self, hit, tokens) -> bool:
        if not hit.length:
            return False
        want = self(self.new_cache(self.model), tokens)
        return not self.mx.abs(self(hit.cache, tokens[hit.length :]) - want).max().item() < TOL


class Follower:
    """The other worker's events file, read as it grows: its newest publish not yet taken."""

    def __init__(self, path: Path):
        self.path, self.offset, self.latest, self.taken = path, 0, None, -1

    def newest(self) -> dict | None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return None
        whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self.offset += len(whole)
        for line in whole.splitlines():
            event = json.loads(line)
            if event["ev"] == "publish":
                self.latest = event
        if self.latest is None or self.latest["i"] == self.taken:
            return None
        self.taken = self.latest["i"]
        return self.latest


class RemoteWorker:
    """One of two processes on the shared server. Each step inserts (and publishes) a new
    prompt, then fetches the other's newest (a remote hit, or a miss) or, when it has
    none new, one it already pulled (a local hit); every hit is checked against a
    full prefill. Events go to a JSON-lines file the other worker follows."""

    def __init__(self, spec: dict):
        from promptstore import PromptStore

        self.role, self.root, self.seed = spec["role"], Path(spec["work"]), spec["seed"]
        self.prefill = Prefill()
        self.events = (self.root / f"events-{self.role}.jsonl").open("a", buffering=1)
        self.other = Follower(self.root / f"events-{1 - self.role}.jsonl")
        self.pulled, self.exceptions, self.steps = [], [], 0
        self.store = PromptStore.open(self.root / f"store-{self.role}", remote_url=spec["url"], **REMOTE_SETTINGS)
        self.space = self.store.bind(self.prefill.model, model_id="soak")
        self.counts = self.store.tiers.remote.counts

    def run(self) -> int:
        (self.root / f"ready-{self.role}").touch()
        until = _wait_for(self.root / "go", 300)
        while time.time() < until:
            self.publish()
            self.fetch()
        self.store.close()
        result = {"steps": self.steps, "exceptions": self.exceptions, "counts": dict(self.counts)}
        (self.root / f"result-{self.role}.json").write_text(json.dumps(result))
        return 0

    def publish(self) -> None:
        tokens, failed = remote_prompt(self.seed, self.role, self.steps), _publish_failures(self.counts)
        try:
            cache = self.prefill.new_cache(self.prefill.model)
            self.prefill(cache, tokens[:-8])
            self.space.insert(tokens[:-8], cache)
            self.store.flush()
        except Exception as e:  # noqa: BLE001 - counted: an insert never raises
            self.exceptions.append(f"insert: {signature(e)}")
        ok = _publish_failures(self.counts) == failed
        self.write({"ev": "publish", "i": self.steps, "at": time.time(), "ok": ok})
        self.steps += 1

    def fetch(self) -> None:
        new = self.other.newest()
        if new is None and not self.pulled:
            return
        j, kind = (new["i"], "new") if new is not None else (self.pulled[self.steps % len(self.pulled)], "again")
        prompt, at, before = remote_prompt(self.seed, 1 - self.role, j), time.time(), Counter(self.counts)
        try:
            hit = self.space.fetch(prompt)
        except Exception as e:  # noqa: BLE001 - counted: a fetch never raises
            self.exceptions.append(f"fetch: {signature(e)}")
            return
        took = time.time() - at
        if kind == "new" and hit.remote_tokens:
            self.pulled.append(j)
        why = [k for k in REMOTE_ERRORS if self.counts[k] > before[k]]  # the publisher is idle: flushed
        line = {"ev": "fetch", "kind": kind, "i": j, "at": at, "seconds": round(took, 4), "length": hit.length}
        line.update(want=len(prompt) - 8, remote=hit.remote_tokens > 0, why=why, published=kind == "again" or new["ok"])
        self.write({**line, "wrong": self.prefill.wrong(hit, prompt)})

    def write(self, event: dict) -> None:
        self.events.write(json.dumps({"role": self.role, **event}) + "\n")


def _publish_failures(counts) -> int:
    return counts["remote_publish_failed"] + counts["remote_publish_dropped"] + counts["remote_publish_incomplete"]


def _wait_for(path: Path, seconds: float) -> float:
    """The number a file holds, once it exists (at most `seconds`)."""
    deadline = now() + seconds
    while now() < deadline:
        try:
            return float(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise TimeoutError(f"{path.name} did not appear within {seconds} s")


def remote(args, work: Path) -> dict:
    return _shared_tier(args, work, "cluster")


def sentinel(args, work: Path) -> dict:
    return _shared_tier(args, work, "sentinel")


def _shared_tier(args, work: Path, kind: str) -> dict:
    from promptstore.testing import redis_cluster, redis_sentinel

    helpers = redis_cluster if kind == "cluster" else redis_sentinel
    why = helpers.missing()
    if why:
        print(f"  {kind}: skipped: {why}", flush=True)
        return {"skipped": why}
    started, root = now(), work / kind
    (root / "servers").mkdir(parents=True)
    servers = (
        redis_cluster.Cluster(root / "servers") if kind == "cluster" else redis_sentinel.SentinelGroup(root / "servers")
    )
    servers.start()
    procs = []
    try:
        procs = _start_workers(args, root, servers.url)
        go = time.time()
        (root / "go.tmp").write_text(str(go + args.remote_seconds))
        (root / "go.tmp").rename(root / "go")
        time.sleep(args.remote_kill_after)
        killed, promoted = _kill_a_primary(servers, kind)
        for p in procs:
            p.wait(timeout=args.remote_seconds + 120)
        results = [_worker_result(root, role, p) for role, p in enumerate(procs)]
        events = [json.loads(line) for role in (0, 1) for line in (root / f"events-{role}.jsonl").open()]
        final = _remote_final(args, servers.url, root, events, killed)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        servers.kill()
    result = _remote_figures(events, results, go, killed, promoted)
    result.update(final=final, seconds=round(now() - started, 1))
    result["wrong_states"] = result["wrong"] + final["wrong"]
    _print_remote(args, result, kind)
    return result


def _start_workers(args, root: Path, url: str) -> list:
    """Both workers, once each has built its model and opened its store."""
    import subprocess

    procs = []
    for role in (0, 1):
        spec = json.dumps({"role": role, "work": str(root), "seed": args.seed, "url": url})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--remote-worker", spec]
        cmd += ["--verbose"] if args.verbose else []
        with (root / f"stderr-{role}.txt").open("w") as err:
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env))
    try:
        _wait_ready(root, procs)
    except BaseException:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        raise
    return procs


def _kill_a_primary(servers, kind: str) -> tuple[float, float | None]:
    """SIGKILL a primary; (when, when its replica said it is primary: None if not within the bound)."""
    from promptstore.testing.redis_cluster import CLUSTER_SECONDS
    from promptstore.testing.redis_sentinel import FAILOVER_SECONDS

    if kind == "cluster":
        victim = servers.primaries()[0]
        replica = servers.replica_of(victim)
    else:
        victim = servers.primary()
        replica = next(s for s in servers.alive() if s is not victim)
    killed = time.time()
    victim.kill()
    deadline = now() + (CLUSTER_SECONDS if kind == "cluster" else FAILOVER_SECONDS)
    while now() < deadline:
        try:
            promoted = replica.client().info("replication")["role"] == "master"
            if promoted and (kind == "cluster" or servers.primary() is replica):  # the Sentinels name it too
                return killed, time.time()
        except Exception:  # noqa: BLE001 - a node busy electing, Sentinels mid-failover: ask again
            pass
        time.sleep(0.05)
    return killed, None


def _print_remote(args, result: dict, kind: str) -> None:
    final = result["final"]
    where = "a cluster of 3 primaries + 3 replicas" if kind == "cluster" else "a primary, its replica and 3 Sentinels"
    print(
        f"  {kind}: 2 processes x {args.remote_seconds:.0f} s on {where}, a primary "
        f"SIGKILLed at {result['killed_after_s']} s, its replica promoted {result['promoted_after_kill_s']} s later: "
        f"steps={result['steps']} fetches={result['fetches']} remote_hits={result['remote_hits']} "
        f"misses={result['misses']} (before the kill {result['misses_before_kill']}) "
        f"local_hits={result['local_hits']} wrong={result['wrong']} exceptions={result['exceptions']} "
        f"remote_errors={result['remote_errors']} publish_failed={result['publish_failed']}; hits resumed "
        f"{result['resumed_after_kill_s']} s after the kill ({result['misses_after_kill']} misses); a fresh store "
        f"then hits {final['hits']}/{final['checked']} published prompts ({final['lost']} lost, "
        f"{final['lost_near_kill']} of them near the kill), wrong={final['wrong']} ({result['seconds']} s)",
        flush=True,
    )


def _wait_ready(root: Path, procs) -> None:
    deadline = now() + 300
    while not all((root / f"ready-{role}").exists() for role in (0, 1)):
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead or now() > deadline:
            raise RuntimeError(f"a remote worker did not start (exit {dead}): see {root}/stderr-*.txt")
        time.sleep(0.05)


def _worker_result(root: Path, role: int, proc) -> dict:
    try:
        return json.loads((root / f"result-{role}.json").read_text())
    except (OSError, ValueError):
        err = (root / f"stderr-{role}.txt").read_text()[-1500:]
        return {"steps": 0, "exceptions": [f"worker exited {proc.returncode}: {err}"], "counts": {}}


def _resumed(after: list[dict]) -> tuple[int | None, float | None]:
    """(index of the first miss after the kill, when the first run of REMOTE_RUN remote hits after it began)."""
    first = next((k for k, e in enumerate(after) if not e["remote"]), None)
    if first is None:
        return None, None
    for k in range(first, len(after) - REMOTE_RUN + 1):
        if all(e["remote"] for e in after[k : k + REMOTE_RUN]):
            return first, after[k]["at"]
    return first, None


def _miss_reason(fetch: dict) -> str:
    """What the tier reported during a miss, else whether the prompt's publish had failed."""
    return ",".join(fetch["why"]) or ("not found" if fetch["published"] else "publish had failed")


def _remote_figures(events: list, results: list, go: float, killed: float, promoted: float | None) -> dict:
    fetches = sorted((e for e in events if e["ev"] == "fetch"), key=lambda e: e["at"])
    new, again = [e for e in fetches if e["kind"] == "new"], [e for e in fetches if e["kind"] == "again"]
    after = [e for e in new if e["at"] > killed]
    first, resumed = _resumed(after)
    counts = Counter()
    for r in results:
        counts.update(r["counts"])
    return {
        "steps": sum(r["steps"] for r in results),
        "fetches": len(fetches),
        "remote_hits": sum(e["remote"] for e in new),
        "misses": sum(not e["remote"] for e in new),
        "misses_before_kill": sum(not e["remote"] for e in new if e["at"] <= killed),
        "miss_reasons": dict(Counter(_miss_reason(e) for e in new if not e["remote"])),
        "local_hits": sum(e["length"] == e["want"] for e in again),
        "local_misses": sum(e["length"] != e["want"] for e in again),
        "wrong": sum(e["wrong"] for e in fetches),
        "exceptions": sum(len(r["exceptions"]) for r in results),
        "exception_kinds": dict(Counter(x[:200] for r in results for x in r["exceptions"])),
        "remote_errors": sum(counts[k] for k in REMOTE_ERRORS),
        "remote_error_kinds": {k: counts[k] for k in REMOTE_ERRORS if counts[k]},
        "blobs_published": counts["remote_published"],
        "publish_failed": _publish_failures(counts),
        "killed_after_s": round(killed - go, 2),
        "promoted_after_kill_s": round(promoted - killed, 2) if promoted else None,
        "first_miss_after_kill_s": round(after[first]["at"] - killed, 2) if first is not None else None,
        "resumed_after_kill_s": round(resumed - killed, 2) if resumed else (0.0 if first is None else None),
        "misses_after_kill": sum(not e["remote"] for e in after if resumed is None or e["at"] < resumed),
        "not_resumed": int(first is not None and resumed is None),
        "max_fetch_s": max((e["seconds"] for e in fetches), default=0.0),
    }


def _remote_final(args, url: str, root: Path, events: list, killed: float) -> dict:
    """A fresh store reads prompts the workers published (every one of the 3 s before
    the kill, a sample of the rest): a hit is checked; a miss is a write the killed
    primary had acknowledged and not yet replicated."""
    from promptstore import PromptStore

    published = [e for e in events if e["ev"] == "publish" and e["ok"]]
    near = [e for e in published if killed - 3 <= e["at"] <= killed]
    rest = [e for e in published if not killed - 3 <= e["at"] <= killed]
    chosen = near + random.Random(args.seed).sample(rest, min(len(rest), max(0, args.remote_final - len(near))))
    prefill = Prefill()
    out = Counter(wrong=0, lost=0, lost_near_kill=0)
    with PromptStore.open(root / "store-final", remote_url=url, **REMOTE_SETTINGS) as store:
        space = store.bind(prefill.model, model_id="soak")
        for e in chosen:
            prompt = remote_prompt(args.seed, e["role"], e["i"])
            hit = space.fetch(prompt)
            out["wrong"] += prefill.wrong(hit, prompt)
            lost = hit.length != len(prompt) - 8
            out["lost"] += lost
            out["lost_near_kill"] += lost and e in near
    return {"checked": len(chosen), "near_kill": len(near), "hits": len(chosen) - out["lost"], **dict(out)}


# --- hostile requests to a serving server --------------------------------------------------

HOSTILE_LOAD_THREADS = 3  # threads holding ordinary conversations while the hostile requests go in
HOSTILE_TIMEOUT_S = 30.0  # every request's; a refusal takes milliseconds, a reply well under a second
KILL_CONVERSATIONS = 3  # chats a serving process holds, turn after turn, when it is SIGKILLed
KILL_AFTER_S = 4.0  # the kill comes 4-8 s into the chats, then 0-3 s more: at no particular point of a turn


def hostile(args, work: Path) -> dict:
    import threading

    import httpx

    from promptstore.testing.hostile import MAX_BODY_BYTES, catalogue, send, shape_problem
    from promptstore.testing.model_dir import write_model_dir
    from tests.serve.conftest import QUESTIONS, SYSTEM, Server

    started = now()
    model = write_model_dir(work / "hostile-model", "llama")
    server = Server(model, work / "hostile-store", work / "hostile-server.log", "--max-body-bytes", str(MAX_BODY_BYTES))
    cases = catalogue()
    answers, wrong, dropped, ordinary, health = Counter(), Counter(), Counter(), Counter(), Counter()
    counting = threading.Lock()  # the load threads share `ordinary`
    wrong_examples: list[str] = []
    deadline = now() + args.hostile_seconds  # set again once the server serves

    def conversations(seed: int) -> None:
        # Ordinary multi-turn chats: each turn carries the conversation so far, as a client's would.
        rng = random.Random(seed)
        with httpx.Client(trust_env=False, timeout=HOSTILE_TIMEOUT_S) as http:
            while now() < deadline:
                messages = [{"role": "system", "content": SYSTEM}]
                for _ in range(rng.randint(1, 4)):
                    if now() >= deadline:
                        break
                    messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
                    body = {"model": "default_model", "messages": messages, "max_tokens": 8, "temperature": 0}
                    try:
                        r = http.post(server.url + "/v1/chat/completions", json=body)
                        reply = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
                    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                        reply, failure = None, f"failed: {type(e).__name__}"
                    else:
                        failure = f"failed: status {r.status_code}"
                    with counting:
                        ordinary["answered" if reply is not None else failure] += 1
                    if reply is None:
                        break
                    messages.append({"role": "assistant", "content": reply})

    def attacks() -> None:
        i = 0
        while now() < deadline:
            case = cases[i % len(cases)]
            i += 1
            try:
                status, body, _ = send(server.url, case, timeout=HOSTILE_TIMEOUT_S)
            except (httpx.HTTPError, OSError) as e:
                dropped[f"{case.name}: {type(e).__name__}"] += 1
                continue
            answers[status] += 1
            problem = None if case.expects(status) else f"status {status}, not {case.status}"
            if problem is None and status >= 400:
                problem = shape_problem(case.path, status, body, case.field)
            if problem is not None:
                wrong[case.name] += 1
                if len(wrong_examples) < 10 and wrong[case.name] == 1:
                    wrong_examples.append(f"{case.name}: {problem}"[:300])

    def health_checks() -> None:
        with httpx.Client(trust_env=False, timeout=5) as http:
            while now() < deadline:
                try:
                    status = http.get(server.url + "/health").status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                health["checks"] += 1
                if status != 200:
                    health[f"lost: {status}"] += 1
                time.sleep(0.5)

    threads = [threading.Thread(target=conversations, args=(args.seed + k,)) for k in range(HOSTILE_LOAD_THREADS)]
    threads += [threading.Thread(target=attacks), threading.Thread(target=health_checks)]
    try:
        server.start()
        deadline = now() + args.hostile_seconds
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.hostile_seconds + 2 * HOSTILE_TIMEOUT_S)
        stuck = sum(t.is_alive() for t in threads)
        try:
            exit_code = server.stop()
        except AssertionError as e:  # it ignored SIGTERM (and was killed)
            exit_code = str(e).splitlines()[0]
    finally:
        server.kill()
    result = {
        "load_threads": HOSTILE_LOAD_THREADS,
        "run_seconds": args.hostile_seconds,
        "hostile_requests": sum(answers.values()) + sum(dropped.values()),
        "answers_by_status": dict(sorted(answers.items())),
        "wrong_answers": sum(wrong.values()),
        "wrong_examples": wrong_examples,
        "dropped": sum(dropped.values()),
        "dropped_kinds": dict(dropped),
        "health_checks": health["checks"],
        "health_lost": sum(v for k, v in health.items() if k != "checks"),
        "health_kinds": {k: v for k, v in health.items() if k != "checks"},
        "ordinary_answered": ordinary["answered"],
        "ordinary_failed": sum(v for k, v in ordinary.items() if k != "answered"),
        "ordinary_failure_kinds": {k: v for k, v in ordinary.items() if k != "answered"},
        "threads_stuck": stuck,
        "stop_exit_code": exit_code,
        "seconds": round(now() - started, 1),
    }
    print(
        f"  hostile: {result['hostile_requests']} hostile requests ({len(cases)} cases round-robin) answered "
        f"{result['answers_by_status']}, wrong answers={result['wrong_answers']}, dropped={result['dropped']} | "
        f"health checks {result['health_checks']}, lost={result['health_lost']} | ordinary turns answered "
        f"{result['ordinary_answered']}, failed={result['ordinary_failed']} | threads stuck={stuck}, "
        f"exit {exit_code} ({result['seconds']} s)",
        flush=True,
    )
    for line in wrong_examples:
        print(f"    wrong: {line}")
    for k, v in {**dropped, **result["health_kinds"], **result["ordinary_failure_kinds"]}.items():
        print(f"    x{v}: {k}")
    return result


def _talk(client, convs: list, done: list, c: int, stop, rng) -> None:
    """Conversation c's turns, one after another, until `stop` or the server goes away."""
    from tests.serve.conftest import QUESTIONS

    while not stop.is_set():
        messages = convs[c] + [{"role": "user", "content": rng.choice(QUESTIONS)}]
        try:
            r = client.chat.completions.create(model="default_model", messages=messages, max_tokens=8, temperature=0)
        except Exception:  # the kill: this turn did not finish
            return
        convs[c] = messages + [{"role": "assistant", "content": r.choices[0].message.content or ""}]
        done[c] += 1


def kill_turns(args, work: Path) -> dict:
    import threading

    from promptstore.testing.model_dir import write_model_dir
    from tests.serve.conftest import QUESTIONS, SYSTEM, Server, rendered_length

    started = now()
    rng = random.Random(args.seed)
    model = write_model_dir(work / "kill-model", "llama")
    out: dict = {"trials_per_durability": args.kill_trials, "conversations": KILL_CONVERSATIONS, "durabilities": {}}
    for durability in args.kill_durability:
        finished = restored = 0
        trials = []
        for trial in range(args.kill_trials):
            root = work / f"kill-{durability}-{trial}"
            root.mkdir(parents=True, exist_ok=True)
            server = Server(model, root / "store", root / "server.log", "--durability", durability)
            convs = [
                [{"role": "system", "content": f"{SYSTEM} Conversation {c} of trial {trial}."}]
                for c in range(KILL_CONVERSATIONS)
            ]
            done = [0] * KILL_CONVERSATIONS  # turns each conversation finished before the kill
            stop = threading.Event()

            try:
                server.start()
                client = server.client()
                threads = [
                    threading.Thread(target=_talk, args=(client, convs, done, c, stop, rng))
                    for c in range(KILL_CONVERSATIONS)
                ]
                for t in threads:
                    t.start()
                time.sleep(rng.uniform(KILL_AFTER_S, 2 * KILL_AFTER_S))  # turns go on meanwhile
                time.sleep(rng.uniform(0, 3))
                server.proc.kill()  # SIGKILL, at no particular point of a turn
                server.proc.wait(timeout=60)
                stop.set()
                for t in threads:
                    t.join(timeout=60)
                server.start()
                client = server.client()
                kept = []
                for c, conv in enumerate(convs):
                    ask = conv + [{"role": "user", "content": QUESTIONS[0]}]
                    r = client.chat.completions.create(model="default_model", messages=ask, max_tokens=1, temperature=0)
                    cached = (r.usage.prompt_tokens_details.cached_tokens or 0) if r.usage.prompt_tokens_details else 0
                    # A finished turn counts as restored when its reply's end is within what the hit restored.
                    ends = [rendered_length(model, conv[: 1 + 2 * (k + 1)]) for k in range(done[c])]
                    kept.append(sum(1 for end in ends if end <= cached))
            finally:
                server.kill()
            finished += sum(done)
            restored += sum(kept)
            trials.append({"finished": list(done), "restored": kept})
            shutil.rmtree(root, ignore_errors=True)
        out["durabilities"][durability] = {
            "turns_finished": finished,
            "turns_restored": restored,
            "share_restored": round(restored / finished, 3) if finished else None,
            "trials": trials,
        }
        print(
            f"  kill_turns: {durability}: {restored} of {finished} finished turns restored after "
            f"{args.kill_trials} SIGKILLs",
            flush=True,
        )
    out["seconds"] = round(now() - started, 1)
    return out


# --- main ----------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    p.add_argument("--quick", action="store_true", help="a short run (about two minutes)")
    p.add_argument(
        "--only",
        default="crash,fuzz,concurrency,compact_crash,index_damage,memory,remote,sentinel,hostile,kill_turns",
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
