"""Anchors: promptstore against what users already have, measured in one run.

Workloads (token ids drawn from a seeded generator: no tokenizer is loaded, so
the same script runs where only mlx and mlx-lm are installed):

- chat     conversations over shared system prompts; every turn resends the
           history (with the reply) plus a new user message.
- restart  the chat resumed in a fresh process: one more turn of every
           conversation, after the stores were closed and the process ended.
- fork     an agent conversation forked into a tree of branches (tool
           results, then retries of each), then back to earlier points.
- hybrid   the chat workload (the same prompts) on a sliding-window model
           (gemma3_text layout) and a recurrent hybrid (qwen3_next layout); it
           reports where promptstore restored against where each prompt diverges
           from what it stores, and its prefill cut against the dense model's.

Contenders, run one after another on the same requests and the same model:

- no cache           full prefill every request (it also gives the reference
                     replies every other contender must reproduce, greedy).
- mlx-lm LRU         mlx_lm.models.cache.LRUPromptCache used the way
                     mlx_lm.server (batched path, the one every model with
                     mergeable caches takes) uses it: fetch_nearest_cache
                     (deep copy, trim when the nearest entry is longer), the
                     system-prompt segment inserted when its prefill ends,
                     prompt + reply inserted after generation, server default
                     --prompt-cache-size 10. After a restart it holds nothing.
- mlx-lm files       mlx_lm's save_prompt_cache / load_prompt_cache, one file
                     per conversation (a fork starts from its parent's file),
                     trimmed to the common prefix where the cache allows.
- promptstore hot    PromptStore defaults (write_back, hot tier 2 GiB unless
                     the profile says otherwise), told the end of the system
                     segment as mlx-lm's server is (fetch(checkpoints=...)).
- promptstore cold   hot_bytes=0, spills flushed after every request: every
                     hit is read from its files.
- ceilings           per hit, the same restored bytes produced by one
                     mx.concatenate (the one-copy floor) and by mx.load of one
                     safetensors file holding them.

Every contender generates with mlx_lm.generate.generate_step (what
mlx_lm.stream_generate and the server run) and greedy sampling; prefill is
chunked by the same step everywhere. promptstore's contender makes exactly the
calls promptstore.stream_generate(checkpoints=[end of the system segment])
makes (fetch; prefill to each checkpoint and insert; generate; insert prompt +
reply), through the public Space API.

Reported per workload and contender: tokens prefilled, time to first token
(TTFT) p50 / p95 over all requests and over hits, bytes on disk, restore GB/s
next to the ceilings, and whether every reply equals the no-cache reply; then
the issue's goals, each marked met or MISSED.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python tools/bench/bench_anchors.py            # CPU, ~10 min
    .venv/bin/python tools/bench/bench_anchors.py --quick        # smoke, < 1 min
    python tools/bench/bench_anchors.py --profile cuda           # MLX CUDA backend

Writes bench-results/anchors-<profile>.json, a PNG beside it (with
matplotlib, through plot_anchors.py) and, for the cpu and cuda profiles,
docs/benchmarks.md from whichever of anchors-cpu.json / anchors-cuda.json exist.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, blas_info, blas_warning, gpu_name, timed, write_results  # noqa: E402
from gpu_docs import sections as gpu_sections  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import cache as mlc  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.caches import prompt_position  # noqa: E402
from promptstore.testing.models import llama_1b_shape, tiny_model  # noqa: E402

GiB = 1 << 30
# Chat-template tokens; content tokens are drawn from [FIRST_CONTENT, vocab).
BOS, SYS, USER, ASSISTANT, EOT = 1, 2, 3, 4, 5
FIRST_CONTENT = 16
LRU_KEY = ("anchors-model", None, None)  # mlx_lm.server's model_key: (path, adapter, draft)
SERVER_PROMPT_CACHE_SIZE = 10  # mlx_lm.server --prompt-cache-size default


# --------------------------------------------------------------------------------------
# profiles


@dataclass(frozen=True)
class Profile:
    name: str
    layers: int  # llama with Llama-3.2-1B's per-layer shape
    dtype: str
    vocab: int
    system_tokens: tuple[int, ...]  # one system prompt per entry
    conversations: int
    turns: int  # chat turns before the restart; the restart adds one more
    user_tokens: int
    reply_tokens: int
    prefill_step: int
    checkpoint_interval: int | None  # None: promptstore's default (its prefill step)
    hot_bytes: int
    fork_system: int
    fork_width: int  # branches off the root
    fork_retries: int  # retries off each branch
    hybrid_conversations: int
    hybrid_turns: int
    hybrid_hidden: int
    hybrid_window: int
    ceiling_samples: int  # distinct restored sizes timed against the ceilings
    ceiling_runs: int
    workloads: tuple[str, ...]
    note: str = ""
    control_step: int = 0  # > 0: also run no cache with this prefill step (a numerics control)


PROFILES = {
    "cpu": Profile(
        name="cpu",
        layers=2,
        dtype="float32",
        vocab=4096,
        system_tokens=(1024, 1536, 2048),
        conversations=16,
        turns=3,
        user_tokens=32,
        reply_tokens=4,
        prefill_step=512,
        checkpoint_interval=None,
        hot_bytes=2 * GiB,
        fork_system=1536,
        fork_width=3,
        fork_retries=2,
        hybrid_conversations=16,
        hybrid_turns=3,
        hybrid_hidden=256,
        hybrid_window=512,
        ceiling_samples=24,
        ceiling_runs=5,
        workloads=("chat", "restart", "fork", "hybrid"),
        note="float32 on CPU (fp16 matmul has no fast CPU kernel) with OpenBLAS; 2 layers of "
        "Llama-3.2-1B's shape (with 1, MLX's lazy evaluation would skip all but the key/value "
        "projections of a prefill); 16 conversations x 3 turns over 3 system prompts of 1k-2k tokens "
        "(the issue's example: 24 x 6 over 1k-4k), one more turn after the restart; replies of 4 "
        "tokens; hybrids: the same chat (16 x 3, same prompts) on models 256 wide",
    ),
    "quick": Profile(
        name="quick",
        layers=1,
        dtype="float32",
        vocab=1024,
        system_tokens=(192, 256, 320),
        conversations=6,
        turns=2,
        user_tokens=16,
        reply_tokens=4,
        prefill_step=512,
        checkpoint_interval=64,
        hot_bytes=2 * GiB,
        fork_system=256,
        fork_width=2,
        fork_retries=1,
        hybrid_conversations=6,
        hybrid_turns=2,
        hybrid_hidden=128,
        hybrid_window=128,
        ceiling_samples=6,
        ceiling_runs=3,
        workloads=("chat", "restart", "fork", "hybrid"),
        note="smoke run: tiny prompts, figures meaningless",
    ),
    "cuda": Profile(
        name="cuda",
        layers=16,
        dtype="float16",
        vocab=32000,
        system_tokens=(32768, 32768, 32768),
        conversations=12,
        turns=3,
        user_tokens=64,
        reply_tokens=16,
        prefill_step=2048,
        checkpoint_interval=1024,
        hot_bytes=24 * GiB,
        fork_system=32768,
        fork_width=3,
        fork_retries=2,
        hybrid_conversations=12,
        hybrid_turns=3,
        hybrid_hidden=1024,
        hybrid_window=1024,
        ceiling_samples=6,
        ceiling_runs=3,
        workloads=("chat", "restart"),
        control_step=512,
        note="float16 on the GPU; all 16 layers of Llama-3.2-1B's shape; 3 system prompts of "
        "32k tokens; 12 conversations x 3 turns, one more turn after the restart; "
        "promptstore hot tier 24 GiB",
    ),
}


# --------------------------------------------------------------------------------------
# workloads: requests made of token ids


@dataclass
class Request:
    name: str
    conv: str  # the conversation it belongs to (one mlx-lm file per conversation)
    parent: str | None  # where a fork starts (its parent's file)
    prompt: list[int]
    sys_end: int  # end of the system segment (mlx_lm.server's segmentation)


class Script:
    """A workload whose prompts depend on earlier (reference) replies.

    `steps` yields request builders in order; each builds its prompt from the
    transcript of reference replies, so every contender sends the same tokens.
    """

    def __init__(self, name: str):
        self.name = name
        self.replies: dict[str, list[int]] = {}

    def requests(self) -> list[Request]:
        raise NotImplementedError


def _content(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(FIRST_CONTENT, vocab, size=n)]


class ChatScript(Script):
    """Conversations over shared system prompts, turn by turn, interleaved."""

    def __init__(
        self,
        profile: Profile,
        vocab: int,
        conversations: int,
        turns: int,
        name: str = "chat",
        first_turn: int = 0,
        seed: int = 1,
    ):
        super().__init__(name)
        rng = np.random.default_rng(seed)
        self.systems = [_content(rng, n, vocab) for n in profile.system_tokens]
        self.conversations, self.turns, self.first_turn = conversations, turns, first_turn
        total_turns = first_turn + turns + 1  # messages for the restart turn too
        self.users = [
            [_content(rng, profile.user_tokens, vocab) for _ in range(total_turns + 1)] for _ in range(conversations)
        ]

    def head(self, c: int) -> list[int]:
        return [BOS, SYS] + self.systems[c % len(self.systems)] + [EOT]

    def prompt(self, c: int, t: int, replies: dict[str, list[int]]) -> list[int]:
        tokens = self.head(c)
        for i in range(t):
            tokens += [USER] + self.users[c][i] + [EOT, ASSISTANT] + replies[f"chat{c}.turn{i}"] + [EOT]
        return tokens + [USER] + self.users[c][t] + [EOT, ASSISTANT]

    def request(self, c: int, t: int, replies) -> Request:
        head = self.head(c)
        # mlx_lm.server: the system segment ends where the system-only template
        # (with an empty user message) first differs from the prompt.
        return Request(f"chat{c}.turn{t}", f"chat{c}", None, self.prompt(c, t, replies), len(head) + 1)

    def steps(self):
        for t in range(self.first_turn, self.first_turn + self.turns):
            for c in range(self.conversations):
                yield lambda replies, c=c, t=t: self.request(c, t, replies)


class ForkScript(Script):
    """A root request, `width` branches off it, `retries` off each branch (depth
    first), then back to the root and to the first branch."""

    def __init__(self, profile: Profile, vocab: int, seed: int = 2):
        super().__init__("fork")
        rng = np.random.default_rng(seed)
        self.system = _content(rng, profile.fork_system, vocab)
        self.task = _content(rng, 2 * profile.user_tokens, vocab)
        nodes: list[tuple[str, str | None]] = [("root", None)]
        for b in range(profile.fork_width):
            nodes.append((f"b{b}", "root"))
            nodes += [(f"b{b}.r{r}", f"b{b}") for r in range(profile.fork_retries)]
        nodes += [("root.back", "root"), ("b0.back", "b0")]
        self.nodes = nodes
        self.messages = {name: _content(rng, profile.user_tokens, vocab) for name, _ in nodes}
        self.parents = dict(nodes)
        self.prompts: dict[str, list[int]] = {}

    def steps(self):
        for name, parent in self.nodes:
            yield lambda replies, name=name, parent=parent: self.request(name, parent, replies)

    def request(self, name: str, parent: str | None, replies) -> Request:
        if parent is None:
            prompt = [BOS, SYS] + self.system + [EOT, USER] + self.task + [EOT, ASSISTANT]
        else:
            prompt = self.prompts[parent] + replies[parent] + [EOT, USER] + self.messages[name] + [EOT, ASSISTANT]
        self.prompts[name] = prompt
        return Request(name, name, parent, prompt, len(self.system) + 4)


# --------------------------------------------------------------------------------------
# models


def dtype_of(name: str) -> mx.Dtype:
    return getattr(mx, name)


def build_model(profile: Profile, family: str = "llama"):
    """(model, model_id, description)."""
    dtype = dtype_of(profile.dtype)
    if family == "llama":
        model = llama_1b_shape(profile.layers, dtype=dtype, vocab_size=profile.vocab)
        desc = (
            f"llama, Llama-3.2-1B per-layer shape (hidden 2048, 32 heads, 8 KV heads, head dim 64, "
            f"MLP 8192), {profile.layers} layer(s), vocab {profile.vocab}, {profile.dtype}"
        )
    else:
        h = profile.hybrid_hidden
        common = dict(
            hidden_size=h,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=h // 8,
            intermediate_size=4 * h,
            vocab_size=profile.vocab,
            max_position_embeddings=131072,
        )
        if family == "gemma3_text":
            model = tiny_model(
                family,
                dtype=dtype,
                **common,
                num_hidden_layers=6,
                sliding_window=profile.hybrid_window,
                sliding_window_pattern=6,
                query_pre_attn_scalar=h // 8,
            )
            desc = (
                f"gemma3_text layout: 6 layers {h} wide, 5 sliding-window ({profile.hybrid_window}) "
                f"+ 1 global, {profile.dtype}"
            )
        elif family == "qwen3_next":
            model = tiny_model(
                family,
                dtype=dtype,
                **common,
                num_hidden_layers=4,
                full_attention_interval=4,
                linear_num_value_heads=8,
                linear_num_key_heads=4,
                linear_key_head_dim=h // 8,
                linear_value_head_dim=h // 8,
                shared_expert_intermediate_size=4 * h,
            )
            desc = f"qwen3_next layout: 4 layers {h} wide, 3 gated-delta (recurrent) + 1 attention, {profile.dtype}"
        else:
            raise ValueError(family)
    return model, f"anchors-{family}-{profile.name}-{profile.layers}-{profile.dtype}-seed0", desc


# --------------------------------------------------------------------------------------
# contenders


def state_arrays(cache) -> list[mx.array]:
    """The arrays that hold a cache's state at its offset (what a restore makes)."""
    from mlx.utils import tree_flatten

    out = []
    for c in cache:
        if getattr(c, "empty", None) is not None and c.empty():
            continue
        out += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    return out


