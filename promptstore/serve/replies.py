"""After a chat reply: the tokens the next turn starts with. The client sends
the reply back as text, which the chat template renders with its own
end-of-turn marker: those tokens differ from the generated ones at the end."""

from __future__ import annotations

from dataclasses import dataclass

from .mlx_lm_server import hf_tokenizer


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


def rendered_turn(tokenizer, turn: ChatTurn, generated: list[int], prompt: list[int] | None = None) -> list[int]:
    """Tokens of the conversation with this reply, as the next request renders them.

    prompt: the tokens `turn` rendered to (with the generation prompt); given,
    only the text from the last special token both renderings share is
    tokenized again, instead of the whole conversation.
    """
    messages = [*turn.messages, {"role": "assistant", "content": reply_text(tokenizer, generated)}]
    if prompt:
        spliced = _spliced(tokenizer, turn, messages, prompt)
        if spliced is not None:
            return spliced
    tokens = tokenizer.apply_chat_template(
        messages, tools=turn.tools, add_generation_prompt=False, tokenize=True, **turn.template_kwargs
    )
    return [int(t) for t in tokens]


def _spliced(tokenizer, turn: ChatTurn, messages: list[dict], prompt: list[int]) -> list[int] | None:
    """prompt[:j] + the tokens of the new rendering from the j-th token on, where
    prompt[j] is the last special token before the two renderings' texts differ.

    A tokenizer splits its special tokens out of the text before it tokenizes
    the pieces between them, so the tokens before such a token do not depend on
    the text after it. None when no such token is found (the caller renders all).
    A wrong splice could only cost hits: the store keeps what the model computed
    for the tokens it was given.
    """
    kwargs = dict(tools=turn.tools, tokenize=False, **turn.template_kwargs)
    try:
        before = tokenizer.apply_chat_template(turn.messages, add_generation_prompt=True, **kwargs)
        after = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
        specials = plain_special_tokens(tokenizer)
    except Exception:  # a template or tokenizer this cannot read: render all
        return None
    if not isinstance(before, str) or not isinstance(after, str) or not specials:
        return None
    same = common_prefix(before, after)
    for j in range(len(prompt) - 1, -1, -1):
        text = specials.get(prompt[j])
        if text is None:
            continue
        if before.count(text) != prompt.count(prompt[j]):
            return None  # the text and the tokens disagree on this token: do not guess
        at = _nth(before, text, prompt[: j + 1].count(prompt[j]))
        if at is None:
            return None
        if at <= same:
            tail = tokenizer.encode(after[at:], add_special_tokens=False)
            if not tail or tail[0] != prompt[j]:
                return None
            return [int(t) for t in (*prompt[:j], *tail)]
    return None


def plain_special_tokens(tokenizer) -> dict[int, str]:
    """{id: text} of the tokenizer's added tokens that match their text exactly
    (no whitespace stripped around them, no normalization)."""
    inner = hf_tokenizer(tokenizer)
    decoder = getattr(inner, "added_tokens_decoder", None) or {}
    out = {}
    for token_id, added in decoder.items():
        content = getattr(added, "content", None)
        if not content or getattr(added, "lstrip", False) or getattr(added, "rstrip", False):
            continue
        if getattr(added, "normalized", False) or getattr(added, "single_word", False):
            continue
        out[int(token_id)] = content
    return out


def _nth(text: str, sub: str, n: int) -> int | None:
    """Index of the n-th (1-based) occurrence of `sub` in `text`."""
    at = -1
    for _ in range(n):
        at = text.find(sub, at + 1)
        if at < 0:
            return None
    return at


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two sequences (token lists, strings):
    a binary search over slices compared whole (a chat's 20k characters in tens of
    microseconds; compared item by item in Python, about a millisecond)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
