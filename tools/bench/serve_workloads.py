"""The workloads bench_serve.py runs: their conversations, the rounds every
server answers in turn, and what a server's log says about each round.

- chat (and chat-8, chat-16, chat-32: the same with 8, 16 and 32 users):
  rounds of every user at once, then every server killed by SIGKILL and
  started again, the next round timed, one more; then the same after a SIGTERM.
- pressure: conversations visited round-robin, one request at a time.
- single: one conversation alone, several rounds.

A workload function gets a Run (the servers and what they answered) and its
sizes; the chat workloads get `restart(how)` from bench_serve.py too.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from serve_peers import PROMPTSTORE, REQUEST_TIMEOUT_S, VLLM_MLX, Server, ask, promptstore_log, vllm_log

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from promptstore.testing.round_trip import render  # noqa: E402
from promptstore.testing.tokenizer import CORPUS, demo_tokenizer  # noqa: E402

VOCAB = 1024
CHAT_USERS = (8, 16, 32)  # chat-8, chat-16, chat-32: the chat workload with that many users
QUESTIONS = [
    "What does the passage above say about the harbour?",
    "Summarise the last answer in one sentence.",
    "Which book would you recommend to a beginner, and why?",
    "What happens on the weekend in the town?",
    "Can you explain the tides in simpler words?",
    "What should a visitor see first?",
]
# Between two rounds of a server that runs alone (--one-at-a-time), its users read
# the answers: side by side, the other servers' rounds stand there (seconds).
READ_S = 2.0


def kind(workload: str) -> str:
    """What a workload runs: chat-8 is the chat workload with 8 users."""
    return "chat" if workload.startswith("chat-") else workload


def text_of(tokens: int, start: int) -> str:
    """Corpus text of about `tokens` tokens, from paragraph `start` on."""
    tok = demo_tokenizer(VOCAB)
    paragraphs = [p for p in CORPUS.read_text().splitlines() if p.strip()]
    words: list[str] = []
    k = start
    while len(tok.encode(" ".join(words))) < tokens:
        words += paragraphs[k % len(paragraphs)].split()
        k += 7
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest words reaching `tokens`
        mid = (lo + hi) // 2
        if len(tok.encode(" ".join(words[:mid]))) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


class Run:
    """One run of one workload: the servers, their conversations and what they answered."""

    def __init__(self, servers: dict[str, Server]):
        self.servers = servers
        self.rows: list[dict] = []  # one per request: server, round, user, ttft_s, reply, messages...
        self.rounds: list[str] = []
        self.round_diagnostics: dict[str, dict[str, dict]] = {}
        self.turn = 0  # rotates who goes first
        self.read_to: dict[str, int] = {}  # where each server's log was last read (its reply lines count from there)

    def order(self) -> list[str]:
        names = list(self.servers)
        k = self.turn % len(names)
        self.turn += 1
        return names[k:] + names[:k]

    def offset(self, name: str) -> int:
        log = self.servers[name].log
        return log.stat().st_size if log.exists() else 0

    def round(self, label: str, asks: dict[str, list[tuple[int, list[dict]]]], max_tokens: int, waves=None) -> None:
        """Every server in turn answers its requests of this round, at once
        (`waves`: lists of users sent one after the other)."""
        self.rounds.append(label)
        for name in self.order():
            server = self.servers[name]
            offset = self.offset(name)
            before = server.storage_reads() if "after" in label else {}
            health = server.health() if "after" in label else None
            answers = fire(server, asks[name], max_tokens, waves)
            by_user = dict(asks[name])
            for user, answer in answers.items():
                self.rows.append(dict(answer, server=name, round=label, user=user, messages=by_user[user]))
            diag = self.window(name, offset)
            if "after" in label:
                after = server.storage_reads()
                diag |= {"storage_reads": {k: after[k] - before.get(k, 0) for k in after}, "health_before": health}
            self.round_diagnostics.setdefault(label, {})[name] = diag
            p50 = statistics.median(a["ttft_s"] for a in answers.values()) * 1e3
            print(f"  {label}: {name} TTFT p50 {p50:,.0f} ms{round_said(diag)}", flush=True)
        if len(self.servers) == 1:
            time.sleep(READ_S)  # alone, no other server's round stands between two of its rounds

    def window(self, name: str, offset: int) -> dict:
        """What `name`'s log says about the requests since `offset`, and its reply
        stores since its log was last read: a reply is stored after its request
        is done, or when its conversation's next turn comes, so a round counts
        the stores logged while it ran and those logged after the last round was
        read (none left out, none counted twice). A restarted server's warm-up
        request (Server.start) may store its reply inside the next round too."""
        server = self.servers[name]
        since = min(self.read_to.get(name, offset), offset)
        data, self.read_to[name] = read_log(server, since)
        return log_window(server, lines_of(data[offset - since :])) | reply_window(server, lines_of(data))

    def settle(self) -> None:
        """Before a stop and at the end: reply lines logged since each server's
        last round was read count to that round; what a start logs after it (its
        warm-up request) counts to none."""
        for name, server in self.servers.items():
            if name not in self.read_to or not self.rounds:
                continue
            data, _ = read_log(server, self.read_to.pop(name))
            diag = self.round_diagnostics.get(self.rounds[-1], {}).get(name)
            if diag is not None:
                for k, v in reply_window(server, lines_of(data)).items():
                    diag[k] = diag.get(k, 0) + v


def fire(server: Server, asks: list[tuple[int, list[dict]]], max_tokens: int, waves=None) -> dict[int, dict]:
    """Send (user, messages) requests at once, in waves when given; answers by user."""
    client = server.client()
    out: dict[int, dict] = {}

    def one(user: int, messages: list[dict]) -> None:
        out[user] = ask(server, messages, max_tokens, client)

    by_user = dict(asks)
    for wave in waves or [list(by_user)]:
        threads = [threading.Thread(target=one, args=(u, by_user[u])) for u in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=REQUEST_TIMEOUT_S)
    if len(out) != len(by_user):
        print(f"{server.name}'s log, last lines:\n{server.log_tail()}", file=sys.stderr)
        raise RuntimeError(f"{server.name}: a request failed")
    return out


def round_said(diag: dict) -> str:
    """promptstore serve's round from its log, for the progress line (a run cut
    short still leaves it): restored share, tokens from disk and how, medians of
    the fetch and of the rest to the first token (of which mlx-lm's batch steps,
    and how many, and the handoff of the token put), and the forwards run to store
    replies (with the replies they stored) beside the replies stored with none,
    as logged since the server's previous round was read (Run.window)."""
    rows = diag.get("timelines")
    if not rows:
        return ""
    plans = Counter(r["plan"] for r in rows if r["plan"])
    how = f" ({', '.join(f'{k} x{n}' for k, n in plans.items())})" if plans else ""
    share = diag["restored_share"]
    said = f"; restored {'-' if share is None else f'{share:.0%}'}, {diag['from_disk_tokens']:,} tokens from disk{how}"
    for phase in ("fetch_ms", "prefill_first_ms", "steps_ms", "out_ms"):
        values = [r[phase] for r in rows if phase in r]
        if values:
            said += f", {phase[:-3]} {statistics.median(values):,.0f} ms"
        if phase == "steps_ms" and (counts := [r["steps"] for r in rows if "steps" in r]):
            said += f" ({statistics.median(counts):g} steps)"
    if "reply_forwards" in diag:
        said += (
            f"; reply forwards {diag['reply_forwards']} ({diag['replies_by_forwards']} replies), "
            f"{diag['replies_without_forward']} stored without one"
        )
    return said


