"""The main job `make demo` runs: chats that share long system prompts, and an
agent that forks a conversation, three times: without a store, with a fresh
store, and in a new process on the same store. Every reply is checked token
for token against the reply without the store.

With no model it builds a random-weight llama and a tokenizer trained
in-process on text shipped with the project, so prompts are real text through
a chat template. With `model_path` it loads a local MLX model with mlx-lm.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPLY_TOKENS = 16


@dataclass
class Request:
    """One request of the workload: a conversation so far, as chat messages."""

    name: str
    messages: list[dict]


@dataclass
class Outcome:
    name: str
    prompt_tokens: int
    restored_hot: int
    restored_cold: int
    ttft: float
    reply: list[int] = field(default_factory=list)


def system_prompts(n: int = 3, words: int = 420) -> list[str]:
    """Long system prompts built from the shipped corpus, each different."""
    from .testing.tokenizer import CORPUS

    paragraphs = [p for p in CORPUS.read_text().splitlines() if p.strip()]
    out = []
    for i in range(n):
        text, k = [], i
        while sum(len(p.split()) for p in text) < words:
            text.append(paragraphs[k % len(paragraphs)])
            k += 3 + i
        out.append(f"System prompt {i + 1}. " + " ".join(text))
    return out


USER_TURNS = [
    "Do you have any books about sailing?",
    "What are the opening hours on Saturday?",
    "Can you tell me the weather for tomorrow?",
    "How do I make a simple tomato soup?",
]
TOOL_RESULTS = ["Tool result: three books found.", "Tool result: the shop is closed.", "Tool result: rain expected."]


def workload(conversations: int = 6, turns: int = 3) -> list[list[Request]]:
    """Rounds of requests: chats over shared system prompts, then agent forks.

    Replies are filled in as they are generated (each turn resends the history).
    """
    systems = system_prompts()
    chats = [[{"role": "system", "content": systems[c % len(systems)]}] for c in range(conversations)]
    rounds = []
    for t in range(turns):
        rounds.append(
            [
                Request(f"chat{c}.turn{t}", chats[c] + [{"role": "user", "content": USER_TURNS[(c + t) % 4]}])
                for c in range(conversations)
            ]
        )
    agent = [{"role": "system", "content": systems[0]}, {"role": "user", "content": "Plan a visit to the bookshop."}]
    rounds.append([Request("agent.base", agent)])
    rounds.append(
        [Request(f"agent.branch{b}", agent + [{"role": "user", "content": r}]) for b, r in enumerate(TOOL_RESULTS)]
    )
    rounds.append([Request("agent.return", agent + [{"role": "user", "content": "Back to the plan: what first?"}])])
    return rounds


def load(model_path: str | None):
    """(model, tokenizer, model_id)."""
    if model_path:
        from mlx_lm import load as mlx_load

        model, tokenizer = mlx_load(model_path)
        return model, tokenizer, str(Path(model_path).resolve())
    from .testing.models import tiny_model
    from .testing.tokenizer import demo_tokenizer

    tokenizer = demo_tokenizer(1024)
    model = tiny_model(
        "llama",
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=512,
        vocab_size=1024,
    )
    return model, tokenizer, "demo-random-llama-v1"


def serve(model, tokenizer, space, rounds, progress: Progress | None = None, label: str = "") -> list[Outcome]:
    """Run every request (with the store when `space` is given), growing each chat's history."""
    from mlx_lm.generate import stream_generate as mlx_stream

    from .caches import make_prompt_cache
    from .generation import stream_generate

    outcomes: list[Outcome] = []
    replies: dict[str, str] = {}
    task = progress.add_task(label, total=sum(len(r) for r in rounds)) if progress else None
    for round_ in rounds:
        for req in round_:
            messages = _with_history(req, replies)
            tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            start = time.perf_counter()
            if space is None:
                stream = mlx_stream(
                    model, tokenizer, tokens, max_tokens=REPLY_TOKENS, prompt_cache=make_prompt_cache(model)
                )
            else:
                stream = stream_generate(model, tokenizer, tokens, space=space, max_tokens=REPLY_TOKENS)
            reply, text, ttft = [], "", None
            for r in stream:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                reply.append(r.token)
                text += r.text
            hit = space.last_hit if space is not None else None
            cold = hit.cold_tokens if hit else 0
            outcomes.append(Outcome(req.name, len(tokens), (hit.length - cold) if hit else 0, cold, ttft, reply))
            replies[req.name] = text
            if progress:
                progress.advance(task)
    return outcomes