def signature(arrays: list[mx.array]) -> list:
    return [[list(a.shape), str(a.dtype).rsplit(".", 1)[-1]] for a in arrays]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if diff.size else n


def tree_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass
class Outcome:
    name: str
    prompt_tokens: int
    restored: int = 0
    matched: int = 0  # promptstore: prompt tokens it stores (where the prompt diverges from them)
    cold_tokens: int = 0
    restore_s: float = 0.0
    restored_bytes: int = 0
    sig: list = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    reply: list = field(default_factory=list)
    margins: list = field(default_factory=list)  # top-2 logprob margin at each generated token
    lp_diff0: float | None = None  # max |logprob - no cache's| over the first token's distribution
    diverge: int | None = None  # first reply token that differs from no cache's
    margin_ref: float | None = None  # no cache's top-2 margin there
    margin_at: float | None = None  # this contender's top-2 margin there


class Engine:
    """The generation every contender shares: mlx-lm's generate_step, greedy."""

    def __init__(self, model, profile: Profile):
        self.model, self.profile = model, profile

    def generate(self, cache, tokens: list[int], t0: float, out: Outcome) -> None:
        """Greedy reply to `tokens` (the prompt past what `cache` holds) into
        `out`: reply, TTFT from `t0`, and (after the first token, untimed
        where it matters) the top-2 logprob margins and the first token's
        logprobs (kept in `last_lp0` to compare with no cache's)."""
        gen = generate_step(
            mx.array(tokens),
            self.model,
            prompt_cache=cache,
            max_tokens=self.profile.reply_tokens,
            prefill_step_size=self.profile.prefill_step,
        )
        reply, margins, ttft = [], [], None
        for token, logprobs in gen:
            if ttft is None:
                ttft = time.perf_counter() - t0
                self.last_lp0 = np.array(logprobs.astype(mx.float32))
            top2 = mx.topk(logprobs.astype(mx.float32), 2)
            margins.append(float(mx.max(top2) - mx.min(top2)))
            reply.append(int(token))
        out.reply, out.ttft_s, out.margins = reply, ttft, margins

    def prefill(self, cache, tokens: list[int], start: int, end: int) -> None:
        """tokens[start:end] through the model in prefill steps (as promptstore's
        stream_generate prefills between checkpoints)."""
        step = self.profile.prefill_step
        for lo in range(start, end, step):
            self.model(mx.array(tokens[lo : min(lo + step, end)])[None], cache=cache)
            mx.eval([c.state for c in cache])


