"""A model directory written with replies="round-trip": its greedy replies, as
mlx-lm generates and streams them, render back through the chat template to the
prompt's tokens, exactly the tokens generated, then the template's end of turn."""

from __future__ import annotations

import json

import pytest
from mlx_lm import load, stream_generate

from promptstore.testing.model_dir import replies_of, write_model_dir
from promptstore.testing.round_trip import render, reply_tokens
from promptstore.testing.tokenizer import CORPUS

PARAGRAPHS = [p for p in CORPUS.read_text().splitlines() if p.strip()]
QUESTIONS = ["What about the harbour?", "Go on.", "And the tides?"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {mode: write_model_dir(root / mode, replies=mode) for mode in ("round-trip", "random")}


def replies(folder, n: int = 12, turns: int = 3, max_tokens: int = 16):
    """Greedy replies over `n` conversations of `turns` turns: (messages, text, tokens) each."""
    model, tokenizer = load(str(folder))
    out = []
    for k in range(n):
        user = PARAGRAPHS[(7 * k + 3) % len(PARAGRAPHS)][: 40 + 23 * k]
        messages = [{"role": "system", "content": PARAGRAPHS[k % len(PARAGRAPHS)]}, {"role": "user", "content": user}]
        for turn in range(turns):
            prompt = render(tokenizer._tokenizer, messages, add_generation_prompt=True)
            tokens, text = [], ""
            for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
                tokens.append(r.token)
                text += r.text
            out.append((messages, text, tokens))
            question = {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}
            messages = [*messages, {"role": "assistant", "content": text}, question]
    return tokenizer._tokenizer, out


def comes_back(tokenizer, messages, text, tokens) -> bool:
    prompt = render(tokenizer, messages, add_generation_prompt=True)
    end = render(tokenizer, [*messages, {"role": "assistant", "content": ""}])[len(prompt) :]
    again = render(tokenizer, [*messages, {"role": "assistant", "content": text}])
    return again == prompt + tokens + end


def test_replies_render_back_to_the_tokens_generated(folders):
    tokenizer, got = replies(folders["round-trip"])
    assert len(got) == 36
    for messages, text, tokens in got:
        assert len(tokens) == 16, "a reply runs to max_tokens: the model never ends one"
        assert comes_back(tokenizer, messages, text, tokens), (messages[-1], text, tokens)
    # Replies still depend on the conversation, and do not repeat one word.
    assert len({text for _, text, _ in got}) > len(got) // 2
    assert all(len(set(tokens)) >= 2 for _, _, tokens in got)


def test_the_random_weights_replies_mostly_do_not(folders):
    """What the round-trip folder is for: the check above fails on the default folder."""
    tokenizer, got = replies(folders["random"], n=4, turns=2)
    assert sum(comes_back(tokenizer, *g) for g in got) < len(got) // 2


def test_the_first_token_has_no_leading_space_and_the_rest_do(folders):
    tokenizer, got = replies(folders["round-trip"], n=3, turns=1)
    first, rest = reply_tokens(tokenizer)
    for _, text, tokens in got:
        assert tokens[0] in first and all(t in rest for t in tokens[1:])
        assert text[0].isalpha() and text.count(" ") == len(tokens) - 1


def test_the_folder_says_which_replies_it_writes(folders):
    assert replies_of(folders["round-trip"]) == "round-trip"
    assert replies_of(folders["random"]) == "random"
    assert "promptstore_replies" not in json.loads((folders["random"] / "config.json").read_text())


def test_only_a_llama_and_known_modes(tmp_path):
    with pytest.raises(ValueError, match="llama"):
        write_model_dir(tmp_path / "gemma", "gemma3_text", replies="round-trip")
    with pytest.raises(ValueError, match="replies must be one of"):
        write_model_dir(tmp_path / "other", replies="echo")
