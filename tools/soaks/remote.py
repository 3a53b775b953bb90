"""The soak's remote and sentinel sections: the shared tier on a Redis Cluster, or on
a primary that three Sentinels watch, shared by two processes (RemoteWorker, run
as `tools/soak.py --remote-worker SPEC`) while a primary is SIGKILLed; then a
fresh store reads what was published."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

from .common import REPO, TOL, now, signature

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
        self.counts = self.store.remote.counts

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
        cmd = [sys.executable, str(REPO / "tools" / "soak.py"), "--remote-worker", spec]
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