def _with_history(req: Request, replies: dict[str, str]) -> list[dict]:
    """A chat turn resends the earlier turns with their replies."""
    if not req.name.startswith("chat"):
        return req.messages
    chat, turn = req.name.split(".turn")
    messages = [req.messages[0]]
    for t in range(int(turn)):
        messages.append({"role": "user", "content": USER_TURNS[(int(chat[4:]) + t) % 4]})
        messages.append({"role": "assistant", "content": replies[f"{chat}.turn{t}"]})
    messages.append(req.messages[-1])
    return messages


def run_phase(phase: str, store_dir: str | None, model_path: str | None, progress=None) -> list[Outcome]:
    from .store import PromptStore

    model, tokenizer, model_id = load(model_path)
    rounds = workload()
    serve(model, tokenizer, None, [[rounds[0][0]]])  # warm-up, not counted
    if phase == "none":
        return serve(model, tokenizer, None, rounds, progress, "without a store")
    with PromptStore.open(store_dir, checkpoint_interval=256) as store:
        space = store.bind(model, model_id=model_id)
        return serve(model, tokenizer, space, rounds, progress, f"{phase} store")


def summary(name: str, outcomes: list[Outcome], base: float | None) -> dict:
    ttfts = sorted(o.ttft for o in outcomes)
    prompt = sum(o.prompt_tokens for o in outcomes)
    hot = sum(o.restored_hot for o in outcomes)
    cold = sum(o.restored_cold for o in outcomes)
    mean = statistics.mean(ttfts)
    return {
        "run": name,
        "requests": len(outcomes),
        "prompt_tokens": prompt,
        "restored_hot": hot,
        "restored_cold": cold,
        "prefilled": prompt - hot - cold,
        "ttft_mean_s": mean,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "speedup": (base / mean) if base else 1.0,
    }


def run(
    model_path: str | None = None,
    store_dir: str | None = None,
    json_out: str | None = None,
    console: Console | None = None,
) -> bool:
    """The three runs and their table; True when every reply matched."""
    console = console or Console(width=120)
    with tempfile.TemporaryDirectory() as tmp:
        store = store_dir or str(Path(tmp) / "store")
        with Progress(console=console, transient=True) as progress:
            plain = run_phase("none", None, model_path, progress)
            fresh = run_phase("fresh", store, model_path, progress)
        console.print("new process on the same store ...")
        again = _in_new_process(store, model_path)
    rows = [summary("no store", plain, None)]
    base = rows[0]["ttft_mean_s"]
    rows += [summary("fresh store", fresh, base), summary("after restart", again, base)]
    same = [all(a.reply == b.reply for a, b in zip(plain, other)) for other in (fresh, again)]
    _print(console, rows, same)
    blas = "OpenBLAS (preloaded)" if "openblas" in os.environ.get("LD_PRELOAD", "") else "MLX's bundled BLAS"
    what = model_path or "a float32 random-weight llama (4 layers, hidden 256)"
    console.print(f"model: {what}; device: {mx.default_device()}; BLAS: {blas}")
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows, "replies_equal": same}, indent=2))
    return all(same)


def _in_new_process(store: str, model_path: str | None) -> list[Outcome]:
    cmd = [sys.executable, "-m", "promptstore.cli", "demo-phase", "--store", store]
    if model_path:
        cmd += ["--model", model_path]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [Outcome(**o) for o in json.loads(out.strip().splitlines()[-1])]


def phase_main(store: str, model_path: str | None) -> int:
    """The restart phase, run in its own process: outcomes as one JSON line."""
    outcomes = run_phase("persisted", store, model_path)
    print(json.dumps([asdict(o) for o in outcomes]))
    return 0


def _print(console: Console, rows: list[dict], same: list[bool]) -> None:
    table = Table(title="promptstore demo: chats over shared system prompts, and an agent that forks")
    for col in (
        "run",
        "requests",
        "prompt tokens",
        "restored hot",
        "restored cold",
        "prefilled",
        "TTFT mean",
        "TTFT p95",
        "speed-up",
        "replies equal",
    ):
        table.add_column(col, justify="right", no_wrap=True)
    for row, eq in zip(rows, [None] + same):
        table.add_row(
            row["run"],
            str(row["requests"]),
            str(row["prompt_tokens"]),
            str(row["restored_hot"]),
            str(row["restored_cold"]),
            str(row["prefilled"]),
            f"{row['ttft_mean_s'] * 1e3:.0f} ms",
            f"{row['ttft_p95_s'] * 1e3:.0f} ms",
            f"{row['speedup']:.1f}x",
            "-" if eq is None else ("[green]yes[/]" if eq else "[red]NO[/]"),
        )
    console.print(table)