class Contender:
    name = "?"
    persistent = False

    def __init__(self, engine: Engine):
        self.engine = engine

    def serve(self, req: Request) -> Outcome:
        raise NotImplementedError

    def probe(self, req: Request) -> int:
        """Tokens of `req` this contender could restore right now (nothing is run)."""
        return 0

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass

    @staticmethod
    def _restored(out: Outcome, cache, restored: int, t0: float) -> None:
        arrays = state_arrays(cache) if restored else []
        mx.eval(arrays)
        out.restore_s = time.perf_counter() - t0
        out.restored = restored
        out.restored_bytes = sum(a.nbytes for a in arrays)
        out.sig = signature(arrays)


class NoCache(Contender):
    name = "no cache"

    def serve(self, req):
        out = Outcome(req.name, len(req.prompt))
        t0 = time.perf_counter()
        cache = mlc.make_prompt_cache(self.engine.model)
        self.engine.generate(cache, req.prompt, t0, out)
        out.total_s = time.perf_counter() - t0
        return out


class LRU(Contender):
    """mlx-lm's LRUPromptCache, as mlx_lm.server's batched path uses it."""

    name = "mlx-lm LRUPromptCache"

    def __init__(self, engine, max_size: int = SERVER_PROMPT_CACHE_SIZE):
        super().__init__(engine)
        self.lru = mlc.LRUPromptCache(max_size)

    def serve(self, req):
        out = Outcome(req.name, len(req.prompt))
        prompt = req.prompt
        t0 = time.perf_counter()
        cache, rest = self.lru.fetch_nearest_cache(LRU_KEY, prompt)
        restored = len(prompt) - len(rest)
        if cache is None:
            cache = mlc.make_prompt_cache(self.engine.model)
        assert rest, "an exact hit leaves nothing to prefill (never happens in these workloads)"
        self._restored(out, cache, restored, t0)
        position = restored
        if 0 < req.sys_end < len(prompt) and position < req.sys_end:
            # The server saves the cache at the end of the system segment
            # (BatchGenerator.extract_cache: a copy) with type "system".
            self.engine.prefill(cache, prompt, position, req.sys_end)
            self.lru.insert_cache(LRU_KEY, prompt[: req.sys_end], copy.deepcopy(cache), cache_type="system")
            position = req.sys_end
        self.engine.generate(cache, prompt[position:], t0, out)
        self.lru.insert_cache(LRU_KEY, prompt + out.reply, cache, cache_type="assistant")
        out.total_s = time.perf_counter() - t0
        return out

    def probe(self, req):
        cache, rest = self.lru.fetch_nearest_cache(LRU_KEY, req.prompt)
        return 0 if cache is None else len(req.prompt) - len(rest)


class Files(Contender):
    """mlx-lm's save_prompt_cache / load_prompt_cache, one file per conversation."""

    name = "mlx-lm cache files"
    persistent = True

    def __init__(self, engine, root: Path, held: dict | None = None):
        super().__init__(engine)
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.held: dict[str, list[int]] = held if held is not None else {}  # what each file holds

    def path(self, conv: str) -> Path:
        return self.root / f"{conv}.safetensors"

    def _source(self, req: Request) -> tuple[str | None, int]:
        """The file to start from and how many of its tokens the prompt shares."""
        for conv in (req.conv, req.parent):
            if conv is not None and conv in self.held and self.path(conv).exists():
                return conv, min(common_prefix(self.held[conv], req.prompt), len(req.prompt) - 1)
        return None, 0

    def serve(self, req):
        out = Outcome(req.name, len(req.prompt))
        t0 = time.perf_counter()
        conv, shared = self._source(req)
        cache, restored = None, 0
        if conv is not None and shared > 0:
            cache = mlc.load_prompt_cache(str(self.path(conv)))
            extra = len(self.held[conv]) - shared
            if extra == 0:
                restored = shared
            elif mlc.can_trim_prompt_cache(cache):
                mlc.trim_prompt_cache(cache, extra)
                restored = shared
            else:
                cache = None
        if cache is None:
            cache, restored = mlc.make_prompt_cache(self.engine.model), 0
        self._restored(out, cache, restored, t0)
        self.engine.generate(cache, req.prompt[restored:], t0, out)
        mlc.save_prompt_cache(str(self.path(req.conv)), cache, {"tokens": str(len(req.prompt) + len(out.reply))})
        self.held[req.conv] = req.prompt + out.reply
        out.total_s = time.perf_counter() - t0
        return out

    def probe(self, req):
        conv, shared = self._source(req)
        if conv is None:
            return 0
        if shared == len(self.held[conv]):
            return shared
        cache = mlc.load_prompt_cache(str(self.path(conv)))
        return shared if mlc.can_trim_prompt_cache(cache) else 0

    def disk_bytes(self):
        return tree_bytes(self.root)


class Store(Contender):
    """promptstore: the calls promptstore.stream_generate makes, in its order."""

    persistent = True

    def __init__(self, engine, root: Path, model_id: str, *, cold_only: bool = False, hot_bytes: int = 2 * GiB):
        super().__init__(engine)
        self.root, self.model_id, self.cold_only = root, model_id, cold_only
        self.name = "promptstore cold only" if cold_only else "promptstore hot"
        self.settings = dict(hot_bytes=0 if cold_only else hot_bytes, prefill_step=engine.profile.prefill_step)
        if engine.profile.checkpoint_interval is not None:
            self.settings["checkpoint_interval"] = engine.profile.checkpoint_interval
        self.store = PromptStore.open(root, **self.settings)
        self.space = self.store.bind(engine.model, model_id=model_id)

    def serve(self, req):
        out = Outcome(req.name, len(req.prompt))
        tokens, space = req.prompt, self.space
        t0 = time.perf_counter()
        # The end of the system segment, as the mlx-lm server is told it (see LRU).
        hit = space.fetch(tokens, checkpoints=(req.sys_end,) if 0 < req.sys_end < len(tokens) else ())
        cache, position = hit.cache, hit.length
        self._restored(out, cache, hit.length, t0)
        out.cold_tokens, out.matched = hit.cold_tokens, hit.matched
        for point in [p for p in hit.checkpoints if p < len(tokens) - 1] + [len(tokens) - 1]:
            if point <= position:
                continue
            started = time.perf_counter()
            self.engine.prefill(cache, tokens, position, point)
            space.insert(tokens[:point], cache, prefill_seconds=time.perf_counter() - started)
            position = point
        self.engine.generate(cache, tokens[position:], t0, out)
        seen = tokens + out.reply
        held = prompt_position(cache)
        if 0 < held <= len(seen):
            space.insert(seen[:held], cache)
        out.total_s = time.perf_counter() - t0
        if self.cold_only:
            self.store.flush()  # untimed: the next hit must come from its file
        return out

    def probe(self, req):
        return self.space.fetch(req.prompt).length

    def disk_bytes(self):
        return tree_bytes(self.root)

    def close(self):
        self.store.close()


