"""promptstore serve against its peers, mlx_lm.server and vllm-mlx, on three workloads.

Every server runs the same model directory with the same memory budget for
cached prompts and its own best caching settings (mlx_lm.server: its LRU
prompt cache; vllm-mlx: continuous batching, its memory-aware prefix cache,
its SSD tier and, where a system prompt is known, its warm prompts;
promptstore serve: its store, and the same warm prompts). The servers answer the same requests in turn,
the one that goes first rotating, so each sees the same machine load.

- chat: LMCache's multi-round QA: users with a shared system prompt and a
  context of their own over several rounds; then every server killed by
  SIGKILL and started again on its same folders, the next round timed, one
  more round; then the same after a SIGTERM.
- pressure: conversations whose state is several times the memory budget,
  visited round-robin (one request at a time), so a returning conversation
  finds its state evicted from memory; every reply compared with a full
  prefill's (mlx_lm.server with no prompt cache) at temperature 0.
- single: one conversation alone, hot, several rounds: what one agent sees.

Each workload runs --runs times on fresh servers and folders; a round's
figure is the median over runs of its TTFT p50 over users. Before servers
start, the machine's dirty pages are written back (os.sync): with
--one-at-a-time, one server's writes (vllm-mlx's SSD tier wrote ~40 GB in the
cuda profile's memory-pressure run) are not still going to disk while the
next server is timed; the pages pending and the seconds taken are kept in each
run's `settled`. Prints the tables
and the goals; writes bench-results/serve-<profile>.json and renders its
section of docs/benchmarks.md (tools/bench/serve_docs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
from common import (
    OPENBLAS_HINT,
    blas_info,
    blas_warning,
    describe_device,
    drop_page_cache,
    write_back,
    write_results,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks_doc import write_docs  # noqa: E402
from serve_docs import print_report  # noqa: E402
from serve_peers import (  # noqa: E402
    MLX_LM,
    PEERS,
    PROMPTSTORE,
    REQUEST_TIMEOUT_S,
    VLLM_MLX,
    Server,
    Setup,
    ask,
    build,
    promptstore_log,
    reference_server,
    vllm_log,
    vllm_missing,
)

from promptstore.testing.model_dir import write_model_dir  # noqa: E402
from promptstore.testing.models import DEMO_LLAMA  # noqa: E402
from promptstore.testing.tokenizer import CORPUS, demo_tokenizer  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
PROFILES = {
    # The demo's model in float32 on 2 CPU cores: prefill dominates at these lengths.
    "cpu": dict(
        model=dict(DEMO_LLAMA),
        dtype="float32",
        chat=dict(users=4, rounds=3, system_tokens=768, context_tokens=256, answer_tokens=24, budget=256 * MiB),
        pressure=dict(conversations=16, context_tokens=1024, passes=3, answer_tokens=16, budget=16 * MiB),
        single=dict(system_tokens=1024, context_tokens=1024, rounds=6, answer_tokens=24, budget=256 * MiB),
        note="the demo's llama (4 layers, hidden 256) in float32 on CPU, OpenBLAS preloaded when installed",
    ),
    # LMCache's multi-round QA in Llama-3.1-8B's shape (random weights; the demo
    # tokenizer's small vocabulary, so the LM head is smaller than the real one's).
    "cuda": dict(
        model=dict(
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        ),
        dtype="bfloat16",
        chat=dict(users=4, rounds=4, system_tokens=1900, context_tokens=2900, answer_tokens=48, budget=4 * GiB),
        # Replies are compared with a full prefill's in float32 only: in bfloat16 a
        # prefill in other chunks may round otherwise and pick another token.
        pressure=dict(
            conversations=16, context_tokens=4096, passes=3, answer_tokens=32, budget=2 * GiB, check_replies=False
        ),
        single=dict(system_tokens=2048, context_tokens=6144, rounds=6, answer_tokens=48, budget=4 * GiB),
        note="Llama-3.1-8B's shape (32 layers, hidden 4096, 8 KV heads of 128) with random bfloat16 weights "
        "and the demo tokenizer's 1,024-token vocabulary",
    ),
}
# A smoke test of the bench itself, well under its goals' sizes: a minute or two.
PROFILES["quick"] = dict(
    PROFILES["cpu"],
    chat=dict(users=2, rounds=2, system_tokens=256, context_tokens=64, answer_tokens=8, budget=64 * MiB),
    pressure=dict(conversations=4, context_tokens=256, passes=2, answer_tokens=8, budget=1 * MiB),
    single=dict(system_tokens=256, context_tokens=256, rounds=3, answer_tokens=8, budget=64 * MiB),
)
WORKLOADS = ("chat", "pressure", "single")
SERVERS = (MLX_LM, VLLM_MLX, PROMPTSTORE)
VOCAB = 1024
QUESTIONS = [
    "What does the passage above say about the harbour?",
    "Summarise the last answer in one sentence.",
    "Which book would you recommend to a beginner, and why?",
    "What happens on the weekend in the town?",
    "Can you explain the tides in simpler words?",
    "What should a visitor see first?",
]
SETTLE_S = 2.0  # before a stop: spills written through land, as they would on a server at rest
# Between two rounds of a server that runs alone (--one-at-a-time), its users read
# the answers: side by side, the other servers' rounds stand there (seconds).
READ_S = 2.0


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


def kv_bytes_per_token(profile: dict) -> int:
    m = profile["model"]
    return 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * getattr(mx, profile["dtype"]).size


class Run:
    """One run of one workload: the servers, their conversations and what they answered."""

    def __init__(self, servers: dict[str, Server]):
        self.servers = servers
        self.rows: list[dict] = []  # one per request: server, round, user, ttft_s, replies...
        self.rounds: list[str] = []
        self.round_diagnostics: dict[str, dict[str, dict]] = {}
        self.turn = 0  # rotates who goes first

    def order(self) -> list[str]:
        names = list(self.servers)
        k = self.turn % len(names)
        self.turn += 1
        return names[k:] + names[:k]

    def round(self, label: str, asks: dict[str, list[tuple[int, list[dict]]]], max_tokens: int, waves=None) -> None:
        """Every server in turn answers its requests of this round, at once
        (`waves`: lists of users sent one after the other)."""
        self.rounds.append(label)
        for name in self.order():
            server = self.servers[name]
            offset = server.log.stat().st_size if server.log.exists() else 0
            before = server.storage_reads() if "after" in label else {}
            health = server.health() if "after" in label else None
            answers = fire(server, asks[name], max_tokens, waves)
            for user, answer in answers.items():
                self.rows.append(dict(answer, server=name, round=label, user=user))
            diag = log_window(server, offset)
            if "after" in label:
                after = server.storage_reads()
                diag |= {"storage_reads": {k: after[k] - before.get(k, 0) for k in after}, "health_before": health}
            self.round_diagnostics.setdefault(label, {})[name] = diag
            p50 = statistics.median(a["ttft_s"] for a in answers.values()) * 1e3
            print(f"  {label}: {name} TTFT p50 {p50:,.0f} ms{round_said(diag)}", flush=True)
        if len(self.servers) == 1:
            time.sleep(READ_S)  # alone, no other server's round stands between two of its rounds


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
    the fetch and of the rest to the first token."""
    rows = diag.get("timelines")
    if not rows:
        return ""
    plans = Counter(r["plan"] for r in rows if r["plan"])
    how = f" ({', '.join(f'{k} x{n}' for k, n in plans.items())})" if plans else ""
    share = diag["restored_share"]
    said = f"; restored {'-' if share is None else f'{share:.0%}'}, {diag['from_disk_tokens']:,} tokens from disk{how}"
    for phase in ("fetch_ms", "prefill_first_ms"):
        values = [r[phase] for r in rows if phase in r]
        if values:
            said += f", {phase[:-3]} {statistics.median(values):,.0f} ms"
    return said


