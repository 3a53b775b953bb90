"""What the anchors send: the run profiles and the workloads, as token ids (the chat and
the agent fork; the restart and the hybrids reuse the chat)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GiB = 1 << 30
# Chat-template tokens; content tokens are drawn from [FIRST_CONTENT, vocab).
BOS, SYS, USER, ASSISTANT, EOT = 1, 2, 3, 4, 5
FIRST_CONTENT = 16


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


def content(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
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
        self.systems = [content(rng, n, vocab) for n in profile.system_tokens]
        self.conversations, self.turns, self.first_turn = conversations, turns, first_turn
        total_turns = first_turn + turns + 1  # messages for the restart turn too
        self.users = [
            [content(rng, profile.user_tokens, vocab) for _ in range(total_turns + 1)] for _ in range(conversations)
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
        self.system = content(rng, profile.fork_system, vocab)
        self.task = content(rng, 2 * profile.user_tokens, vocab)
        nodes: list[tuple[str, str | None]] = [("root", None)]
        for b in range(profile.fork_width):
            nodes.append((f"b{b}", "root"))
            nodes += [(f"b{b}.r{r}", f"b{b}") for r in range(profile.fork_retries)]
        nodes += [("root.back", "root"), ("b0.back", "b0")]
        self.nodes = nodes
        self.messages = {name: content(rng, profile.user_tokens, vocab) for name, _ in nodes}
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