# --------------------------------------------------------------------------------------
# running a workload


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Reference:
    """No cache's outcomes and first-token logprobs, to compare the others with."""

    def __init__(self):
        self.outs: dict[str, Outcome] = {}
        self.lp0: dict[str, np.ndarray] = {}

    def keep(self, out: Outcome, lp0: np.ndarray) -> None:
        self.outs[out.name], self.lp0[out.name] = out, lp0

    def compare(self, out: Outcome, lp0: np.ndarray) -> None:
        ref = self.outs.get(out.name)
        if ref is None:
            return
        out.lp_diff0 = float(np.max(np.abs(lp0 - self.lp0[out.name])))
        for i, (a, b) in enumerate(zip(out.reply, ref.reply)):
            if a != b:
                out.diverge, out.margin_ref, out.margin_at = i, ref.margins[i], out.margins[i]
                break


def serve_all(contender: Contender, requests, reference: Reference, is_reference: bool, label: str) -> list[Outcome]:
    started = time.perf_counter()
    outs = []
    for req in requests:
        out = contender.serve(req)
        lp0 = contender.engine.last_lp0
        reference.keep(out, lp0) if is_reference else reference.compare(out, lp0)
        outs.append(out)
    log(f"  {label}: {contender.name}: {len(outs)} requests in {time.perf_counter() - started:.1f}s")
    return outs


def run_script(script: Script, contenders: list[Contender]) -> dict:
    """Run every request through every contender; the first (no cache) is
    the reference. Returns {contender: [Outcome]}."""
    results: dict[str, list[Outcome]] = {}
    reference = Reference()
    for i, contender in enumerate(contenders):

        def requests(first=i == 0):
            for build in script.steps():
                req = build(script.replies)
                yield req
                if first:
                    script.replies[req.name] = reference.outs[req.name].reply

        results[contender.name] = serve_all(contender, requests(), reference, i == 0, script.name)
    return results


def warm_up(engine: Engine) -> None:
    """Compile and fault in the model once (untimed)."""
    cache = mlc.make_prompt_cache(engine.model)
    engine.generate(cache, list(range(FIRST_CONTENT, FIRST_CONTENT + 64)), time.perf_counter(), Outcome("warm-up", 64))


# --------------------------------------------------------------------------------------
# ceilings


def _mx_dtype(name: str) -> mx.Dtype:
    return getattr(mx, name)