def log_window(server: Server, offset: int) -> dict:
    """What the server's log says about the requests since `offset`."""
    if not server.log.exists():
        return {}
    with open(server.log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    if server.name == PROMPTSTORE:
        d = promptstore_log(lines)
        rows = d["timelines"]
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
        offsets = {name: s.log.stat().st_size if s.log.exists() else 0 for name, s in run.servers.items()}
        for c in range(w["conversations"]):
            question = {"role": "user", "content": QUESTIONS[(p + c) % len(QUESTIONS)]}
            for name in run.order():
                messages = convs[name][c] + [question]
                answer = ask(run.servers[name], messages, w["answer_tokens"])
                run.rows.append(dict(answer, server=name, round=label, user=c, messages=messages))
                convs[name][c] = messages + [{"role": "assistant", "content": answer["reply"]}]
        for name, server in run.servers.items():
            run.round_diagnostics.setdefault(label, {})[name] = log_window(server, offsets[name])
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
    if workload == "chat":
        return [[{"role": "system", "content": text_of(w["system_tokens"], 0)}]]
    if workload == "single":
        return [[{"role": "system", "content": text_of(w["system_tokens"], 2)}]]
    return None  # pressure: no prompt is shared or known ahead


def run_workload(workload: str, w: dict, base: Setup, names: list[str], args, run_no: int) -> dict:
    """One run of `workload` on fresh servers and folders; its rows and diagnostics."""
    work = base.work / f"{workload}-{run_no}"
    work.mkdir(parents=True)
    setup = Setup(
        **{
            **base.__dict__,
            "work": work,
            "budget_bytes": w["budget"],
            "answer_tokens": w["answer_tokens"],
            "warm_prompts": warm_prompts(workload, w),
        }
    )
    k = run_no % len(names)  # who starts first rotates too
    if args.one_at_a_time:
        # Each server alone on the machine, in turn: the same requests, its own run.
        out = merged([run_servers(workload, w, setup, [name], args) for name in names[k:] + names[:k]])
    else:
        out = run_servers(workload, w, setup, names[k:] + names[:k], args)
    if workload == "pressure" and w.get("check_replies", True):
        out["full_prefill"] = compare_with_full_prefill(out["rows"], setup)
    for r in out["rows"]:
        r.pop("messages", None)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return out


def run_servers(workload: str, w: dict, setup: Setup, names: list[str], args) -> dict:
    """`workload` through the servers `names` (in this order at their first round), side by side."""
    if len(names) == 1:
        setup = Setup(**{**setup.__dict__, "work": setup.work / names[0].replace(" ", "-")})
        setup.work.mkdir(parents=True)
    servers = {name: build(name, setup) for name in names}
    settled = write_back()  # no earlier server's (or the model's) writes still going to disk while these run
    started = time.perf_counter()
    together = not args.drop_page_cache
    start_all(list(servers.values()), together)
    run = Run(servers)
    restarts: dict[str, dict] = {}

    def restart(how: str) -> None:
        time.sleep(SETTLE_S)
        t0 = time.perf_counter()
        each(list(servers.values()), lambda server: server.stop() if how == "SIGTERM" else server.kill())
        dropped = drop_page_cache() if args.drop_page_cache else None
        # Each starts alone after the page cache was emptied; else all at once.
        took = start_all([servers[name] for name in run.order()], together, before=drop_page_cache if dropped else None)
        restarts[how] = {name: {"start_s": s} for name, s in took.items()}
        restarts[how] |= {"page_cache_dropped": dropped, "started_together": together}
        print(f"  {how}: every server stopped and started again in {time.perf_counter() - t0:.1f} s", flush=True)

    try:
        if workload == "chat":
            chat(run, w, restart)
        elif workload == "pressure":
            pressure(run, w)
        else:
            single(run, w)
        time.sleep(SETTLE_S)
    finally:
        each([server for server in servers.values() if server.running()], lambda server: server.stop())
    out = {
        "wall_s": time.perf_counter() - started,
        "rounds": run.rounds,
        "rows": run.rows,
        "round_diagnostics": run.round_diagnostics,
        "restarts": restarts,
        "promptstore_log": promptstore_log(log_lines(servers[PROMPTSTORE])) if PROMPTSTORE in servers else None,
        "vllm_mlx_log": vllm_log(log_lines(servers[VLLM_MLX])) if VLLM_MLX in servers else None,
        "disk_bytes": {name: du(setup.work / d) for name, d in DISK.items() if name.split(" (")[0] in servers},
        "settled": {name: settled for name in names},
    }
    return out


def merged(parts: list[dict]) -> dict:
    """Runs of one workload by one server each, as one run of them all."""
    out = {
        "wall_s": sum(p["wall_s"] for p in parts),
        "rounds": parts[0]["rounds"],
        "rows": [r for p in parts for r in p["rows"]],
        "round_diagnostics": {},
        "restarts": {},
        "one_at_a_time": True,
        "disk_bytes": {},
        "settled": {},
    }
    for p in parts:
        out["settled"] |= p.get("settled", {})
        for label, by_server in p["round_diagnostics"].items():
            out["round_diagnostics"].setdefault(label, {}).update(by_server)
        for how, figures in p["restarts"].items():
            out["restarts"].setdefault(how, {}).update(figures)
        out["disk_bytes"] |= p["disk_bytes"]
        for key in ("promptstore_log", "vllm_mlx_log"):
            if p.get(key) is not None:
                out[key] = p[key]
    out.setdefault("promptstore_log", None)
    out.setdefault("vllm_mlx_log", None)
    return out


def each(servers: list[Server], do) -> None:
    """`do(server)` for every server at once (threads); the first error is raised."""
    errors: list[BaseException] = []

    def one(server: Server) -> None:
        try:
            do(server)
        except BaseException as e:  # noqa: BLE001 - raised again below, on this thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(server,)) for server in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def start_all(servers: list[Server], together: bool, before=None) -> dict[str, float]:
    """Start the servers (all at once when `together`, else in order, `before()`
    ahead of each); seconds each took to answer its first request. Starting is
    not timed against the goals: together, a run spends a third of the time on it
    (an 8B model's three servers took 20-32 s each to start, one after another)."""
    took: dict[str, float] = {}

    def start(server: Server) -> None:
        if before is not None:
            before()
        t = time.perf_counter()
        server.start()
        took[server.name] = time.perf_counter() - t

    if together:
        each(servers, start)
    else:
        for server in servers:
            start(server)
    return took


def log_lines(server: Server) -> list[str]:
    return server.log.read_text(errors="replace").splitlines() if server.log.exists() else []


DISK = {PROMPTSTORE: "store", VLLM_MLX: "vllm-ssd", f"{VLLM_MLX} (saved at SIGTERM)": "vllm-home"}


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def compare_with_full_prefill(rows: list[dict], setup: Setup) -> dict:
    """Every pressure request again through its server's software with no prompt
    cache (mlx_lm.server's for promptstore serve); each reply against that one."""
    replies: dict[tuple[str, str], str] = {}
    for kind in dict.fromkeys(VLLM_MLX if r["server"] == VLLM_MLX else MLX_LM for r in rows):
        ref = reference_server(kind, setup).start()
        try:
            for r in rows:
                key = (kind, json.dumps(r["messages"]))
                if (VLLM_MLX if r["server"] == VLLM_MLX else MLX_LM) == kind and key not in replies:
                    replies[key] = ask(ref, r["messages"], setup.answer_tokens)["reply"]
        finally:
            ref.stop()
    out: dict[str, dict] = {}
    for r in rows:
        kind = VLLM_MLX if r["server"] == VLLM_MLX else MLX_LM
        same = replies[(kind, json.dumps(r["messages"]))] == r["reply"]
        r["equals_full_prefill"] = same
        s = out.setdefault(r["server"], {"equal": 0, "requests": 0, "differ": []})
        s["equal"] += same
        s["requests"] += 1
        if not same:
            s["differ"].append({"round": r["round"], "conversation": r["user"]})
    return out


# ---- results ---------------------------------------------------------------------


def summarize(workload: str, runs: list[dict], names: list[str]) -> dict:
    """Per server, per round: the median over runs of the round's TTFT p50 over users."""
    out: dict[str, dict] = {}
    for name in names:
        rounds = {}
        for label in runs[0]["rounds"]:
            per_run = [
                statistics.median(r["ttft_s"] for r in run["rows"] if r["server"] == name and r["round"] == label)
                for run in runs
            ]
            rows = [r for run in runs for r in run["rows"] if r["server"] == name and r["round"] == label]
            cached = [r["cached_tokens"] / r["prompt_tokens"] for r in rows if r["cached_tokens"] is not None]
            diag = [run["round_diagnostics"].get(label, {}).get(name, {}) for run in runs]
            shares = [d["restored_share"] for d in diag if d.get("restored_share") is not None]
            rounds[label] = {
                "ttft_p50_s": statistics.median(per_run),
                "ttft_p50_s_per_run": per_run,
                "ttft_max_s": max(r["ttft_s"] for r in rows),
                "requests": len(rows),
                "restored_share": statistics.mean(cached) if cached else (statistics.mean(shares) if shares else None),
                "replies_equal_mlx_lm": None,
            }
        out[name] = rounds
    base = MLX_LM if MLX_LM in names else None
    for name in names:
        for label, s in out[name].items():
            if base:
                a = [r for run in runs for r in run["rows"] if r["server"] == base and r["round"] == label]
                b = [r for run in runs for r in run["rows"] if r["server"] == name and r["round"] == label]
                s["replies_equal_mlx_lm"] = f"{sum(x['reply'] == y['reply'] for x, y in zip(a, b))}/{len(a)}"
    if workload == "pressure" and all("full_prefill" in run for run in runs):
        for name in names:
            eq = [run["full_prefill"][name] for run in runs]
            out[name]["replies_equal_full_prefill"] = f"{sum(e['equal'] for e in eq)}/{sum(e['requests'] for e in eq)}"
    return out


def goal(what: str, ours: float | None, theirs: float | None, limit: float) -> dict:
    value = ours / theirs if ours is not None and theirs else None
    return {"goal": what, "value": value, "limit": limit, "met": None if value is None else value <= limit}


def goals(results: dict) -> list[dict]:
    """The issue's goals as computed ratios of TTFT p50 (None where a server was not run)."""
    ours = results.get(PROMPTSTORE, {})

    def p50(name: str, workload: str, label: str) -> float | None:
        return results.get(name, {}).get(workload, {}).get(label, {}).get("ttft_p50_s")

    out = []
    for workload in ("chat", "single"):
        for label in ours.get(workload, {}):
            if not label.startswith("round"):
                continue
            if "SIGKILL" in label:
                for peer in PEERS:
                    g = goal(
                        f"{workload}, {label}: vs {peer}",
                        p50(PROMPTSTORE, workload, label),
                        p50(peer, workload, label),
                        0.3,
                    )
                    out.append(g)
            elif "SIGTERM" not in label:
                peers = [p50(peer, workload, label) for peer in PEERS if p50(peer, workload, label)]
                g = goal(
                    f"{workload}, {label}: vs the faster peer",
                    p50(PROMPTSTORE, workload, label),
                    min(peers, default=None),
                    1.0,
                )
                out.append(g)
    for label in ours.get("pressure", {}):
        if label.startswith("pass") and "first" not in label:
            for peer, limit in ((VLLM_MLX, 0.5), (MLX_LM, 0.3)):
                g = goal(
                    f"pressure, {label}: vs {peer}",
                    p50(PROMPTSTORE, "pressure", label),
                    p50(peer, "pressure", label),
                    limit,
                )
                out.append(g)
    if "replies_equal_full_prefill" in ours.get("pressure", {}):
        equal, total = map(int, ours["pressure"]["replies_equal_full_prefill"].split("/"))
        out.append(
            {
                "goal": "pressure: replies equal to a full prefill's",
                "value": equal / total,
                "limit": 1.0,
                "met": equal == total,
                "at_least": True,
            }
        )
    return out


def restart_figures(results: dict) -> list[dict]:
    """After a restart, promptstore serve against each peer (reported, no goal after SIGTERM)."""
    ours = results.get(PROMPTSTORE, {}).get("chat", {})
    out = []
    for label, s in ours.items():
        if "SIGTERM" in label:
            for peer in PEERS:
                theirs = results.get(peer, {}).get("chat", {}).get(label, {}).get("ttft_p50_s")
                out.append({"what": f"chat, {label}: vs {peer}", "value": s["ttft_p50_s"] / theirs if theirs else None})
    return out


# ---- main ------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument("--runs", type=int, default=3, help="runs of each workload; figures are medians over runs")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {', '.join(SERVERS)}")
    p.add_argument(
        "--vllm-mlx-python",
        default=".peers/vllm-mlx/bin/python",
        help="the python that runs vllm-mlx (`make peers` installs it there); on a machine where vllm-mlx "
        "sits on a path of its own, `python3` with --vllm-mlx-pythonpath",
    )
    p.add_argument("--vllm-mlx-pythonpath", default="", help="PYTHONPATH for vllm-mlx alone (empty: none)")
    p.add_argument(
        "--drop-page-cache",
        action="store_true",
        help="empty the machine's page cache between the stop and each server's restart (root)",
    )
    p.add_argument(
        "--warm-up-process",
        action=argparse.BooleanOptionalAction,
        help="first run rounds of other text through a throwaway promptstore serve, so MLX's kernels are "
        "compiled before any server is timed (default: on for --profile cuda)",
    )
    p.add_argument("--serve-args", default="", help="extra options for promptstore serve (one string)")
    p.add_argument("--keep-work", action="store_true", help="keep the model, stores and logs (removed by default)")
    p.add_argument("--out", help="JSON path (default bench-results/serve-<profile>.json)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="add this call's runs to those already in the result file (same profile): a run split over "
        "several calls, one workload each, say",
    )
    p.add_argument(
        "--model-dir", help="write the model here, or read it when it is there already (default: the work folder)"
    )
    p.add_argument("--skip-generated", action="store_true", help=argparse.SUPPRESS)  # earlier runs' commands
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="each server runs the workload alone on the machine, in turn (where the servers' memory together "
        "outgrows it: three 8B servers on an 80 GB card), instead of side by side, round by round",
    )
    p.add_argument(
        "--mlx-cache-limit-gb",
        type=float,
        default=None,
        help="cap every server's MLX buffer cache (mx.set_cache_limit, through a sitecustomize on its path): "
        "three 8B servers each keeping freed buffers outgrow an 80 GB card",
    )
    p.add_argument("--note", default="", help="a sentence on this run kept in the result (the machine, say)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = p.parse_args()
    if args.warm_up_process is None:
        args.warm_up_process = args.profile == "cuda"
    out_path = args.out or f"bench-results/serve-{args.profile}.json"
    blas = blas_info()
    if args.profile == "cpu" and (warning := blas_warning(blas)):
        print(warning, file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        code = run_bench(args, work, out_path, blas)
    except BaseException:
        print(f"work folder kept (the servers' logs): {work}", file=sys.stderr)
        raise
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)  # the cuda profile's model alone is 16 GB
    return code


def run_bench(args, work: Path, out_path: str, blas: dict) -> int:
    profile = PROFILES[args.profile]
    started = time.perf_counter()
    model = Path(args.model_dir) if args.model_dir else work / "model"
    if (model / "config.json").exists():
        print(f"model read from {model}: {profile['note']}", flush=True)
    else:
        dtype = getattr(mx, profile["dtype"])
        write_model_dir(model, "llama", vocab_size=VOCAB, dtype=dtype, **profile["model"])
        mx.clear_cache()
        print(f"model written in {time.perf_counter() - started:.1f} s: {profile['note']}", flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    vllm_pythonpath = args.vllm_mlx_pythonpath
    if args.mlx_cache_limit_gb is not None:
        capped = mlx_cache_cap(work, int(args.mlx_cache_limit_gb * GiB))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [capped, env.get("PYTHONPATH", "")]))
        vllm_pythonpath = os.pathsep.join(filter(None, [capped, vllm_pythonpath]))
    if args.profile == "cpu" and Path(OPENBLAS_HINT).exists():
        env["LD_PRELOAD"] = OPENBLAS_HINT  # every server: a fair float32 prefill
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    vllm_python = args.vllm_mlx_python  # a path (made absolute: vllm-mlx runs in its own folder) or a command
    vllm_python = os.path.abspath(vllm_python) if os.sep in vllm_python else vllm_python
    skipped = {}
    if VLLM_MLX in names and (why := vllm_missing(vllm_python, vllm_pythonpath)):
        print(f"vllm-mlx skipped: {why}", flush=True)
        skipped[VLLM_MLX] = why
        names.remove(VLLM_MLX)
    names = [n for n in SERVERS if n in names]
    base = Setup(
        python=sys.executable,
        model=model,
        budget_bytes=0,
        answer_tokens=0,
        env=env,
        work=work,
        serve_args=args.serve_args.split(),
        vllm_python=vllm_python if VLLM_MLX in names else None,
        vllm_pythonpath=vllm_pythonpath,
    )
    if args.warm_up_process:
        warm_up_process(base, profile)
    before = earlier(out_path, args) if args.merge else {}
    details: dict[str, list] = dict(before.get("details", {}))
    for workload in list(WORKLOADS) if args.workload == "all" else [args.workload]:
        done = details.get(workload, [])
        details[workload] = list(done)
        for n in range(len(done), len(done) + args.runs):
            print(f"{workload}, run {n + 1} ({args.runs} in this call):", flush=True)
            details[workload].append(run_workload(workload, profile[workload], base, names, args, n))
    results: dict[str, dict] = {}
    for workload in [w for w in WORKLOADS if w in details]:
        ran = [n for n in SERVERS if any(r["server"] == n for r in details[workload][0]["rows"])]
        for name, rounds in summarize(workload, details[workload], ran).items():
            results.setdefault(name, {})[workload] = rounds
    kv = kv_bytes_per_token(profile)
    payload = {
        "benchmark": "serve-peers",
        "profile": args.profile,
        "device": describe_device(),
        "commands": [*before.get("commands", []), command(args)],
        "note": profile["note"],
        "run_note": "; ".join(n for n in (before.get("run_note"), args.note) if n),
        "wall_s": before.get("wall_s", 0) + time.perf_counter() - started,
        "servers": sorted(results, key=SERVERS.index),
        "skipped": before.get("skipped", {}) | skipped,
        "versions": versions(names, base),
        "workloads": {
            k: dict(profile[k], kv_bytes_per_token=kv, runs=len(v), wall_s=sum(d["wall_s"] for d in v))
            for k, v in details.items()
        },
        "server_ld_preload": Path(env.get("LD_PRELOAD", "")).name,
        "results": results,
        "goals": goals(results),
        "after_sigterm": restart_figures(results),
        "details": details,
    }
    # Log lines name the run's temporary folder: keep the result free of this machine's paths.
    payload = json.loads(json.dumps(payload).replace(str(work), "<work>"))
    out = write_results(out_path, payload, blas)
    print_report(json.loads(out.read_text()))
    print(f"wrote {out}")
    if not args.no_docs and not args.out:
        write_docs()
    return 0


