"""The soak's kill_turns section: what a SIGKILL costs per durability, a `promptstore
serve` holding chats SIGKILLed at a random instant and started again on its store."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

from .common import now

KILL_CONVERSATIONS = 3  # chats a serving process holds, turn after turn, when it is SIGKILLed
KILL_AFTER_S = 4.0  # the kill comes 4-8 s into the chats, then 0-3 s more: at no particular point of a turn


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
