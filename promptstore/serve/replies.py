"""After a chat reply: the tokens the next turn starts with. The client sends
the reply back as text, which the chat template renders with its own
end-of-turn marker: those tokens differ from the generated ones at the end."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChatTurn:
    """What a chat request was rendered from."""

    messages: list[dict]
    tools: list | None
    template_kwargs: dict


def reply_text(tokenizer, generated: list[int]) -> str:
    """The reply's text as mlx_lm.server streams it: through the tokenizer's
    detokenizer, without the stop token."""
    tokens = list(generated)
    if tokens and tokens[-1] in tokenizer.eos_token_ids:
        tokens.pop()
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def rendered_turn(tokenizer, turn: ChatTurn, generated: list[int]) -> list[int]:
    """Tokens of the conversation with this reply, as the next request renders them."""
    messages = [*turn.messages, {"role": "assistant", "content": reply_text(tokenizer, generated)}]
    tokens = tokenizer.apply_chat_template(
        messages, tools=turn.tools, add_generation_prompt=False, tokenize=True, **turn.template_kwargs
    )
    return [int(t) for t in tokens]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
