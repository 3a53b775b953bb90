"""What a Messages or Responses request becomes: the chat request mlx_lm.server
renders for /v1/chat/completions (OpenAI-style messages and function tools), so
one conversation renders to the same tokens whichever API sent it; plus the
prefixes the client marked (`cache_control`), which become checkpoints kept as
long as each mark's ttl says, and how long the request asked to keep the rest."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..mlx_lm_server import (
    CompletionRequest,
    GenerationArguments,
    LogitsProcessorArguments,
    ModelDescription,
    SamplingArguments,
    process_message_content,
)
from ..replies import common_prefix


@dataclass
class ChatRequest:
    """A request in the terms of mlx_lm.server's chat completions.

    sampling: temperature, top_p, top_k as the client sent them (the server's
        defaults for those it left out).
    marked: the conversation up to and including each block the client marked,
        as chat messages (the last one possibly cut short).
    ttls: the retention class of each marked prefix ("5m", "1h").
    retention: the class of everything the request stores (prompt and reply):
        the request's own cache_control ttl, or prompt_cache_retention; None: none.
    cache_key: the client's prompt_cache_key.
    """

    model: str
    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int
    stop: list[str]
    stream: bool
    sampling: dict[str, float] = field(default_factory=dict)
    marked: list[list[dict]] = field(default_factory=list)
    ttls: list[str] = field(default_factory=list)
    retention: str | None = None
    cache_key: str | None = None

    def completion_request(self) -> CompletionRequest:
        return CompletionRequest("chat", "", self.messages, self.tools, None)

    def generation_arguments(self, cli_args) -> GenerationArguments:
        """mlx_lm.server's arguments for this request: what it sent, the server's
        defaults for the rest (as mlx_lm.server's handler takes them), no logits
        processors (these APIs have none)."""
        given = self.sampling
        return GenerationArguments(
            model=ModelDescription(model=self.model, draft="default_model", adapter=None),
            sampling=SamplingArguments(
                temperature=given.get("temperature", cli_args.temp),
                top_p=given.get("top_p", cli_args.top_p),
                top_k=int(given.get("top_k", cli_args.top_k)),
                min_p=cli_args.min_p,
                xtc_probability=0.0,
                xtc_threshold=0.1,
            ),
            logits=LogitsProcessorArguments(None, 0.0, 20, 0.0, 20, 0.0, 20),
            stop_words=self.stop,
            max_tokens=self.max_tokens,
            num_draft_tokens=cli_args.num_draft_tokens,
            logprobs=False,
            top_logprobs=-1,
            seed=None,
            chat_template_kwargs=None,
        )


class Conversation:
    """Chat messages built block by block, remembering each marked prefix."""

    def __init__(self):
        self.messages: list[dict] = []
        self.marked: list[list[dict]] = []
        self.ttls: list[str] = []

    def add(self, message: dict) -> dict:
        self.messages.append(message)
        return message

    def last(self, role: str) -> dict | None:
        """The message being built, when it has this role."""
        if self.messages and self.messages[-1]["role"] == role:
            return self.messages[-1]
        return None

    def mark(self, ttl: str = "5m") -> None:
        self.marked.append(copy.deepcopy(self.messages))
        self.ttls.append(ttl)


def marked_positions(
    tokenizer, prompt: list[int], marked: list[list[dict]], tools, template_kwargs: dict
) -> list[int | None]:
    """Where each marked prefix ends in `prompt`: the tokens its own rendering
    (without a generation prompt) shares with the prompt's. A template that
    cannot render a prefix (some refuse a conversation without a user turn) gives
    no position for it (None)."""
    points = []
    for messages in marked:
        try:
            tokens = render(tokenizer, messages, tools, template_kwargs)
        except Exception:
            points.append(None)
            continue
        point = common_prefix(tokens, prompt)
        points.append(point if 0 < point < len(prompt) else None)
    return points


def render(tokenizer, messages: list[dict], tools, template_kwargs: dict) -> list[int]:
    """Tokens of a conversation as mlx_lm.server renders one (content parts joined,
    tool call arguments parsed), without the generation prompt."""
    messages = copy.deepcopy(messages)
    process_message_content(messages)
    tokens = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=False, tokenize=True, **template_kwargs
    )
    return [int(t) for t in tokens]