def read_log(server: Server, start: int) -> tuple[bytes, int]:
    """`server`'s log from byte `start` to its last whole line, and where that ends."""
    if not server.log.exists():
        return b"", start
    with open(server.log, "rb") as f:
        f.seek(start)
        data = f.read()
    cut = data.rfind(b"\n") + 1  # a line still being written waits for the next read
    return data[:cut], start + cut


def lines_of(data: bytes) -> list[str]:
    return data.decode(errors="replace").splitlines()


def log_window(server: Server, lines: list[str]) -> dict:
    """What the server's log lines say about its requests."""
    if server.name == PROMPTSTORE:
        rows = promptstore_log(lines)["timelines"]
        restored = [r["restored"] / r["prompt"] for r in rows if r["prompt"]]
        return {
            "restored_share": statistics.mean(restored) if restored else None,
            "from_disk_tokens": sum(r["from_disk"] for r in rows),
            "timelines": rows,
        }
    if server.name == VLLM_MLX:
        d = vllm_log(lines)
        rows = d["fetches"]
        return {
            "restored_share": statistics.mean(r["cached"] / r["prompt"] for r in rows) if rows else None,
            "ssd_promotions": len(d["ssd_promotions"]),
        }
    return {}


def reply_window(server: Server, lines: list[str]) -> dict:
    """promptstore serve's reply stores in these lines: the forwards run (sum of
    n), the replies and tokens they stored and their milliseconds, and the
    replies stored without a forward (their tokens round-trip). Zeros where the
    server logs none of these lines."""
    if server.name != PROMPTSTORE:
        return {}
    d = promptstore_log(lines)
    forwards, without = d["reply_forwards"], d["replies_without_forward"]
    return {
        "reply_forwards": sum(f["n"] for f in forwards),
        "replies_by_forwards": sum(f["replies"] for f in forwards),
        "reply_forward_tokens": sum(f["tokens"] for f in forwards),
        "reply_forward_ms": round(sum(f["ms"] for f in forwards), 1),
        "replies_without_forward": len(without),
        "replies_without_forward_tokens": sum(without),
    }