def mlx_cache_cap(work: Path, limit: int) -> str:
    """A folder whose sitecustomize caps MLX's buffer cache at `limit` bytes in
    every Python started with it on its path (each server, alike)."""
    folder = work / "mlx-cache-cap"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        f"try:\n    import mlx.core as mx\n\n    mx.set_cache_limit({limit})\nexcept ImportError:\n    pass\n"
    )
    return str(folder)


def earlier(out_path: str, args) -> dict:
    """The result file's runs to add to (--merge): the same benchmark and profile, else none."""
    path = Path(out_path) if Path(out_path).is_absolute() else Path(__file__).resolve().parents[2] / out_path
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    if doc.get("benchmark") != "serve-peers" or doc.get("profile") != args.profile:
        print(f"--merge: {path} holds another benchmark or profile; not merged", flush=True)
        return {}
    return doc


def command(args) -> str:
    flags = [f"--profile {args.profile}", f"--workload {args.workload}", f"--runs {args.runs}"]
    flags += ["--drop-page-cache"] if args.drop_page_cache else []
    flags += ["--one-at-a-time"] if args.one_at_a_time else []
    flags += [f"--mlx-cache-limit-gb {args.mlx_cache_limit_gb:g}"] if args.mlx_cache_limit_gb is not None else []
    flags += [f"--serve-args '{args.serve_args}'"] if args.serve_args else []
    flags += [f"--servers '{args.servers}'"] if args.servers != ",".join(SERVERS) else []
    return "python tools/bench/bench_serve.py " + " ".join(flags)


