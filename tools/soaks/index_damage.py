"""The soak's index_damage section: one bit flipped in index/data.mdb at a record
a lookup reads, or data.mdb truncated; then opened, probed, compacted, probed."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path

from .common import now, print_tallies, signature
from .fuzz import FuzzStore


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