def round_trips(tokenizer, messages: list[dict], answer: dict) -> bool:
    """Whether the reply comes back as the tokens generated: the next turn's
    rendering holds the prompt, then as many tokens as the reply's completion
    tokens, then the template's end of turn (what it renders for an empty reply)."""
    n = answer.get("completion_tokens")
    if n is None:
        return False
    prompt = render(tokenizer, messages, add_generation_prompt=True)
    again = render(tokenizer, [*messages, {"role": "assistant", "content": answer["reply"]}])
    end = render(tokenizer, [*messages, {"role": "assistant", "content": ""}])[len(prompt) :]
    return (
        again[: len(prompt)] == prompt and again[len(prompt) + n :] == end and len(again) == len(prompt) + n + len(end)
    )


# ---- the workloads ---------------------------------------------------------------


def chat(run: Run, w: dict, restart) -> None:
    """Rounds of every user at once, then a SIGKILL restart and a SIGTERM restart."""
    system = text_of(w["system_tokens"], 0)
    own = [text_of(w["context_tokens"], 11 * (u + 1)) for u in range(w["users"])]
    first = [[{"role": "system", "content": system + "\n\n" + text}] for text in own]
    convs = {name: [list(f) for f in first] for name in run.servers}
    for n in range(1, w["rounds"] + 5):
        # The SIGKILL first: no server has saved anything at a stop before it (a
        # server that saves only at SIGTERM would otherwise restore that save).
        if n == w["rounds"] + 1:
            restart("SIGKILL")
        if n == w["rounds"] + 3:
            restart("SIGTERM")
        label = f"round {n}" + {w["rounds"] + 1: ", after SIGKILL", w["rounds"] + 3: ", after SIGTERM"}.get(n, "")
        question = {"role": "user", "content": QUESTIONS[(n - 1) % len(QUESTIONS)]}
        asks = {name: [(u, c + [question]) for u, c in enumerate(cs)] for name, cs in convs.items()}
        # The first round opens with one user alone, so every server holds the
        # shared system prompt when the others arrive, as a server in use would.
        waves = [[0], list(range(1, w["users"]))] if n == 1 else None
        run.round(label, asks, w["answer_tokens"], waves)
        for name, cs in convs.items():
            for u, c in enumerate(cs):
                reply = answer_of(run, name, label, u)
                cs[u] = c + [question, {"role": "assistant", "content": reply}]


def pressure(run: Run, w: dict) -> None:
    """Conversations visited round-robin, one request at a time."""
    convs = {
        name: [
            [{"role": "system", "content": text_of(w["context_tokens"], 13 * c + 3)}] for c in range(w["conversations"])
        ]
        for name in run.servers
    }
    for p in range(1, w["passes"] + 1):
        label = f"pass {p}" + (" (first visits)" if p == 1 else " (returning)")
        run.rounds.append(label)
        offsets = {name: run.offset(name) for name in run.servers}
        for c in range(w["conversations"]):
            question = {"role": "user", "content": QUESTIONS[(p + c) % len(QUESTIONS)]}
            for name in run.order():
                messages = convs[name][c] + [question]
                answer = ask(run.servers[name], messages, w["answer_tokens"])
                run.rows.append(dict(answer, server=name, round=label, user=c, messages=messages))
                convs[name][c] = messages + [{"role": "assistant", "content": answer["reply"]}]
        for name in run.servers:
            run.round_diagnostics.setdefault(label, {})[name] = run.window(name, offsets[name])
            p50 = statistics.median(r["ttft_s"] for r in run.rows if r["round"] == label and r["server"] == name)
            said = round_said(run.round_diagnostics[label][name])
            print(f"  {label}: {name} TTFT p50 {p50 * 1e3:,.0f} ms{said}", flush=True)


def single(run: Run, w: dict) -> None:
    """One conversation alone: a system prompt, its own context, then rounds."""
    system = text_of(w["system_tokens"], 2)
    context = text_of(w["context_tokens"], 29)
    convs = {name: [{"role": "system", "content": system}] for name in run.servers}
    for n in range(1, w["rounds"] + 1):
        text = QUESTIONS[(n - 1) % len(QUESTIONS)]
        question = {"role": "user", "content": context + "\n\n" + text if n == 1 else text}
        label = f"round {n}"
        run.round(label, {name: [(0, c + [question])] for name, c in convs.items()}, w["answer_tokens"])
        for name, c in convs.items():
            convs[name] = c + [question, {"role": "assistant", "content": answer_of(run, name, label, 0)}]


def answer_of(run: Run, name: str, label: str, user: int) -> str:
    return next(r["reply"] for r in run.rows if (r["server"], r["round"], r["user"]) == (name, label, user))


def warm_prompts(workload: str, w: dict) -> list[list[dict]] | None:
    """The system prompt a deployment knows before any request (vllm-mlx's and promptstore's --warm-prompts)."""
    if kind(workload) == "chat":
        return [[{"role": "system", "content": text_of(w["system_tokens"], 0)}]]
    if workload == "single":
        return [[{"role": "system", "content": text_of(w["system_tokens"], 2)}]]
    return None  # pressure: no prompt is shared or known ahead