def measure_ceiling(sig: list, tmp: Path, runs: int) -> dict:
    """One mx.concatenate producing these arrays, and mx.load of one file of them."""
    key = mx.random.key(7)
    pairs, whole = [], {}
    for i, (shape, dtype) in enumerate(sig):
        key, sub = mx.random.split(key)
        arr = mx.random.uniform(shape=shape, key=sub).astype(_mx_dtype(dtype))
        axis = int(np.argmax(shape))
        half = max(1, shape[axis] // 2) if shape[axis] > 1 else 0
        if half:
            a, b = mx.split(arr, [half], axis=axis)
            a, b = mx.contiguous(a), mx.contiguous(b)
        else:
            a, b = mx.contiguous(arr), None
        mx.eval(arr, a, b if b is not None else a)
        pairs.append((a, b, axis))
        whole[f"a{i}"] = arr
    nbytes = sum(a.nbytes for a in whole.values())

    def concat():
        return [mx.concatenate([a, b], axis=ax) if b is not None else mx.array(a) for a, b, ax in pairs]

    floor = timed(concat, runs=runs, warmup=1)
    path = tmp / "ceiling.safetensors"
    mx.save_safetensors(str(path), whole)
    load = timed(lambda: list(mx.load(str(path)).values()), runs=runs, warmup=1)
    path.unlink()
    return {"bytes": nbytes, "floor_s": floor["median_s"], "load_s": load["median_s"]}


def ceilings_for(outcomes: dict[str, list[Outcome]], profile: Profile, tmp: Path) -> list[dict]:
    """Time the ceilings for up to `ceiling_samples` distinct restored layouts,
    spread over their sizes; every hit is then matched to the nearest size."""
    sigs = {}
    for outs in outcomes.values():
        for o in outs:
            if o.restored:
                sigs[json.dumps(o.sig)] = (o.restored_bytes, o.sig)
    chosen = sorted(sigs.values(), key=lambda bs: bs[0])
    if len(chosen) > profile.ceiling_samples:
        idx = np.unique(np.linspace(0, len(chosen) - 1, profile.ceiling_samples).round().astype(int))
        chosen = [chosen[i] for i in idx]
    return [measure_ceiling(sig, tmp, profile.ceiling_runs) for _, sig in chosen]


def ceiling_times(nbytes: int, samples: list[dict]) -> tuple[float, float]:
    """(floor_s, load_s) for `nbytes`, scaled from the nearest measured size."""
    s = min(samples, key=lambda x: abs(x["bytes"] - nbytes))
    scale = nbytes / s["bytes"] if s["bytes"] else 1.0
    return s["floor_s"] * scale, s["load_s"] * scale


# --------------------------------------------------------------------------------------
# summaries


def pct(values, q) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summarize_contender(
    name: str,
    outs: list[Outcome],
    reference: dict[str, list[int]],
    nocache_prefilled: int,
    samples: list[dict],
    disk: int | None,
) -> dict:
    hits = [o for o in outs if o.restored]
    # Tokens restored from files: all of them for mlx-lm's files, none for the
    # LRU, what the store read from its cold tier for promptstore.
    from_files = {"mlx-lm cache files": lambda o: o.restored, "mlx-lm LRUPromptCache": lambda o: 0}
    disk_tokens = sum(from_files.get(name.split(" (")[0], lambda o: o.cold_tokens)(o) for o in outs)
    prompt = sum(o.prompt_tokens for o in outs)
    restored = sum(o.restored for o in outs)
    prefilled = prompt - restored
    ttft = [o.ttft_s for o in outs]
    hit_ttft = [o.ttft_s for o in hits]
    mismatched = [o.name for o in outs if o.name in reference and o.reply != reference[o.name]]
    row = {
        "contender": name,
        "requests": len(outs),
        "hits": len(hits),
        "prompt_tokens": prompt,
        "restored_tokens": restored,
        "cold_tokens": sum(o.cold_tokens for o in outs),
        "disk_restored_tokens": disk_tokens,
        "prefilled_tokens": prefilled,
        "prefill_cut": 1 - prefilled / nocache_prefilled if nocache_prefilled else None,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p95_s": pct(ttft, 95),
        "hit_ttft_p50_s": pct(hit_ttft, 50),
        "hit_ttft_p95_s": pct(hit_ttft, 95),
        "disk_bytes": disk,
        "replies_equal": not mismatched,
        "replies_mismatched": mismatched,
        "max_first_token_logprob_diff": max((o.lp_diff0 for o in outs if o.lp_diff0 is not None), default=None),
        "mismatch_detail": [
            {
                "request": o.name,
                "token": o.diverge,
                "margin_no_cache": o.margin_ref,
                "margin_here": o.margin_at,
                "restored": o.restored,
            }
            for o in outs
            if o.diverge is not None
        ],
    }
    if hits and samples:
        rb = sum(o.restored_bytes for o in hits)
        rs = sum(o.restore_s for o in hits)
        floors = [ceiling_times(o.restored_bytes, samples) for o in hits]
        fs, ls = sum(f for f, _ in floors), sum(lo for _, lo in floors)
        row.update(
            {
                "restored_bytes": rb,
                "restore_s": rs,
                "restore_gbps": rb / rs / 1e9 if rs else None,
                "restore_vs_floor": rs / fs if fs else None,
                "restore_vs_load": rs / ls if ls else None,
                # each hit's TTFT against the same hit with its restore done at the ceiling
                "hit_ttft_vs_floor_p50": pct(
                    [o.ttft_s / (o.ttft_s - o.restore_s + f) for o, (f, _) in zip(hits, floors)], 50
                ),
                "hit_ttft_vs_load_p50": pct(
                    [o.ttft_s / (o.ttft_s - o.restore_s + lo) for o, (_, lo) in zip(hits, floors)], 50
                ),
            }
        )
    return row


def ceiling_rows(outs: list[Outcome], samples: list[dict]) -> list[dict]:
    """The ceilings as rows, over the hits of `outs` (promptstore hot's)."""
    hits = [o for o in outs if o.restored]
    if not hits or not samples:
        return []
    rb = sum(o.restored_bytes for o in hits)
    rows = []
    for label, idx in (("ceiling: one mx.concatenate (one-copy floor)", 0), ("ceiling: mx.load of one file", 1)):
        times = [ceiling_times(o.restored_bytes, samples)[idx] for o in hits]
        derived = [o.ttft_s - o.restore_s + t for o, t in zip(hits, times)]
        rows.append(
            {
                "contender": label,
                "ceiling": True,
                "requests": len(hits),
                "hits": len(hits),
                "restored_bytes": rb,
                "restore_s": sum(times),
                "restore_gbps": rb / sum(times) / 1e9,
                "hit_ttft_p50_s": pct(derived, 50),
                "hit_ttft_p95_s": pct(derived, 95),
            }
        )
    return rows


def summarize_workload(
    name: str,
    desc: str,
    results: dict[str, list[Outcome]],
    reference: dict,
    samples: list[dict],
    disks: dict[str, int | None],
    wall: float,
    extra: dict | None = None,
) -> dict:
    base = results["no cache"]
    nocache_prefilled = sum(o.prompt_tokens for o in base)
    rows = [
        summarize_contender(n, outs, reference, nocache_prefilled, samples, disks.get(n)) for n, outs in results.items()
    ]
    hot = results.get("promptstore hot") or results.get("promptstore (restarted)")
    rows += ceiling_rows(hot or [], samples)
    return {
        "workload": name,
        "model": desc,
        "rows": rows,
        "ceiling_samples": samples,
        "wall_s": wall,
        "outcomes": {n: [asdict(o) for o in outs] for n, outs in results.items()},
        **(extra or {}),
    }


# --------------------------------------------------------------------------------------
# the workloads


def contenders_for(engine: Engine, model_id: str, root: Path, profile: Profile) -> list[Contender]:
    control = []
    if profile.control_step:
        # Full prefill again, chunked differently: how often float rounding alone
        # flips a greedy reply (it changes nothing a cache does).
        other = NoCache(Engine(engine.model, replace(profile, prefill_step=profile.control_step)))
        other.name = f"no cache, prefill step {profile.control_step} (control)"
        control = [other]
    return [
        NoCache(engine),
        *control,
        LRU(engine),
        Files(engine, root / "files"),
        Store(engine, root / "store-hot", model_id, hot_bytes=profile.hot_bytes),
        Store(engine, root / "store-cold", model_id, cold_only=True),
    ]


def run_chat_like(
    script: Script, engine: Engine, model_id: str, desc: str, root: Path, profile: Profile, keep_open: bool = False
):
    started = time.perf_counter()
    contenders = contenders_for(engine, model_id, root, profile)
    results = run_script(script, contenders)
    reference = dict(script.replies)
    if keep_open:
        return contenders, results, reference, started
    return finish_workload(script.name, desc, contenders, results, reference, root, profile, started)


def finish_workload(name, desc, contenders, results, reference, root, profile, started, extra=None):
    for c in contenders:
        c.close()
    disks = {c.name: c.disk_bytes() for c in contenders}
    samples = ceilings_for(results, profile, root)
    return summarize_workload(name, desc, results, reference, samples, disks, time.perf_counter() - started, extra)


def run_restart(
    profile: Profile, chat: ChatScript, contenders: list[Contender], root: Path, model_id: str, desc: str
) -> dict:
    """Resume the chat for one more turn in a fresh process, on what the stores
    left on disk. Before closing, probe what an uninterrupted process would
    restore for those requests; the fresh process probes again first."""
    started = time.perf_counter()
    resumed = ChatScript(profile, profile.vocab, profile.conversations, 1, name="restart", first_turn=profile.turns)
    resumed.systems, resumed.users = chat.systems, chat.users
    requests = [build(chat.replies) for build in resumed.steps()]
    by_name = {c.name: c for c in contenders}
    before = {
        name: sum(by_name[name].probe(r) for r in requests)
        for name in ("mlx-lm LRUPromptCache", "mlx-lm cache files", "promptstore hot")
    }
    files, hot = by_name["mlx-lm cache files"], by_name["promptstore hot"]
    state = {
        "profile": profile.name,
        "model_id": model_id,
        "requests": [asdict(r) for r in requests],
        "files_dir": str(files.root),
        "files_held": files.held,
        "store_dir": str(hot.root),
        "store_settings": hot.settings,
    }
    state_path = root / "restart-state.json"
    state_path.write_text(json.dumps(state))
    result_path = root / "restart-result.json"
    return state_path, result_path, before, started, requests


def restart_phase(state_path: Path, result_path: Path, profile: Profile) -> None:
    """The fresh process: probe what survived, then serve the resumed turn."""
    state = json.loads(state_path.read_text())
    model, model_id, _ = build_model(profile)
    assert model_id == state["model_id"]
    engine = Engine(model, profile)
    warm_up(engine)
    requests = [Request(**r) for r in state["requests"]]
    files = Files(engine, Path(state["files_dir"]), held=state["files_held"])
    # Probe the store from a hot-less instance, so the run below starts cold.
    probe = PromptStore.open(state["store_dir"], **dict(state["store_settings"], hot_bytes=0))
    probe_space = probe.bind(model, model_id=model_id)
    after = {
        "mlx-lm LRUPromptCache": sum(LRU(engine).probe(r) for r in requests),
        "mlx-lm cache files": sum(files.probe(r) for r in requests),
        "promptstore hot": sum(probe_space.fetch(r.prompt).length for r in requests),
    }
    probe.close()
    store = Store(engine, Path(state["store_dir"]), model_id, hot_bytes=state["store_settings"]["hot_bytes"])
    store.name = "promptstore (restarted)"
    lru = LRU(engine)
    lru.name = "mlx-lm LRUPromptCache (restarted: empty)"
    contenders = [NoCache(engine), lru, files, store]
    results, reference = {}, Reference()
    for i, c in enumerate(contenders):
        results[c.name] = serve_all(c, requests, reference, i == 0, "restart (fresh process)")
    store.close()
    result_path.write_text(
        json.dumps(
            {
                "after": after,
                "results": {n: [asdict(o) for o in outs] for n, outs in results.items()},
                "disks": {c.name: c.disk_bytes() for c in contenders},
            }
        )
    )


def finish_restart(state_path, result_path, before, started, profile, root, desc) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--profile",
        profile.name,
        "--phase",
        "restart",
        "--state",
        str(state_path),
        "--result",
        str(result_path),
    ]
    log("  restart: starting a fresh process")
    subprocess.run(cmd, check=True)
    got = json.loads(result_path.read_text())
    results = {n: [Outcome(**o) for o in outs] for n, outs in got["results"].items()}
    reference = {o.name: o.reply for o in results["no cache"]}
    names = {
        "mlx-lm LRUPromptCache": "mlx-lm LRUPromptCache (restarted: empty)",
        "mlx-lm cache files": "mlx-lm cache files",
        "promptstore hot": "promptstore (restarted)",
    }
    survived = {
        names[k]: {
            "restorable_before": before[k],
            "restorable_after": got["after"][k],
            "kept": got["after"][k] / before[k] if before[k] else None,
        }
        for k in before
    }
    samples = ceilings_for(results, profile, root)
    summary = summarize_workload(
        "restart",
        desc,
        results,
        reference,
        samples,
        got["disks"],
        time.perf_counter() - started,
        {"survived": survived},
    )
    for row in summary["rows"]:
        if row["contender"] in survived:
            row["kept_after_restart"] = survived[row["contender"]]["kept"]
    return summary


# --------------------------------------------------------------------------------------
# goals and report


