"""The demonstration `make demo` runs: a shared system prompt computed once,
kept as snapshots in a safetensors file, and restored for every conversation,
with replies checked token for token against full prefills.

It runs on a random-weight llama built in-process (no download). The store
that keeps snapshots across requests and processes builds on these caches.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from rich.console import Console
from rich.table import Table

from . import caches as C
from .testing.models import tiny_model

REPLY_TOKENS = 24


def _model():
    return tiny_model(
        "llama", num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, intermediate_size=512, vocab_size=1024,
    )


def _reply(model, cache, tokens: mx.array) -> tuple[list[int], float]:
    """Greedy reply to `tokens` and the time to its first token."""
    start = time.perf_counter()
    logits = model(tokens[None], cache=cache)[:, -1, :]
    out = [logits.argmax(-1).item()]
    ttft = time.perf_counter() - start
    for _ in range(REPLY_TOKENS - 1):
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1, :]
        out.append(logits.argmax(-1).item())
    return out, ttft


def _save(path: Path, snaps) -> None:
    arrays, metadata = C.to_flat(snaps)
    mx.save_safetensors(str(path), arrays, metadata)


def _load(path: Path):
    arrays, metadata = mx.load(str(path), return_metadata=True)
    return C.from_flat(arrays, metadata)


def run(system_tokens: int = 1536, user_tokens: int = 48, conversations: int = 4, console=None) -> bool:
    console = console or Console(width=120)
    model = _model()
    key = mx.random.key(7)
    system = mx.random.randint(0, 1024, (system_tokens,), key=key)
    users = [mx.random.randint(0, 1024, (user_tokens,), key=mx.random.key(100 + i)) for i in range(conversations)]
    prompts = [mx.concatenate([system, u]) for u in users]
    _reply(model, C.make_prompt_cache(model), prompts[0][:64])  # warm up

    console.print(f"[bold]Without snapshots[/]: {conversations} requests, each prefills {system_tokens + user_tokens} tokens")
    plain = [_reply(model, C.make_prompt_cache(model), p) for p in prompts]

    console.print("[bold]With snapshots[/]: the system prompt once, spilled to a file, restored per request")
    cache = C.make_prompt_cache(model)
    model(system[None], cache=cache)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "system.safetensors"
        _save(path, C.snapshot_prompt_cache(cache, 0))
        size = path.stat().st_size
        restored = []
        for p in prompts:
            start = time.perf_counter()
            hit = C.make_prompt_cache(model)
            if not C.restore_prompt_cache(hit, _load(path), system_tokens):
                raise RuntimeError("the stored system prompt did not restore")
            restore_s = time.perf_counter() - start
            reply, ttft = _reply(model, hit, p[system_tokens:])
            restored.append((reply, ttft + restore_s))

    same = all(a[0] == b[0] for a, b in zip(plain, restored))
    table = Table(title="promptstore demo (caches, one process)")
    for col in ("run", "requests", "prompt tokens", "restored", "prefilled", "mean TTFT", "p95 TTFT", "speed-up"):
        table.add_column(col, justify="right")
    total = conversations * (system_tokens + user_tokens)
    base = statistics.mean(t for _, t in plain)
    for name, runs, restored_n in (("full prefill", plain, 0), ("restored", restored, conversations * system_tokens)):
        times = sorted(t for _, t in runs)
        mean = statistics.mean(times)
        table.add_row(name, str(conversations), str(total), str(restored_n), str(total - restored_n),
                      f"{mean * 1e3:.1f} ms", f"{times[-1] * 1e3:.1f} ms", f"{base / mean:.1f}x")
    console.print(table)
    console.print(f"snapshot file: {size / 2**20:.1f} MiB; replies identical to full prefill: "
                  + ("[green]yes[/]" if same else "[red]NO[/]"))
    return same
