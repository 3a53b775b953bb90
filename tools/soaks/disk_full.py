"""The soak's disk_full section: a `promptstore serve` whose store's disk fills up.

Conversations the server stored are kept (a SIGTERM writes them); the disk is
then filled with a ballast file, and chats go on for a while: new ones, ones
that share a kept conversation's system prompt (their inserts split its stored
nodes) and kept ones that go on. A restart on the still-full disk then asks
each kept conversation for its next turn: what it had stored must be restored
whole [lost: 0], every reply must equal a full prefill's [wrong: 0], and once
the disk has room again compact --verify finds nothing wrong [problems: 0].
The store sits on a tmpfs mounted here: without the right to mount one the
section is skipped, saying why.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from pathlib import Path

DISK_BYTES = 24 << 20
LEFT_FOR_THE_INDEX = 256 << 10  # the ballast leaves this: the index commits for a while, files soon fail
KEPT = 4  # conversations stored before the disk fills
THREADS = 3


def disk_full(args, work: Path) -> dict:
    from promptstore.testing.model_dir import write_model_dir
    from promptstore.testing.small_disk import SmallDisk, SmallDiskUnavailable
    from tests.serve.conftest import QUESTIONS, SYSTEM, Server, chat, reference_reply, rendered_length, store_problems

    started = time.monotonic()
    try:
        disk = SmallDisk(work / "disk-full", DISK_BYTES)
    except SmallDiskUnavailable as e:
        print(f"  disk_full: skipped: {e}", flush=True)
        return {"skipped": str(e)}
    rng = random.Random(args.seed)
    model = write_model_dir(work / "disk-full-model", "llama")
    store, logs = disk.path / "store", work / "disk-full-logs"
    logs.mkdir(parents=True, exist_ok=True)
    systems = [f"{SYSTEM} You keep the shelf of row {i}." for i in range(KEPT)]
    wrong: list[str] = []

    def turn(server, conversation: list[dict]) -> list[dict]:
        text, ids, _ = chat(server.client(), conversation)
        if ids != reference_reply(model, conversation, 12):
            wrong.append(conversation[-1]["content"])
        return [
            *conversation,
            {"role": "assistant", "content": text},
            {"role": "user", "content": rng.choice(QUESTIONS)},
        ]

    try:
        server = Server(model, store, logs / "before.log").start()
        kept = [
            [{"role": "system", "content": s}, {"role": "user", "content": QUESTIONS[i]}] for i, s in enumerate(systems)
        ]
        for _ in range(2):
            kept = [turn(server, c) for c in kept]
        stopped = server.stop()
        stored = [rendered_length(model, c[:-1]) for c in kept]

        disk.fill(leave=LEFT_FOR_THE_INDEX)
        server = Server(model, store, logs / "full.log").start()
        degraded, turns, failed, stop = [], [0], [], threading.Event()

        def talk(seed: int) -> None:
            mine = random.Random(seed)
            while not stop.is_set():
                system = mine.choice([*systems, f"{SYSTEM} Desk {seed}-{turns[0]}."])  # a kept prefix, or new
                conversation = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": mine.choice(QUESTIONS)},
                ]
                for _ in range(mine.randint(1, 3)):
                    if stop.is_set():
                        return
                    try:
                        conversation = turn(server, conversation)
                    except Exception as e:  # counted: a full disk must not fail a request
                        failed.append(repr(e)[:200])
                        break
                    turns[0] += 1

        threads = [threading.Thread(target=talk, args=(args.seed * 100 + t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + args.disk_full_seconds
        while time.monotonic() < deadline:
            degraded.append(server.health_body().get("status") == "degraded")
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        full_log_stopped = server.stop()
        log = server.log()
        refusal_lines = sum(1 for line in log.splitlines() if " WARNING - the disk " in line)
        tracebacks = log.count("Traceback")

        server = Server(model, store, logs / "after.log").start()  # the disk still full
        lost = 0
        for conversation, length in zip(kept, stored):
            _, ids, cached = chat(server.client(), conversation)
            lost += cached < length
            if ids != reference_reply(model, conversation, 12):
                wrong.append(conversation[-1]["content"])
        after_stopped = server.stop()
        disk.free()
        problems = store_problems(store, clean_close=False)
    finally:
        disk.close()
        shutil.rmtree(work / "disk-full-model", ignore_errors=True)
    out = {
        "seconds_full": args.disk_full_seconds,
        "turns_while_full": turns[0],
        "kept_conversations": KEPT,
        "lost": lost,
        "wrong_replies": len(wrong),
        "failed_turns": len(failed),
        "failures": failed[:5],
        "degraded_seen": any(degraded),
        "refusal_log_lines": refusal_lines,
        "tracebacks": tracebacks,
        "exit_codes": [stopped, full_log_stopped, after_stopped],
        "compact_problems": len(problems),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(
        f"  disk_full: {turns[0]} turns on a full disk over {args.disk_full_seconds:.0f} s "
        f"(degraded seen: {out['degraded_seen']}, {refusal_lines} refusal lines); after a restart "
        f"{KEPT - lost} of {KEPT} stored conversations whole, {len(wrong)} wrong replies, "
        f"{len(problems)} problems for compact --verify",
        flush=True,
    )
    return out