GOALS = [
    ("prefill tokens cut (promptstore hot vs no cache)", ">= 90%"),
    ("hit TTFT / TTFT at the one-copy floor (promptstore hot, p50 over hits)", "<= 2x"),
    ("hit TTFT / TTFT at mx.load (promptstore cold only, p50 over hits)", "<= 1.25x"),
    ("disk bytes (promptstore hot / mlx-lm files)", "<= 0.3x"),
    ("tokens restorable after a restart / before (promptstore)", ">= 95%"),
    ("hybrid prefill cut minus the dense model's on the same chat (promptstore hot)", "within 2 points"),
    ("hybrid disk bytes (promptstore hot / mlx-lm files)", "<= 1.0x"),
    ("hybrid restores within one prefill step of the divergence (promptstore hot)", "100%"),
]


def restore_points(outs: list[dict], step: int) -> dict:
    """Where promptstore restored against where each prompt diverges from what the
    store holds (`matched`, what a model of attention layers only restores)."""
    gaps = np.asarray([o["matched"] - o["restored"] for o in outs], dtype=float)
    prompt = sum(o["prompt_tokens"] for o in outs)
    edges = [0, 1, 65, 257, step + 1, float("inf")]
    names = ["0", "1-64", "65-256", f"257-{step}", f"> {step}"]
    hist = {n: int(((gaps >= lo) & (gaps < hi)).sum()) for n, lo, hi in zip(names, edges, edges[1:])}
    return {
        "requests": len(outs),
        "prefill_step": step,
        "at_divergence": int((gaps == 0).sum()),
        "within_step": int((gaps <= step).sum()),
        "gap_p50": pct(gaps, 50),
        "gap_p95": pct(gaps, 95),
        "gap_max": float(gaps.max()) if len(gaps) else None,
        "histogram": hist,
        "attention_only_cut": 1 - sum(o["prompt_tokens"] - o["matched"] for o in outs) / prompt if prompt else None,
    }


def _row(summary: dict, name: str) -> dict | None:
    return next((r for r in summary["rows"] if r["contender"] == name), None)


def goals(workloads: dict[str, dict]) -> list[dict]:
    out = []

    def add(goal, workload, value, ok, shown, detail=""):
        out.append(
            {
                "goal": goal,
                "workload": workload,
                "value": value,
                "met": bool(ok) if value is not None else False,
                "shown": shown,
                "detail": detail,
            }
        )

    for wname, s in workloads.items():
        if wname.startswith("hybrid-"):
            hybrid_goals(add, wname, s, workloads.get("chat"))
        if wname == "restart":
            kept = s["survived"]["promptstore (restarted)"]["kept"]
            add(
                GOALS[4][0],
                wname,
                kept,
                kept is not None and kept >= 0.95,
                "n/a" if kept is None else f"{kept:.1%}",
                f"LRU keeps {s['survived']['mlx-lm LRUPromptCache (restarted: empty)']['kept'] or 0:.0%}, "
                f"files {s['survived']['mlx-lm cache files']['kept'] or 0:.0%}",
            )
            continue
        hot, cold, files = _row(s, "promptstore hot"), _row(s, "promptstore cold only"), _row(s, "mlx-lm cache files")
        if hot is None:
            continue
        cut = hot["prefill_cut"]
        if not wname.startswith("hybrid-"):  # the hybrids have their own cut and disk goals
            add(GOALS[0][0], wname, cut, cut is not None and cut >= 0.90, f"{cut:.1%}")
        r = hot.get("hit_ttft_vs_floor_p50")
        add(
            GOALS[1][0],
            wname,
            r,
            r is not None and r <= 2.0,
            "n/a" if r is None else f"{r:.2f}x",
            f"restore alone: {hot['restore_vs_floor']:.2f}x the floor" if hot.get("restore_vs_floor") else "",
        )
        if cold is not None:
            r = cold.get("hit_ttft_vs_load_p50")
            add(
                GOALS[2][0],
                wname,
                r,
                r is not None and r <= 1.25,
                "n/a" if r is None else f"{r:.2f}x",
                f"restore alone: {cold['restore_vs_load']:.2f}x mx.load" if cold.get("restore_vs_load") else "",
            )
        if files is not None and files["disk_bytes"] and not wname.startswith("hybrid-"):
            r = hot["disk_bytes"] / files["disk_bytes"]
            add(
                GOALS[3][0],
                wname,
                r,
                r <= 0.3,
                f"{r:.2f}x",
                f"{_bytes(hot['disk_bytes'])} vs {_bytes(files['disk_bytes'])}",
            )
    return out


def probe_divergences(contenders: list[Contender], script: ChatScript, profile: Profile, n: int = 64) -> dict:
    """Prompts that leave a stored one at a random position (nothing is prefilled or
    stored): where promptstore hot restores them, against where they diverge."""
    store = next(c for c in contenders if c.name == "promptstore hot")
    rng = np.random.default_rng(11)
    outs = []
    for _ in range(n):
        c = int(rng.integers(script.conversations))
        prompt = script.prompt(c, script.turns - 1, script.replies)
        at = int(rng.integers(1, len(prompt) - 1))
        tokens = prompt[:at] + _content(rng, 8, profile.vocab)
        hit = store.space.fetch(tokens)
        outs.append({"matched": hit.matched, "restored": hit.length, "prompt_tokens": len(tokens)})
    return restore_points(outs, profile.prefill_step)


