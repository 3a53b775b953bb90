"""The soak's fuzz section: a copy of a built store damaged once per case (snapshot
files and LMDB values), then opened, probed, compacted and probed again."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path

from .common import TOL, Budget, now, print_tallies, signature


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
            for r in store.reports:
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
