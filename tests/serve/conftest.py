"""Fixtures for `promptstore serve`: model directories mlx_lm.load reads, real
server processes on 127.0.0.1 (always killed), the openai client, and greedy
replies computed in this process without any cache to compare against."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from openai import OpenAI

from promptstore.store.compact import compact
from promptstore.testing.model_dir import write_model_dir

START_DEADLINE_S = 120.0
STOP_DEADLINE_S = 60.0
REQUEST_TIMEOUT_S = 120.0

SYSTEM = (
    "You are the librarian of a small harbour town. You know every book about sailing, boats, tides and the sea, "
    "and you answer visitors in a friendly way, with short sentences."
)
QUESTIONS = [
    "Do you have any books about sailing?",
    "What are the opening hours on Saturday?",
    "Can you tell me the weather for tomorrow?",
    "How do I make a simple tomato soup?",
]


# Every durability, and the server's default as a user meets it (no --durability):
# the shutdown, restart and SIGKILL tests run under each (test_shutdown checks the list).
DEFAULT = "default"
DURABILITIES = ["write_through", "write_back", "sync", "admit", DEFAULT]


def durability_args(durability: str) -> tuple[str, ...]:
    return () if durability == DEFAULT else ("--durability", durability)


# Quantization groups are at least 32 wide: --kv-bits needs head dim 32.
VARIANTS = {
    "llama-hd32": ("llama", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}),
    "llama-ctx64": ("llama", {"max_position_embeddings": 64}),  # a context a test fills quickly
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m promptstore serve` as a subprocess on a free loopback port."""

    def __init__(self, model: Path, store: Path, log: Path, *extra: str):
        self.model, self.store, self.log_path, self.extra = model, store, log, extra
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        """Start the process on a free port (without waiting for it to serve)."""
        self.port = free_port()
        cmd = [sys.executable, "-m", "promptstore", "serve", "--model", str(self.model)]
        cmd += ["--store", str(self.store), "--host", "127.0.0.1", "--port", str(self.port), *self.extra]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONFAULTHANDLER="1")
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start(self) -> Server:
        for _ in range(3):  # another process may take the free port first
            self.launch()
            if self._healthy():
                return self
            if "Address already in use" not in self.log():
                break
        raise AssertionError(f"server did not become healthy:\n{self.log()[-4000:]}")

    def _healthy(self) -> bool:
        deadline = time.monotonic() + START_DEADLINE_S
        with httpx.Client(trust_env=False, timeout=5) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self.kill()
        return False

    def health(self) -> int:
        with httpx.Client(trust_env=False, timeout=10) as http:
            return http.get(self.url + "/health").status_code

    def health_body(self) -> dict:
        with httpx.Client(trust_env=False, timeout=10) as http:
            return http.get(self.url + "/health").json()

    def client(self, api_key: str = "none") -> OpenAI:
        http = httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S)
        return OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, http_client=http)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """`sig`, then wait (SIGKILL past the deadline); returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server ignored SIGTERM for {STOP_DEADLINE_S} s:\n{self.log()[-4000:]}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_DEADLINE_S)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(family) -> a directory mlx_lm.load reads (written once per session)."""
    made: dict[str, Path] = {}

    def make(name: str = "llama") -> Path:
        if name not in made:
            family, overrides = VARIANTS.get(name, (name, {}))
            made[name] = write_model_dir(tmp_path_factory.mktemp(f"model-{name}"), family, **overrides)
        return made[name]

    return make


@pytest.fixture
def serve(tmp_path):
    """serve(model_dir, *options, store=None) -> a started Server; all are killed at the end."""
    servers: list[Server] = []

    def start(model: Path, *extra: str, store: Path | None = None) -> Server:
        server = Server(model, store or tmp_path / "store", tmp_path / f"server{len(servers)}.log", *extra)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.kill()


@functools.cache
def loaded(model: Path):
    return load(str(model))


def reference_reply(model: Path, messages: list[dict], max_tokens: int, **kwargs) -> list[int]:
    """Greedy tokens from a full prefill of the rendered prompt (no cache at all);
    kwargs go to mlx-lm's generate_step (kv_bits, ...)."""
    net, tokenizer = loaded(model)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = []
    greedy = lambda x: x.argmax(-1)  # noqa: E731
    for token, _ in generate_step(mx.array(prompt), net, max_tokens=max_tokens, sampler=greedy, **kwargs):
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return out


def rendered_length(model: Path, messages: list[dict]) -> int:
    """Tokens of `messages` as the chat template renders them (no generation prompt)."""
    _, tokenizer = loaded(model)
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=False))


def least_restored(model: Path, asked: list[dict], reply_ids: list[int], reply: str) -> int:
    """The least the next turn after this reply must restore: the conversation as
    the template renders it with the reply, or, where the reply's tokens come back
    as they were generated, what the model computed (the prompt and the reply but
    its last token, which no forward ran: the store keeps it with no forward and
    the next turn prefills the template's end-of-turn tokens)."""
    _, tokenizer = loaded(model)
    prompt = list(tokenizer.apply_chat_template(asked, add_generation_prompt=True))
    rendered = list(tokenizer.apply_chat_template([*asked, {"role": "assistant", "content": reply}]))
    computed = prompt + list(reply_ids[:-1])
    return len(computed) if rendered[: len(computed)] == computed else len(rendered)


def chat(client: OpenAI, messages: list[dict], max_tokens: int = 12, **kwargs):
    """(reply text, reply token ids, cached tokens) of one greedy chat completion."""
    r = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True, **kwargs
    )
    ids = [item.model_extra["id"] for item in r.choices[0].logprobs.content]
    return r.choices[0].message.content or "", ids, r.usage.prompt_tokens_details.cached_tokens


def store_problems(store: Path, clean_close: bool = True) -> dict:
    """What compact --verify --dry-run finds wrong with a store (empty: consistent)."""
    report = compact(store, verify=True, dry_run=True, lmdb=False, merge=False)
    bad = ("failed verify", "corrupt index records", "missing files")
    if clean_close:
        bad += ("nodes without data", "temporary files", "orphan files")
    found = {k: v for k, v in report.actions.items() if k.startswith(bad) and any(v.values())}
    if report.errors:
        found["errors"] = report.errors
    return found


def api_keys_file(path: Path, keys: dict[str, str]) -> Path:
    path.write_text(json.dumps(keys))
    return path
