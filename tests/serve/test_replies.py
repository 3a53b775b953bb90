"""The next turn's tokens after a reply: tokenizing only the text after the last
special token both renderings share gives what rendering the whole conversation
gives, and falls back to the whole rendering where it cannot tell."""

from __future__ import annotations

import random

import pytest

from promptstore.serve.replies import ChatTurn, _spliced, rendered_turn
from promptstore.testing.tokenizer import CORPUS, demo_tokenizer

WORDS = CORPUS.read_text().split()


def _text(rng: random.Random, n: int) -> str:
    start = rng.randrange(len(WORDS) - n)
    return " ".join(WORDS[start : start + n])


def _conversation(rng: random.Random, turns: int, system: bool) -> list[dict]:
    messages = [{"role": "system", "content": _text(rng, 80)}] if system else []
    for _ in range(turns):
        messages += [{"role": "user", "content": _text(rng, 12)}, {"role": "assistant", "content": _text(rng, 30)}]
    return messages + [{"role": "user", "content": _text(rng, 10) + rng.choice(["", " ", "\n", "?"])}]


@pytest.mark.parametrize("seed", range(12))
def test_a_spliced_rendering_equals_the_whole_rendering(seed):
    rng = random.Random(seed)
    tok = demo_tokenizer(512)
    messages = _conversation(rng, turns=seed % 4, system=seed % 2 == 0)
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    reply = _text(rng, 25) + rng.choice(["", " ", "  \n"])
    generated = [*tok.encode(reply, add_special_tokens=False), tok.eos_token_id]
    turn = ChatTurn(messages, None, {})
    whole = rendered_turn(tok, turn, generated)
    assert _spliced(tok, turn, [*messages, {"role": "assistant", "content": reply}], prompt) is not None
    assert rendered_turn(tok, turn, generated, prompt) == whole
    assert whole[: len(prompt) - 1] == prompt[:-1]  # the splice kept what the prompt already had


def test_a_prompt_that_does_not_match_its_text_falls_back_to_the_whole_rendering():
    tok = demo_tokenizer(512)
    messages = _conversation(random.Random(1), turns=1, system=True)
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    generated = [*tok.encode("a short reply", add_special_tokens=False), tok.eos_token_id]
    turn = ChatTurn(messages, None, {})
    whole = rendered_turn(tok, turn, generated)
    doctored = [*prompt, prompt[-1]]  # one special token more than the text holds
    assert _spliced(tok, turn, [*messages, {"role": "assistant", "content": "a short reply"}], doctored) is None
    assert rendered_turn(tok, turn, generated, doctored) == whole
