"""A server whose store's disk fills up: it goes on serving, says `degraded` on
/health, counts what the disk refused on /metrics and says so in a few log
lines, and a conversation it had stored before is whole after a restart, even
when a new conversation split its nodes while the disk refused every write."""

from __future__ import annotations

import re
import time

import httpx

from promptstore.snapshots.disk_health import SAID

from .conftest import QUESTIONS, SYSTEM, chat, reference_reply, rendered_length, store_problems

HEALTH_DEADLINE_S = 60.0


def health(server) -> dict:
    with httpx.Client(trust_env=False, timeout=10) as http:
        r = http.get(server.url + "/health")
    assert r.status_code == 200, r.text  # degraded still serves
    return r.json()


def metric(server, name: str) -> float:
    with httpx.Client(trust_env=False, timeout=10) as http:
        text = http.get(server.url + "/metrics").text
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def talk(server, conversation: list[dict], turns: int) -> list[dict]:
    for i in range(turns):
        text, _, _ = chat(server.client(), conversation)
        conversation = [*conversation, {"role": "assistant", "content": text}]
        conversation.append({"role": "user", "content": QUESTIONS[(i + 1) % len(QUESTIONS)]})
    return conversation


def test_a_full_disk_degrades_the_server_and_costs_no_stored_conversation(serve, model_dir, small_disk):
    model = model_dir("llama")
    disk = small_disk(16 << 20)
    store = disk.path / "store"
    options = ("--warm-start", "false", "--admit-idle-seconds", "0.5")  # the default durability, admit

    server = serve(model, *options, store=store)
    first = talk(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}], 2)
    assert server.stop() == 0
    assert "everything is on disk" in server.log()
    stored = rendered_length(model, first[:-1])  # all the first conversation sent and was answered

    disk.fill(leave=64 << 10)  # what is left takes the index's pages, no conversation's files
    server = serve(model, *options, store=store)
    assert health(server)["status"] == "ok"
    others = [
        talk(server, [{"role": "system", "content": f"{SYSTEM} You are desk {i}."}, {"role": "user", "content": q}], 2)
        for i, q in enumerate(QUESTIONS[1:])
    ]
    # Shares the first conversation's system prompt: its node, on disk, is split.
    talk(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[3]}], 2)
    deadline = time.monotonic() + HEALTH_DEADLINE_S
    while (said := health(server))["status"] != "degraded":
        assert time.monotonic() < deadline, said
        time.sleep(0.2)
    # What the system said (a write LMDB could not finish on a full disk is an I/O error to it).
    assert any(words in said["reason"] for words in SAID), said
    assert set(said["disk"]) == {"unwritten_nodes", "unwritten_bytes"}  # without --api-keys: the figures
    assert metric(server, "promptstore_disk_refused_writes_total") > 0
    assert metric(server, "promptstore_disk_refusing") == 1
    _, ids, _ = chat(server.client(), others[0])  # it still serves
    assert ids == reference_reply(model, others[0], 12)
    assert server.stop() == 0
    log = server.log()
    refusals = [line for line in log.splitlines() if "disk" in line and ("WARNING" in line or "ERROR" in line)]
    # One when it began (and one more each time it took a write again and refused anew), the closing line's count.
    assert 1 <= len(refusals) <= 6, refusals
    assert "miss (disk)" not in log and "Traceback" not in log

    server = serve(model, *options, store=store)  # the disk still full
    _, ids, cached = chat(server.client(), first)
    assert cached >= stored  # whole: both parts of the split node read from its old file
    assert ids == reference_reply(model, first, 12)
    assert server.stop() == 0

    disk.free()
    assert {k: v for k, v in store_problems(store, clean_close=False).items()} == {}
