"""What each durability writes to disk, against what is read back: SSD wear.

An agent workload, through the library's insert and spill path (what
`promptstore serve` calls per request: a fetch, the prompt's prefill and insert,
then the reply as the next turn renders it): one tool-using session of 100
turns growing to about 60k tokens, beside 20 one-off requests never continued
(one every five turns; half share the session's system prompt). A simulated
clock (tiers.clock) gives the turns ten seconds each and the user a ten-minute
pause at turn 50, so the admit durability's idle writes run as they would.

Per durability (write_through, write_back, sync, admit):
  - bytes written: node files (the store's counter) and the process's
    write_bytes (/proc/self/io: files, index and all);
  - what a SIGKILL at the end of the session leaves: a second process opens the
    store (after queued writes finish) and restores the session; the share of
    its turns restored;
  - a close, a reopen (a SIGTERM and restart) and the next turn: its time to
    first token and restore time against write_through's, and the bytes of
    state that turn read back from disk (write amplification = bytes written
    over them);
  - bytes of one-off requests on disk after the close.

Run: python tools/bench/bench_wear.py [--tokens 12000] [--out bench-results/wear.json]
(the session's 60k tokens are scaled to 12k by default on a CPU: --tokens 60000 for all).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from common import blas_info, print_goals, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from promptstore import PromptStore  # noqa: E402
from promptstore.testing.models import DEMO_LLAMA, tiny_model  # noqa: E402

POLICIES = ("write_through", "write_back", "sync", "admit")
# The demo's llama (bench_serve's cpu profile), float32 on CPU: 4 KiB of KV per token.
MODEL = dict(DEMO_LLAMA, vocab_size=1024, max_position_embeddings=131072)
TURNS, ONE_OFFS = 100, 20
# The workload's 60k tokens, scaled to 12k: on 2 CPU cores each turn's restore and
# insert of a 30k-token session took over a minute per 20 turns (the default run
# stays within about 10 minutes). Bytes scale with tokens; the ratios are the figures.
FULL_TOKENS, DEFAULT_TOKENS = 60000, 12000
TURN_SECONDS, PAUSE_AT, PAUSE_SECONDS = 10.0, 50, 600.0


class Clock:
    def __init__(self):
        self.now = 1e6

    def __call__(self) -> float:
        return self.now


def workload(tokens: int) -> dict:
    """The session's turns (prompt end, reply end) over one token array, and the one-offs."""
    rng = np.random.default_rng(7)
    system = max(256, tokens // 30)
    per_turn = (tokens - system) // TURNS
    reply = max(4, per_turn // 8)
    session = rng.integers(0, MODEL["vocab_size"], system + per_turn * TURNS + 64).astype(np.int32)
    turns, end = [], system
    for _ in range(TURNS):
        prompt = end + per_turn - reply  # history, then a tool's output and the turn's header
        turns.append((prompt, prompt + reply))  # the reply, as the next turn renders it
        end = prompt + reply
    one_offs = []
    for i in range(ONE_OFFS):
        n = int(rng.integers(tokens // 60, tokens // 20))
        own = rng.integers(0, MODEL["vocab_size"], n + reply).astype(np.int32)
        shares = i % 2 == 0  # half start with the session's system prompt
        one_offs.append(np.concatenate([session[:system], own]) if shares else own)
    return {"system": system, "session": session, "turns": turns, "one_offs": one_offs, "reply": reply}


def request(space, model, tokens: np.ndarray, prompt_end: int, reply_end: int) -> float:
    """One request: fetch, prefill the prompt, insert it, the reply, insert that; seconds to first token."""
    started = time.perf_counter()
    hit = space.fetch(tokens[:prompt_end])
    logits = model(mx.array(tokens[hit.length : prompt_end])[None], cache=hit.cache)[:, -1, :]
    mx.eval(logits)
    ttft = time.perf_counter() - started
    space.insert(tokens[:prompt_end], hit.cache)
    mx.eval(model(mx.array(tokens[prompt_end:reply_end])[None], cache=hit.cache))
    space.insert(tokens[:reply_end], hit.cache)
    return ttft


def io_written() -> int:
    """This process's write_bytes (/proc/self/io); 0 where there is none."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_policy(policy: str, model, work: dict, root: Path, tokens: int) -> dict:
    path = root / policy
    io0 = io_written()
    store = PromptStore.open(path, durability=policy, warm_start=False)
    clock = Clock()
    store.clock = clock
    space = store.bind(model, model_id="bench-wear")
    session, turns = work["session"], work["turns"]
    started = time.perf_counter()
    for i, (prompt_end, reply_end) in enumerate(turns):
        request(space, model, session, prompt_end, reply_end)
        if i % 5 == 4:
            one_off = work["one_offs"][i // 5]
            request(space, model, one_off, len(one_off) - work["reply"], len(one_off))
        clock.now += PAUSE_SECONDS if i + 1 == PAUSE_AT else TURN_SECONDS
        store.write_due()  # the admission thread's look, at the simulated time
    session_seconds = time.perf_counter() - started
    store.flush()
    killed = probe(path, tokens)  # what a SIGKILL now leaves on disk
    store.close()
    during = store.tiers.metrics(hot_budget_bytes=0, stored_nodes=0, stored_bytes=0, disk_budget_bytes=0)
    io_bytes = io_written() - io0
    restart = restart_turn(path, model, work)
    turns_restored = sum(1 for _, end in turns if end <= killed)
    return {
        "session_seconds": round(session_seconds, 2),
        "bytes_written": during.disk_written_bytes,
        "process_write_bytes": io_bytes,
        "files_written": during.files_written,
        "admitted": during.admitted,
        "declined_nodes": during.declined_nodes,
        "one_off_bytes_written": one_off_bytes(path, model, work),
        "bytes_read_back": restart["read_back_bytes"],
        "write_amplification": round(during.disk_written_bytes / max(restart["read_back_bytes"], 1), 3),
        "sigkill_restored_tokens": killed,
        "sigkill_turns_restored": turns_restored,
        "sigkill_turns_restored_share": turns_restored / len(turns),
        "restart_ttft_s": restart["ttft_s"],
        "restart_restore_s": restart["restore_s"],
        "restart_hit_tokens": restart["hit"],
    }


def restart_turn(path: Path, model, work: dict, runs: int = 3) -> dict:
    """Reopen (no warm start: the hit is read from disk) and run the session's next
    turn, `runs` times (the median; the bytes read back are the first's)."""
    done = [restart_once(path, model, work) for _ in range(runs)]
    first = done[0]
    return dict(
        first,
        ttft_s=float(np.median([d["ttft_s"] for d in done])),
        restore_s=float(np.median([d["restore_s"] for d in done])),
    )


def restart_once(path: Path, model, work: dict) -> dict:
    session = work["session"]
    last = work["turns"][-1][1]
    with PromptStore.open(path, durability="write_back", warm_start=False) as store:
        space = store.bind(model, model_id="bench-wear")
        started = time.perf_counter()
        hit = space.fetch(session[: last + 64])
        logits = model(mx.array(session[hit.length : last + 64])[None], cache=hit.cache)[:, -1, :]
        mx.eval(logits)
        ttft = time.perf_counter() - started
        read = store.metrics().read_back_bytes
    return {"ttft_s": ttft, "restore_s": hit.seconds, "hit": hit.length, "read_back_bytes": read}


def one_off_bytes(path: Path, model, work: dict) -> int:
    """Bytes of files on disk of nodes not on the session's path (the one-offs')."""
    with PromptStore.open(path, durability="write_back", warm_start=False) as store:
        space = store.bind(model, model_id="bench-wear")
        ns = space.namespace
        session_keys = {n.key for n in store.index.lookup(ns, work["session"]).path}
        return sum(
            n.record.nbytes
            for n in store.index.iter_nodes(ns)
            if n.key not in session_keys and (node := store.index.get(n.key)) and node.record.file
        )


def probe(path: Path, tokens: int) -> int:
    """Tokens of the session another process restores from what is on disk now."""
    cmd = [sys.executable, __file__, "--probe", str(path), "--tokens", str(tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def run_probe(path: str, tokens: int) -> None:
    model = tiny_model("llama", **MODEL)
    work = workload(tokens)
    with PromptStore.open(path, durability="write_back", warm_start=False) as store:
        print(store.bind(model, model_id="bench-wear").fetch(work["session"]).length)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens the session grows to (default {DEFAULT_TOKENS})"
    )
    p.add_argument("--out", default="bench-results/wear.json")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        run_probe(args.probe, args.tokens)
        return 0
    blas = blas_info()
    model = tiny_model("llama", **MODEL)
    work = workload(args.tokens)
    root = Path(tempfile.mkdtemp(prefix="bench-wear-"))
    try:
        results = {}
        for policy in POLICIES:
            results[policy] = run_policy(policy, model, work, root, args.tokens)
            print(f"{policy}: {json.dumps(results[policy])}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = results["write_through"]
    for r in results.values():
        r["restart_ttft_vs_write_through"] = round(r["restart_ttft_s"] / base["restart_ttft_s"], 3)
        r["bytes_written_vs_write_through"] = round(r["bytes_written"] / max(base["bytes_written"], 1), 3)
    report(results, work, args)
    payload = {
        "workload": {
            "session_tokens": work["turns"][-1][1],
            "turns": TURNS,
            "one_offs": ONE_OFFS,
            "one_off_tokens": [len(o) for o in work["one_offs"]],
            "system_tokens": work["system"],
            "scaled_from_tokens": FULL_TOKENS if args.tokens != FULL_TOKENS else None,
            "model": "the demo's llama (4 layers, hidden 256, 4 KiB of KV per token), float32, CPU",
            "clock": f"simulated: {TURN_SECONDS:.0f} s a turn, a {PAUSE_SECONDS:.0f} s pause at turn {PAUSE_AT}",
            "sigkill": "a second process restores the session from disk after the last turn's queued writes",
            "restart": "close, reopen without a warm start, next turn (64 new tokens): time to first token",
        },
        "policies": results,
    }
    print(f"wrote {write_results(args.out, payload, blas)}")
    return 0


def report(results: dict, work: dict, args) -> None:
    scaled = "" if args.tokens == FULL_TOKENS else f" (scaled from {FULL_TOKENS}: --tokens {args.tokens})"
    print(f"\nsession of {TURNS} turns to {work['turns'][-1][1]} tokens{scaled}, {ONE_OFFS} one-off requests")
    head = f"{'policy':14} {'written MB':>10} {'proc MB':>8} {'read MB':>8} {'WA':>6} {'one-off MB':>10}"
    print(head + f" {'kill turns':>10} {'restart x':>9}")
    for name, r in results.items():
        print(
            f"{name:14} {r['bytes_written'] / 1e6:10.1f} {r['process_write_bytes'] / 1e6:8.1f} "
            f"{r['bytes_read_back'] / 1e6:8.1f} {r['write_amplification']:6.2f} "
            f"{r['one_off_bytes_written'] / 1e6:10.1f} {r['sigkill_turns_restored']:10d} "
            f"{r['restart_ttft_vs_write_through']:9.2f}"
        )
    a = results["admit"]
    print("\nadmit against the goals:")
    print_goals(
        [
            ("bytes written / bytes read back", a["write_amplification"], "<= 1.2"),
            ("write_through's bytes / admit's", 1 / max(a["bytes_written_vs_write_through"], 1e-9), ">= 3"),
            ("one-off bytes written (MB)", a["one_off_bytes_written"] / 1e6, "0"),
            ("restart TTFT / write_through's", a["restart_ttft_vs_write_through"], "<= 1.05"),
            ("turns restored after a SIGKILL", a["sigkill_turns_restored_share"], "(figure)"),
        ]
    )


if __name__ == "__main__":
    os.environ.setdefault("PROMPTSTORE_COLD_PLAN", "load")  # a restart reads the hit, as each policy left it
    sys.exit(main())
