"""The main job `make demo` runs: chats that share long system prompts, and an
agent that forks a conversation, three times: without a store, with a fresh
store, and in a new process on the same store. Every reply is checked token
for token against the reply without the store.

With no model it builds a random-weight llama and a tokenizer trained
in-process on text shipped with the project, so prompts are real text through
a chat template. With `model_path` it loads a local MLX model with mlx-lm.
"""

from __future__ import annotations

import argparse
import errno
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from rich import box
from rich.console import Console
from rich.table import Table

from .console import Progress, Task, close_store

REPLY_TOKENS = 16
# Where `make openblas` (Debian/Ubuntu: libopenblas0-pthread) installs OpenBLAS.
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


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
    """(model, tokenizer, model_id): the model at `model_path`, else the demo's own."""
    if model_path:
        from mlx_lm import load as mlx_load

        model, tokenizer = mlx_load(model_path)
        return model, tokenizer, str(Path(model_path).resolve())
    from .testing.models import DEMO_LLAMA, tiny_model
    from .testing.tokenizer import demo_tokenizer

    tokenizer = demo_tokenizer(1024)
    model = tiny_model("llama", **DEMO_LLAMA, vocab_size=1024)
    return model, tokenizer, "demo-random-llama-v1"


def serve(model, tokenizer, space, rounds, on_outcome: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run every request (with the store when `space` is given), growing each chat's
    history; `on_outcome` hears of each request as it finishes."""
    from mlx_lm.generate import stream_generate as mlx_stream

    from .caches import make_prompt_cache
    from .generation import stream_generate

    outcomes: list[Outcome] = []
    replies: dict[str, str] = {}
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
            if on_outcome is not None:
                on_outcome(outcomes[-1])
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


def with_store(model, tokenizer, model_id: str, store_dir: str, progress: Progress, label: str) -> list[Outcome]:
    """The workload on the store at `store_dir`, closed (all on disk) when it returns."""
    from .store import PromptStore

    rounds = workload()
    store = PromptStore.open(store_dir, checkpoint_interval=256)
    try:
        space = store.bind(model, model_id=model_id)
        with progress.task(label, total=_count(rounds), unit="requests") as task:
            return serve(model, tokenizer, space, rounds, _advance(task))
    finally:
        close_store(store, progress)


def _count(rounds) -> int:
    return sum(len(r) for r in rounds)


def _advance(task: Task) -> Callable[[Outcome], None]:
    return lambda outcome: task.update(advance=1)


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


@dataclass
class DemoResult:
    """The demo's figures: one row per run, and whether each store run's replies matched."""

    rows: list[dict]
    replies_equal: list[bool]
    model: str
    device: str
    blas: str

    @property
    def ok(self) -> bool:
        return all(self.replies_equal)


def run(model_path: str | None = None, store_dir: str | None = None, progress: Progress | None = None) -> DemoResult:
    """The three runs: without a store, with a fresh store, and in a new process on the same store."""
    progress = progress or Progress(enabled=False)
    with progress.task("loading the model"):
        model, tokenizer, model_id = load(model_path)
        rounds = workload()
        serve(model, tokenizer, None, [[rounds[0][0]]])  # warm-up, not counted
    with tempfile.TemporaryDirectory() as tmp:
        store = store_dir or str(Path(tmp) / "store")
        with progress.task("without a store", total=_count(rounds), unit="requests") as task:
            plain = serve(model, tokenizer, None, rounds, _advance(task))
        started = time.monotonic()
        fresh = with_store(model, tokenizer, model_id, store, progress, "with a fresh store")
        limit = max(600.0, 20 * (time.monotonic() - started))
        with progress.task("after a restart (a new process)", total=_count(rounds), unit="requests") as task:
            again = _in_new_process(store, model_path, task, limit)
    rows = [summary("no store", plain, None)]
    base = rows[0]["ttft_mean_s"]
    rows += [summary("fresh store", fresh, base), summary("restarted", again, base)]
    same = [all(a.reply == b.reply for a, b in zip(plain, other)) for other in (fresh, again)]
    what = model_path or "a float32 random-weight llama (4 layers, hidden 256)"
    return DemoResult(rows, same, what, mx.default_device().type.name, blas_in_use())


def _in_new_process(store: str, model_path: str | None, task: Task, limit_s: float) -> list[Outcome]:
    """The restart run in a child process, which prints one JSON line per request."""
    cmd = [sys.executable, "-m", "promptstore.demo", "--store", store]
    if model_path:
        cmd += ["--model", model_path]
    outcomes = []
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
        watchdog = threading.Timer(limit_s, proc.kill)  # bounds the whole run, not each line
        watchdog.start()
        try:
            for line in proc.stdout:
                outcomes.append(Outcome(**json.loads(line)))
                task.update(advance=1)
            code = proc.wait(timeout=60)
        finally:
            watchdog.cancel()
            proc.stdout.close()
        if code != 0:
            errors.seek(0)
            lines = errors.read().strip().splitlines() or [f"killed after {limit_s:.0f} s"]
            raise RuntimeError(f"the restart run failed (status {code}): {lines[-1]}")
    return outcomes


def _restart_main(argv: list[str]) -> int:
    """The restart run, in its own process: one JSON line per request as it finishes."""
    parser = argparse.ArgumentParser(prog="python -m promptstore.demo")
    parser.add_argument("--store", required=True)
    parser.add_argument("--model")
    args = parser.parse_args(argv)
    from .store import PromptStore

    model, tokenizer, model_id = load(args.model)
    serve(model, tokenizer, None, [[workload()[0][0]]])  # warm-up, as in the parent
    with PromptStore.open(args.store, checkpoint_interval=256) as store:
        space = store.bind(model, model_id=model_id)
        serve(model, tokenizer, space, workload(), lambda o: print(json.dumps(asdict(o)), flush=True))
    return 0


def blas_in_use() -> str:
    """Which BLAS MLX's float32 matmuls use on Linux (the libraries this process maps)."""
    if platform.system() != "Linux":
        return "the platform's (Accelerate on macOS)" if platform.system() == "Darwin" else "not checked"
    try:
        with open("/proc/self/maps") as f:
            mapped = f.read().lower()
    except OSError:
        return "not checked"
    # numpy's scipy_openblas exports only prefixed symbols, which MLX never calls.
    return "OpenBLAS" if "openblas" in mapped.replace("scipy_openblas", "") else "MLX's bundled BLAS"


def render(console: Console, result: DemoResult) -> None:
    """The table, what ran, and a note when the no-store baseline is slow for want of a fast BLAS."""
    requests = result.rows[0]["requests"]
    table = Table(
        title=f"promptstore demo: the same {requests} requests in each run",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
        pad_edge=False,
    )
    headers = ["run", "prompt\ntokens", "from\nmemory", "from\ndisk", "pre-\nfilled"]
    headers += ["TTFT\nmean", "TTFT\np95", "speed\n-up", "same\nreplies"]
    for col in headers:
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for row, eq in zip(result.rows, [None] + result.replies_equal):
        table.add_row(
            row["run"],
            f"{row['prompt_tokens']:,}",
            f"{row['restored_hot']:,}",
            f"{row['restored_cold']:,}",
            f"{row['prefilled']:,}",
            f"{row['ttft_mean_s'] * 1e3:.0f} ms",
            f"{row['ttft_p95_s'] * 1e3:.0f} ms",
            f"{row['speedup']:.1f}x",
            "-" if eq is None else ("[green]yes[/]" if eq else "[red]NO[/]"),
        )
    console.print(table)
    console.print(f"model: {result.model}\ndevice: {result.device}; BLAS: {result.blas}", highlight=False)
    note = blas_note(result)
    if note:
        console.print(f"[yellow]note:[/] {note}", highlight=False)


def blas_note(result: DemoResult) -> str | None:
    """Why the no-store baseline is slow on a CPU without OpenBLAS, and how to get the fair one."""
    if result.blas != "MLX's bundled BLAS" or result.device != "cpu":
        return None
    how = (
        f"`make demo` preloads it (or run with LD_PRELOAD={OPENBLAS})"
        if Path(OPENBLAS).exists()
        else "`make openblas` installs OpenBLAS, then `make demo` preloads it"
    )
    return (
        "the no-store baseline ran on MLX's bundled reference BLAS, which makes float32 prefill slow "
        f"on CPU, so the speed-ups above are larger than a fast BLAS would give. For the fair baseline: {how}."
    )


def save_model(path: str | Path) -> Path:
    """Write the demo's random-weight llama and its tokenizer as an MLX model
    directory, which `mlx_lm.load` and `promptstore generate --model` read."""
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            errno.EEXIST, "exists and is not an empty directory; expected a new one for the model", str(out)
        )
    from mlx_lm.utils import save_config
    from mlx_lm.utils import save_model as save_weights

    model, tokenizer, _ = load(None)
    save_weights(out, model)
    save_config({**asdict(model.args), "model_type": "llama"}, out / "config.json")
    tokenizer.save_pretrained(str(out))
    return out


if __name__ == "__main__":
    sys.exit(_restart_main(sys.argv[1:]))
