"""Random weights whose greedy replies round-trip the chat template.

A random-weight model's reply is random tokens, and its text mostly tokenizes
otherwise when the next turn's template renders it: a server must then prefill
the whole reply again, where a real model's reply mostly comes back as the very
tokens it generated. `round_trip_replies` reshapes a random llama's weights (the
same shapes, so the same cost per token) so that its greedy reply is one
word-piece token with no leading space, then word tokens with a leading space
(" harbour"), each of which tokenizes back to itself wherever it stands: the
reply's text (mlx-lm's detokenizer keeps it as it is, there is no leading space
to trim) renders back to exactly the generated tokens, then the template's
end-of-turn tokens. It never ends a reply: replies run to max_tokens.

How: two hidden dimensions become constant channels the layers neither read nor
write. The last one is on for every token but the one the generation prompt ends
with, the one before it only for that token, and the LM head's columns for them
lift the allowed tokens (first-token pieces after the generation prompt, space
words after any other token) over the rest by a margin measured on corpus text.
Which allowed token wins is left to the random weights, and the LM head's rows
lean away from their own token's embedding so that a reply does not repeat one
word."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .tokenizer import CORPUS

# In units of the logits' spread over the vocabulary: how far the allowed tokens
# stand over the rest (twice this, measured on the corpus), and how much a token
# leans away from repeating itself.
MARGIN = 2.0
SELF_PENALTY = 3.0


def reply_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(first, rest): tokens whose text is ASCII letters alone, and those whose text
    is a space then ASCII letters, each tokenizing back to itself alone. The text
    between two special tokens splits into words before BPE runs, so a run of them
    in any order tokenizes back to the same tokens."""
    first, rest = [], []
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    for t in range(len(tokenizer)):
        if t in special:
            continue
        text = tokenizer.decode([t])
        word = text[1:] if text.startswith(" ") else text
        if not (word.isascii() and word.isalpha()):
            continue
        if tokenizer.encode(text, add_special_tokens=False) == [t]:
            (rest if text.startswith(" ") else first).append(t)
    return first, rest


def round_trip_replies(model: nn.Module, tokenizer: Any) -> None:
    """Reshape `model`'s weights in place (a llama with an untied LM head, as
    tiny_model builds it; `tokenizer` the Hugging Face tokenizer with its chat
    template) so its greedy replies round-trip the template."""
    inner = getattr(model, "model", None)
    if getattr(model, "model_type", None) != "llama" or inner is None or not hasattr(model, "lm_head"):
        raise ValueError("round-trip replies need a llama with an untied LM head")
    first, rest = reply_tokens(tokenizer)
    if not first or not rest:
        raise ValueError("the tokenizer has no words that tokenize back to themselves")
    opening = render(tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=True)[-1]
    # Dimensions -1 and -2 pass through every layer untouched: no layer reads them or writes them.
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            linear.weight[:, -2:] = 0
        for linear in (attn.o_proj, mlp.down_proj):
            linear.weight[-2:, :] = 0
            if "bias" in linear:
                linear.bias[-2:] = 0
        mx.eval(layer.parameters())
    embed = inner.embed_tokens.weight
    level = mx.sqrt(mx.square(embed[:, :-2].astype(mx.float32)).sum(axis=1)).mean().item()
    embed[:, -2:] = 0
    embed[:, -1] = level  # a reply goes on
    embed[opening, -1] = 0
    embed[opening, -2] = level  # a reply begins
    head = model.lm_head.weight
    head[:, -2:] = 0
    mx.eval(embed, head)

    ids = mx.array(_calibration_tokens(tokenizer))[None]
    # The residual's scale where the logits are read: the channel's level over its normalized value.
    channel = _channels(inner(ids))
    scale = level * inner.norm.weight[-1].astype(mx.float32) / channel
    penalty = SELF_PENALTY * _median(scale)
    head[:, :-2] -= (penalty * embed[:, :-2].astype(mx.float32)).astype(head.dtype)
    mx.eval(head)

    hidden = inner(ids)
    logits = model.lm_head(hidden)[0].astype(mx.float32)
    spread = (logits.max(axis=-1) - logits.mean(axis=-1)) / _channels(hidden)
    lift = MARGIN * spread.max().item()
    head[:, -1] = -lift
    head[mx.array(rest), -1] = lift
    head[:, -2] = -lift
    head[mx.array(first), -2] = lift
    mx.eval(head)


def _channels(hidden: mx.array) -> mx.array:
    """Per position, the normalized value of the channel that is on there."""
    return (hidden[0, :, -1] + hidden[0, :, -2]).astype(mx.float32)


def _median(x: mx.array) -> float:
    values = sorted(x.tolist())
    return values[len(values) // 2]


def _calibration_tokens(tokenizer: Any) -> list[int]:
    """A conversation of corpus text in the chat template, replies and all."""
    paragraphs = [p for p in CORPUS.read_text().splitlines() if p.strip()]
    messages = [{"role": "system", "content": paragraphs[0]}]
    for k in range(2):
        messages.append({"role": "user", "content": paragraphs[1 + 2 * k]})
        messages.append({"role": "assistant", "content": paragraphs[2 + 2 * k]})
    messages.append({"role": "user", "content": paragraphs[5]})
    return render(tokenizer, messages, add_generation_prompt=True)


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """`messages` in the chat template, as token ids."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False))