def hybrid_goals(add, wname: str, s: dict, chat: dict | None) -> None:
    hot, files = _row(s, "promptstore hot"), _row(s, "mlx-lm cache files")
    points = s.get("restore_points") or {}
    dense_row = _row(chat, "promptstore hot") if chat and s.get("same_prompts_as_chat") else None
    if dense_row is not None:
        dense, of = dense_row["prefill_cut"], "the chat workload's dense model"
    else:
        dense, of = points.get("attention_only_cut"), "an attention-only model on the same requests"
    if hot and dense is not None:
        diff = hot["prefill_cut"] - dense
        add(
            GOALS[5][0],
            wname,
            diff,
            abs(diff) <= 0.02,
            f"{diff * 100:+.1f} points",
            f"{hot['prefill_cut']:.1%} vs {dense:.1%} ({of}); LRU {_row(s, 'mlx-lm LRUPromptCache')['prefill_cut']:.1%}",
        )
    if hot and files and files["disk_bytes"]:
        r = hot["disk_bytes"] / files["disk_bytes"]
        add(
            GOALS[6][0],
            wname,
            r,
            r <= 1.0,
            f"{r:.2f}x",
            f"{_bytes(hot['disk_bytes'])} vs {_bytes(files['disk_bytes'])}",
        )
    probes = s.get("divergence_probes")
    if probes:  # counted over the chat's requests and the probes together
        points = dict(points)
        for k in ("requests", "at_divergence", "within_step"):
            points[k] += probes[k]
        points["gap_max"] = max(points["gap_max"] or 0, probes["gap_max"] or 0)
    if points:
        share = points["within_step"] / points["requests"] if points["requests"] else None
        add(
            GOALS[7][0],
            wname,
            share,
            share == 1.0,
            "n/a" if share is None else f"{share:.0%}",
            f"{points['at_divergence']} of {points['requests']} at the divergence itself (chat requests and "
            f"random divergence probes); max gap {points['gap_max']:.0f} tokens",
        )


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _ms(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def workload_table(s: dict) -> str:
    head = (
        "| contender | prefilled tokens | cut | TTFT p50 | TTFT p95 | hit TTFT p50 | hit TTFT p95 | disk "
        "| restore GB/s | restore ÷ floor | restore ÷ mx.load | restored from disk | replies = no cache "
        "| max Δ logprob, 1st token |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in s["rows"]:
        if r.get("ceiling"):
            lines.append(
                f"| *{r['contender']}* | | | | | {_ms(r['hit_ttft_p50_s'])}† | {_ms(r['hit_ttft_p95_s'])}† "
                f"| | {r['restore_gbps']:.2f} | | | | | |"
            )
            continue
        cut = "" if r["contender"].startswith("no cache") or r["prefill_cut"] is None else f"{r['prefill_cut']:.1%}"
        gbps = f"{r['restore_gbps']:.2f}" if r.get("restore_gbps") else "-"
        vf = f"{r['restore_vs_floor']:.2f}x" if r.get("restore_vs_floor") else "-"
        vl = f"{r['restore_vs_load']:.2f}x" if r.get("restore_vs_load") else "-"
        eq = "yes" if r["replies_equal"] else f"**NO ({len(r['replies_mismatched'])} of {r['requests']})**"
        disk_share = "-" if not r["restored_tokens"] else f"{r['disk_restored_tokens'] / r['restored_tokens']:.0%}"
        name = r["contender"]
        if r.get("kept_after_restart") is not None or "restarted" in name:
            kept = r.get("kept_after_restart")
            name += f" (kept {kept:.0%})" if kept is not None else ""
        lines.append(
            f"| {name} | {r['prefilled_tokens']:,} of {r['prompt_tokens']:,} | {cut} "
            f"| {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p95_s'])} | {_ms(r['hit_ttft_p50_s'])} "
            f"| {_ms(r['hit_ttft_p95_s'])} | {_bytes(r['disk_bytes']) if r['disk_bytes'] is not None else '-'} "
            f"| {gbps} | {vf} | {vl} | {disk_share} | {eq} | {_sci(r.get('max_first_token_logprob_diff'))} |"
        )
    details = []
    for r in s["rows"]:
        for m in r.get("mismatch_detail", []):
            details.append(
                f"{r['contender']}: {m['request']} (restored {m['restored']:,}) differs from token "
                f"{m['token']} on, where the top-2 logprob margin was {m['margin_no_cache']:.4f} "
                f"without a cache and {m['margin_here']:.4f} here"
            )
    if details:
        lines.append("\nReplies that differ from no cache's:\n")
        lines += [f"- {d}" for d in details]
    return "\n".join(lines)


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def goals_table(gs: list[dict]) -> str:
    targets = dict(GOALS)
    lines = ["| goal | workload | measured | target | verdict | detail |", "|---|---|---|---|---|---|"]
    for g in gs:
        lines.append(
            f"| {g['goal']} | {g['workload']} | {g['shown']} | {targets[g['goal']]} "
            f"| {'met' if g['met'] else '**MISSED**'} | {g['detail']} |"
        )
    return "\n".join(lines)


TITLES = {
    "chat": "Chat with shared system prompts",
    "restart": "Restart: the chat resumed in a fresh process",
    "fork": "Agent forking",
    "hybrid-gemma3_text": "Hybrid model: sliding window (gemma3_text layout), chat workload",
    "hybrid-qwen3_next": "Hybrid model: recurrent + attention (qwen3_next layout), chat workload",
}


def report(doc: dict) -> str:
    m = doc["machine"]
    blas = "not used (GPU)" if "gpu" in m["mlx_device"] else doc["blas"]["name"]
    gpu = f"; GPU: {doc['gpu']}" if doc.get("gpu") else ""
    partial = " **Partial: the run stopped before every workload was done.**" if doc.get("partial") else ""
    parts = [
        f"Run {doc['date']} on {m['platform']} ({m['cpu_count']} CPUs{gpu}; MLX {m['mlx']} on {m['mlx_device']}; "
        f"mlx-lm {m['mlx_lm']}; BLAS: {blas}).{partial} Profile `{doc['profile']['name']}`: "
        f"{doc['profile']['note']}. Whole run: {doc['wall_s'] / 60:.1f} min."
    ]
    for name, s in doc["workloads"].items():
        parts.append(f"\n#### {TITLES.get(name, name)}\n\n{s['model']}; {s['requests_note']}.\n\n{workload_table(s)}")
        if s.get("restore_points"):
            parts.append(restore_points_text(s["restore_points"], "the chat's requests"))
        if s.get("divergence_probes"):
            parts.append(
                restore_points_text(s["divergence_probes"], "prompts leaving a stored one at random positions")
            )
    parts.append(f"\n#### Goals\n\n{goals_table(doc['goals'])}")
    return "\n".join(parts)


def restore_points_text(p: dict, what: str) -> str:
    hist = ", ".join(f"{k}: {v}" for k, v in p["histogram"].items())
    return (
        f"\nWhere promptstore hot restored {what}, in tokens before the point where each diverges from what "
        f"the store holds (what an attention-only model restores: a {p['attention_only_cut']:.1%} cut on these "
        f"requests): {p['at_divergence']} of {p['requests']} requests at that point, {p['within_step']} within one "
        f"prefill step ({p['prefill_step']}); gap p50 {p['gap_p50']:.0f}, p95 {p['gap_p95']:.0f}, max "
        f"{p['gap_max']:.0f}; requests by gap: {hist}."
    )


NOTES = """\
How to read the tables:

- **prefilled tokens**: prompt tokens the model computed (prompt minus restored); **cut**: fewer than no cache.
- **TTFT**: from the request's start (lookup or file load included) to the first generated token;
  **hit**: requests that restored at least one token.
- **disk**: bytes of every file the contender left (promptstore: snapshot files and the LMDB index).
- **restore GB/s**: bytes of cache state restored (keys and values up to the hit, window or
  recurrent state) over the time to get them ready (lookup, copy or file read, evaluation), over hits.
- **restore ÷ floor / ÷ mx.load**: that restore time against the same bytes made by one
  `mx.concatenate` (the one-copy floor) or read by `mx.load` from one safetensors file (page cache warm,
  as for every file here). † ceiling rows: promptstore hot's hits with their restore replaced by the ceiling.
- **replies = no cache**: every greedy reply equals the full-prefill reply; a contender that changes
  a reply is wrong.
- **max Δ logprob, 1st token**: the largest difference from no cache's log-probabilities over the
  whole vocabulary at the first generated token: rounding shows as 1e-5 (float32) to 1e-2 (float16);
  a wrong cache would show differences of order one. In float16 a greedy reply can flip where two
  tokens tie at float16's resolution; the list under a table gives each flip with the top-2 margin
  there, and the control row (no cache again, prefill chunked differently) shows full prefill
  flipping about as often.
- The TTFT goals compare whole TTFTs (restore plus the suffix prefill and first token); the detail
  column gives the stricter restore-alone ratio.
- mlx-lm's LRU restores with `copy.deepcopy`, which on the CPU shares the MLX buffer: its copy happens
  at the cache's first write, inside the prefill, so its restore column can beat the one-copy floor.
- Hybrid runs send the chat workload's prompts (when the profile gives them its sizes) to smaller
  models. Their goals: a prefill cut within 2 points of the dense model's on the same chat, disk at
  most mlx-lm's per-conversation files, and every restore within one prefill step of where the
  prompt diverges from what the store holds. promptstore stores sliding-window layers as ranges
  (restorable wherever their last window is stored) and recurrent state at every prefill step
  while it prefills, keeping in files only the states a restore used or that end a leaf or a
  branch point.
"""


def markdown_doc(docs: dict[str, dict], gpu: str = "") -> str:
    parts = [
        "# Benchmarks: promptstore against what you have",
        "",
        "Generated by `tools/bench/bench_anchors.py` (`make bench-anchors`; `--docs-only` renders this page from "
        "the result files under bench-results/ without running anything); do not edit by hand.",
        "Each section is one run, on one machine, with every contender side by side.",
        "",
        NOTES,
    ]
    for label, doc in docs.items():
        parts.append(f"\n## {label}\n")
        parts.append(report(doc))
    if gpu:
        parts.append("\n" + gpu)
    return "\n".join(parts) + "\n"


def save_split(out_path: Path, payload: dict, blas: dict) -> Path:
    """The summary to `out_path` (common.write_results), every request's
    outcome to `<name>.requests.json` beside it (compact: it is large)."""
    workloads = {n: {k: v for k, v in w.items() if k != "outcomes"} for n, w in payload["workloads"].items()}
    requests = {n: w["outcomes"] for n, w in payload["workloads"].items() if "outcomes" in w}
    path = write_results(
        out_path, dict(payload, workloads=workloads, requests_file=out_path.with_suffix(".requests.json").name), blas
    )
    if requests:
        path.with_suffix(".requests.json").write_text(json.dumps(requests, separators=(",", ":")) + "\n")
    return path


def sanitize_blas(info: dict) -> dict:
    """No machine-specific paths in committed results: file names only."""
    out = dict(info)
    out["libraries"] = sorted({os.path.basename(p) for p in info.get("libraries", [])})
    for k in ("cblas_sgemm_from", "ld_preload"):
        if out.get(k):
            out[k] = " ".join(os.path.basename(p) for p in str(out[k]).split())
    return out


# --------------------------------------------------------------------------------------
# main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--profile", choices=sorted(PROFILES), default=None, help="cpu (default on CPU), cuda (default on a GPU), quick"
    )
    ap.add_argument("--quick", action="store_true", help="same as --profile quick")
    ap.add_argument("--workloads", default=None, help="comma-separated subset of chat,restart,fork,hybrid")
    ap.add_argument("--out", default=None, help="result JSON (default bench-results/anchors-<profile>.json)")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    ap.add_argument("--docs-only", action="store_true", help="rewrite docs/benchmarks.md from the result files")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--state", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    on_gpu = mx.default_device() == mx.gpu
    name = "quick" if args.quick else (args.profile or ("cuda" if on_gpu else "cpu"))
    profile = PROFILES[name]
    if args.workloads:
        profile = replace(profile, workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()))

    if args.phase == "restart":
        restart_phase(Path(args.state), Path(args.result), profile)
        return 0
    if args.docs_only:
        return write_docs()

    blas = blas_info()
    warning = blas_warning(blas)
    if warning and not on_gpu:
        print(warning, file=sys.stderr)
    out_path = Path(args.out) if args.out else REPO_ROOT / "bench-results" / f"anchors-{profile.name}.json"
    started = time.perf_counter()
    workloads: dict[str, dict] = {}

    def save(partial: bool) -> Path:
        # After every workload too, so a run cut short keeps what it measured.
        payload = {
            "benchmark": "anchors",
            "partial": partial,
            "profile": asdict(profile),
            "wall_s": time.perf_counter() - started,
            "workloads": workloads,
            "goals": goals(workloads),
            "gpu": gpu_name(),
        }
        return save_split(out_path, payload, sanitize_blas(blas))

    with tempfile.TemporaryDirectory(prefix="anchors-") as tmp:
        tmp = Path(tmp)
        log(f"profile {profile.name}: building the llama model")
        model, model_id, desc = build_model(profile)
        engine = Engine(model, profile)
        warm_up(engine)

        if "chat" in profile.workloads or "restart" in profile.workloads:
            log("chat")
            chat = ChatScript(profile, profile.vocab, profile.conversations, profile.turns)
            root = tmp / "chat"
            contenders, results, reference, t0 = run_chat_like(
                chat, engine, model_id, desc, root, profile, keep_open=True
            )
            restart = None
            if "restart" in profile.workloads:
                restart = run_restart(profile, chat, contenders, tmp / "chat", model_id, desc)
            workloads["chat"] = finish_workload("chat", desc, contenders, results, reference, root, profile, t0)
            workloads["chat"]["requests_note"] = (
                f"{profile.conversations} conversations x {profile.turns} turns over {len(profile.system_tokens)} "
                f"system prompts of {', '.join(map(str, profile.system_tokens))} tokens, user messages of "
                f"{profile.user_tokens} tokens, replies of {profile.reply_tokens}"
            )
            save(partial=True)
            if restart is not None:
                log("restart")
                workloads["restart"] = finish_restart(*restart[:4], profile, tmp / "chat", desc)
                workloads["restart"]["requests_note"] = (
                    f"turn {profile.turns + 1} of each of the {profile.conversations} conversations, in a new "
                    "process after every store was closed; 'kept': tokens restorable for these requests right "
                    "after the restart over those restorable just before it"
                )
            if "chat" not in profile.workloads:
                workloads.pop("chat")
            save(partial=True)

        if "fork" in profile.workloads:
            log("fork")
            fork = ForkScript(profile, profile.vocab)
            workloads["fork"] = run_chat_like(fork, engine, model_id, desc, tmp / "fork", profile)
            workloads["fork"]["requests_note"] = (
                f"a root request on a {profile.fork_system}-token system prompt, {profile.fork_width} branches "
                f"off it and {profile.fork_retries} retries off each (depth first), then back to the root and to "
                f"the first branch: {len(fork.nodes)} requests"
            )
            save(partial=True)

        del engine, model
        if "hybrid" in profile.workloads:
            for family in ("gemma3_text", "qwen3_next"):
                log(f"hybrid {family}")
                hmodel, hid, hdesc = build_model(profile, family)
                hengine = Engine(hmodel, profile)
                warm_up(hengine)
                # Seeded as the chat workload: the same prompts, when the sizes are the same.
                script = ChatScript(
                    profile,
                    profile.vocab,
                    profile.hybrid_conversations,
                    profile.hybrid_turns,
                    name=f"hybrid-{family}",
                    seed=1,
                )
                root = tmp / family
                contenders, results, reference, t0 = run_chat_like(
                    script, hengine, hid, hdesc, root, profile, keep_open=True
                )
                probes = probe_divergences(contenders, script, profile)
                s = finish_workload(script.name, hdesc, contenders, results, reference, root, profile, t0)
                s["divergence_probes"] = probes
                s["same_prompts_as_chat"] = (profile.hybrid_conversations, profile.hybrid_turns) == (
                    profile.conversations,
                    profile.turns,
                )
                s["restore_points"] = restore_points(s["outcomes"]["promptstore hot"], profile.prefill_step)
                grid = profile.checkpoint_interval or profile.prefill_step
                s["requests_note"] = (
                    f"{profile.hybrid_conversations} conversations x {profile.hybrid_turns} turns over the same "
                    f"system prompts{' as the chat workload' if s['same_prompts_as_chat'] else ''}; promptstore "
                    f"checkpoints every {grid} tokens{' (its prefill step)' if grid == profile.prefill_step else ''}"
                )
                workloads[f"hybrid-{family}"] = s
                del hengine, hmodel
                save(partial=True)

    path = save(partial=False)
    doc = json.loads(path.read_text())
    print(report(doc))
    if warning and not on_gpu:
        print(warning)
    print(f"\nwrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}")
    try:
        from plot_anchors import plot

        png = plot(path)
        print(f"wrote {png.relative_to(REPO_ROOT) if png.is_relative_to(REPO_ROOT) else png}")
    except ImportError as e:
        print(f"no PNG: {e} (add matplotlib to draw bench-results/anchors-*.png)")
    if (
        profile.name in ("cpu", "cuda")
        and not args.no_docs
        and out_path == REPO_ROOT / "bench-results" / f"anchors-{profile.name}.json"
    ):
        write_docs()
    return 0


def write_docs() -> int:
    docs = {}
    for label, fname in (
        ("CPU (MLX CPU backend)", "anchors-cpu.json"),
        ("NVIDIA GPU (MLX CUDA backend)", "anchors-cuda.json"),
    ):
        p = REPO_ROOT / "bench-results" / fname
        if p.exists():
            docs[f"{label}: `bench-results/{fname}`"] = json.loads(p.read_text())
    if not docs:
        print("no result files to document", file=sys.stderr)
        return 1
    target = REPO_ROOT / "docs" / "benchmarks.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(markdown_doc(docs, gpu_sections(REPO_ROOT / "bench-results")))
    print(f"wrote {target.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
