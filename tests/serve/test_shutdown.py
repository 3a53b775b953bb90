"""A SIGTERM right after a round's replies: every insert still waiting runs on
the generation thread before the store closes, the closing line counts them,
and after a restart every conversation's next turn restores its last reply."""

import re
import signal
import threading
import time
from typing import get_args

import pytest

from promptstore.config import Settings

from .conftest import DEFAULT, DURABILITIES, QUESTIONS, SYSTEM, chat, durability_args, least_restored, store_problems


def test_every_durability_is_tested():
    """The shutdown, restart and SIGKILL tests run under DURABILITIES: a durability
    added to the settings and not to them fails here."""
    assert set(DURABILITIES) - {DEFAULT} == set(get_args(Settings.model_fields["durability"].annotation))


CONVERSATIONS = 4
SYSTEMS = [f"{SYSTEM} You are assistant number {i}, and you sign every answer with your number." for i in range(4)]


def _round(client, conversations: list[list[dict]]) -> list[tuple[str, list[int]]]:
    """One turn of every conversation at once; returns the replies' texts and token ids."""
    replies: list[tuple[str, list[int]] | None] = [None] * len(conversations)
    errors = []

    def talk(i: int) -> None:
        try:
            replies[i] = chat(client, conversations[i], max_tokens=8)[:2]
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(r is not None for r in replies), errors
    return replies


def _closing(log: str) -> tuple[int, int]:
    """(inserts waiting at the signal, inserts the closing line says were stored)."""
    waiting = re.findall(r"shutdown: (\d+) inserts waiting", log)
    closed = [line for line in log.splitlines() if "store closed:" in line]
    assert waiting and closed, log[-3000:]
    stored = re.search(r"(\d+) waiting inserts stored", closed[-1])
    assert "not stored" not in closed[-1] and "everything is on disk" in closed[-1], closed[-1]
    return int(waiting[-1]), int(stored.group(1)) if stored else 0


def sigterm_after_a_round(serve, model, store, durability: str, rounds: int = 1) -> None:
    """`rounds` turns of every conversation, a SIGTERM within a millisecond of the
    last replies, a restart: every conversation's next turn restores all it sent,
    its last reply included (but the end-of-turn tokens after a reply that comes
    back as generated: `least_restored`; a single turn is a conversation too)."""
    server = serve(model, *durability_args(durability), store=store)
    client = server.client()
    conversations = [
        [{"role": "system", "content": s}, {"role": "user", "content": QUESTIONS[i]}] for i, s in enumerate(SYSTEMS)
    ]
    for r in range(rounds - 1):
        for i, (reply, _) in enumerate(_round(client, conversations)):
            conversations[i] += [{"role": "assistant", "content": reply}, {"role": "user", "content": QUESTIONS[r]}]
    replies = _round(client, conversations)
    server.proc.send_signal(signal.SIGTERM)  # within a millisecond of the last reply
    signalled = time.monotonic()
    assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
    waiting, stored = _closing(server.log())
    assert stored == waiting, server.log()[-3000:]
    assert "There is no Stream" not in server.log() and "not stored" not in server.log()
    assert time.monotonic() - signalled < 30

    previous = []
    for i, (reply, ids) in enumerate(replies):
        previous.append(least_restored(model, conversations[i], ids, reply))
        conversations[i] += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": QUESTIONS[(i + 1) % 4]},
        ]
    server = serve(model, *durability_args(durability), store=store)
    restored = [chat(server.client(), c, max_tokens=2)[2] for c in conversations]
    assert all(r >= p for r, p in zip(restored, previous)), (restored, previous)
    assert server.stop() == 0
    assert store_problems(store) == {}


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_sigterm_right_after_the_first_replies_keeps_every_reply(serve, model_dir, tmp_path, durability):
    sigterm_after_a_round(serve, model_dir("llama"), tmp_path / "store", durability)


@pytest.mark.parametrize("durability", ["admit", DEFAULT])
def test_a_sigterm_after_later_rounds_keeps_every_reply(serve, model_dir, tmp_path, durability):
    """Later turns go on from reused nodes, and a reply's rendering may split the
    prompt's last node: each part is still written at the stop."""
    sigterm_after_a_round(serve, model_dir("llama"), tmp_path / "store", durability, rounds=3)


@pytest.mark.slow
@pytest.mark.parametrize("durability", DURABILITIES)
def test_twenty_sigterms_in_a_row_keep_every_reply(serve, model_dir, tmp_path, durability):
    for run in range(20):
        sigterm_after_a_round(serve, model_dir("llama"), tmp_path / f"store{run}", durability, rounds=1 + run % 2)
