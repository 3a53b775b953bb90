"""A reply as events (text, reasoning, tool calls, the finish), from what
mlx_lm.server's generation thread sends: its text state machine splits the
text and its tool parser reads the calls, as its handler does for chat
completions; each API then writes the events in its own shape."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mlx_lm.generate import TextStateMachine

from ..mlx_lm_server import ToolCallFormatter

log = logging.getLogger("promptstore.serve")


@dataclass
class Text:
    text: str
    reasoning: bool = False


@dataclass
class ToolCall:
    name: str
    arguments: dict  # parsed from the model's JSON


@dataclass
class Finish:
    """reason: "stop" (end of turn or a stop sequence), "length" or "tool_calls";
    stop_sequence: the client's stop sequence that ended the reply, if one did."""

    reason: str
    stop_sequence: str | None
    tokens: int
    reasoning_tokens: int


Event = Text | ToolCall | Finish


def reply_events(ctx, responses: Iterable, tools, tokenizer, stop_words: list[str]) -> Iterator[Event]:
    """Events of one reply; `ctx` and `responses` are what ResponseGenerator.generate returned."""
    state = ctx.text_sm.make_state(ctx.initial_state)
    formatter = ToolCallFormatter(ctx.tool_parser, tools)
    previous, tool_text, reason, called = ctx.initial_state, "", "stop", False
    tokens, reasoning_tokens = [], 0
    for response in responses:
        state, segments = _advance(state, response)
        for current, text in segments:
            if current == "tool":
                tool_text += text
                previous = current
                continue
            if current == "normal" and previous == "tool":
                for call in _calls(formatter, tool_text):
                    called = True
                    yield call
                tool_text = ""
            if text and current in ("normal", "reasoning"):
                yield Text(text, reasoning=current == "reasoning")
            previous = current
        tokens.append(response.token)
        reasoning_tokens += previous == "reasoning"
        if response.finish_reason is not None:
            reason = response.finish_reason
    if previous == "tool" and tool_text:
        for call in _calls(formatter, tool_text):
            called = True
            yield call
    stop = _stop_sequence(tokenizer, stop_words, tokens) if reason == "stop" else None
    if reason == "stop" and called:
        reason = "tool_calls"
    yield Finish(reason, stop, len(tokens), reasoning_tokens)


def _advance(state, response):
    """The state machine after one generated piece, as mlx_lm.server's handler
    advances it: a stop token's text is dropped, a length stop flushes what was held."""
    if response.finish_reason == "stop":
        state, current = TextStateMachine.discard(state)
        return state, [(current, "")]
    state, segments = TextStateMachine.split(state, response.text)
    if response.finish_reason == "length":
        state, flushed, current = TextStateMachine.flush(state)
        segments.append((current, flushed))
    return state, segments


def _calls(formatter, tool_text: str) -> list[ToolCall]:
    """The calls mlx-lm's tool parser reads in one tool-call span (none when it
    cannot: the formatter logs why)."""
    out = []
    for call in formatter([tool_text]):
        function = call["function"]
        arguments = json.loads(function["arguments"])
        if not isinstance(arguments, dict):
            log.warning("tool call %r dropped: its arguments are not a JSON object", function["name"])
            continue
        out.append(ToolCall(function["name"], arguments))
    return out


def _stop_sequence(tokenizer, stop_words: list[str], tokens: list[int]) -> str | None:
    """The stop word whose tokens end the reply (mlx_lm.server stops on a stop
    word's tokens), None when an end-of-turn token ended it."""
    if not tokens or tokens[-1] in tokenizer.eos_token_ids:
        return None
    for word in stop_words:
        ids = list(tokenizer.encode(word, add_special_tokens=False))
        if ids and tokens[-len(ids) :] == ids:
            return word
    return None