def versions(names: list[str], base: Setup) -> dict:
    import importlib.metadata as md

    out = {"mlx": mx.__version__, "mlx-lm": md.version("mlx-lm")}
    if VLLM_MLX in names:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= {"PYTHONPATH": base.vllm_pythonpath} if base.vllm_pythonpath else {}
        code = "import importlib.metadata as m; print(m.version('vllm-mlx'), m.version('mlx-lm'), m.version('mlx'))"
        import subprocess

        got = subprocess.run([base.vllm_python, "-c", code], capture_output=True, text=True, env=env).stdout.split()
        if len(got) == 3:
            out["vllm-mlx"] = {"vllm-mlx": got[0], "mlx-lm": got[1], "mlx": got[2]}
    return out


def warm_up_process(base: Setup, profile: dict) -> None:
    """Two rounds of other text through a throwaway promptstore serve, a restart,
    one more: MLX compiles its kernels once per machine (into its on-disk
    cache), not per server, and a restarted server meets kernels the rounds
    before it do not."""
    started = time.perf_counter()
    w = profile["chat"]
    work = base.work / "warm-up"
    work.mkdir()
    setup = Setup(**{**base.__dict__, "work": work, "budget_bytes": w["budget"], "answer_tokens": w["answer_tokens"]})
    server = build(PROMPTSTORE, setup).start()
    other = text_of(w["system_tokens"], 5)
    convs = [
        [{"role": "system", "content": other + "\n\n" + text_of(w["context_tokens"], 7 * (u + 3))}]
        for u in range(w["users"])
    ]
    for turn in range(3):
        if turn == 2:
            server.stop()
            server.start()
        q = {"role": "user", "content": QUESTIONS[turn]}
        answers = fire(server, [(u, c + [q]) for u, c in enumerate(convs)], w["answer_tokens"])
        convs = [c + [q, {"role": "assistant", "content": answers[u]["reply"]}] for u, c in enumerate(convs)]
    server.stop()
    shutil.rmtree(work, ignore_errors=True)
    print(f"warm-up process: {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
