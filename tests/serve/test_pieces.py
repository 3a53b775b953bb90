"""Rendered prompts tokenized piece by piece between special tokens, the pieces
seen lately kept: the same tokens as tokenizing the whole text, or whole texts."""

import random
import threading
import time

import pytest

from promptstore.serve import pieces as pieces_module
from promptstore.serve.pieces import CHECKED_REQUESTS, Pieces, PieceTokenizer
from promptstore.testing.tokenizer import CORPUS, SPECIAL, demo_tokenizer

WORDS = CORPUS.read_text().split()


def conversation(rng: random.Random, turns: int) -> list[dict]:
    def text(n):
        words = " ".join(rng.choice(WORDS) for _ in range(n))
        return rng.choice(["", " ", "\n", "  "]) + words + rng.choice(["", " ", "\n", " 3.5 ü 🙂"])

    messages = [{"role": "system", "content": text(300)}]
    for _ in range(turns):
        messages += [{"role": "user", "content": text(20)}, {"role": "assistant", "content": text(40)}]
    return messages + [{"role": "user", "content": text(10)}]


def past_the_check(pieces: Pieces, tok) -> None:
    """The first texts' check passed (on other texts than the test's): pieces are used."""
    for seed in range(CHECKED_REQUESTS):
        text = tok.apply_chat_template(conversation(random.Random(100 + seed), 1), tokenize=False)
        assert pieces.encode(text, "warm-up") == tok.encode(text, add_special_tokens=False)
    assert pieces.settle()
    assert pieces.enabled


@pytest.mark.parametrize("seed", range(6))
def test_a_chat_tokenized_in_pieces_equals_the_whole_tokenizing(seed):
    tok = demo_tokenizer(1024)
    pieces = Pieces(tok)
    assert pieces.enabled
    past_the_check(pieces, tok)
    before = dict(pieces.counts)
    wrapped = PieceTokenizer(tok, pieces)
    rng = random.Random(seed)
    messages = conversation(rng, 3)
    for n in range(2, len(messages) + 1, 2):  # a conversation growing turn by turn
        whole = tok.apply_chat_template(messages[:n], add_generation_prompt=True, tokenize=True)
        assert wrapped.apply_chat_template(messages[:n], add_generation_prompt=True, tokenize=True) == whole
        text = tok.apply_chat_template(messages[:n], add_generation_prompt=True, tokenize=False)
        assert wrapped.encode(text, add_special_tokens=False) == whole
    # The system prompt and the earlier messages came back as kept pieces.
    reused, tokenized = (pieces.counts[k] - before[k] for k in ("pieces_reused", "pieces_tokenized"))
    assert reused > tokenized
    assert pieces.enabled


def test_a_tokenizer_that_tokenizes_pieces_otherwise_is_tokenized_whole():
    """Metaspace with prepend_scheme "first" marks a text's first word only: a piece
    tokenized alone would gain the mark. The sample finds it; texts go whole."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sp = Tokenizer(models.BPE(unk_token=None))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False)
    sp.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>")
    pieces = Pieces(fast)
    assert not pieces.enabled
    text = "<s><|system|>" + " ".join(WORDS[:200]) + "<|end|><|user|>hello there<|end|>"
    assert pieces.encode(text) == fast.encode(text, add_special_tokens=False)


class _Drifting:
    """A tokenizer that agrees on short texts and, past `past` characters, marks a
    text's start: what the samples cannot see, the first requests' check must."""

    def __init__(self, inner, past: int = 2000):
        self.inner, self.past = inner, past
        self.added_tokens_decoder = inner._tokenizer.added_tokens_decoder

    def encode(self, text, add_special_tokens=False):
        tokens = self.inner.encode(text, add_special_tokens=add_special_tokens)
        return ([0] if len(text) > self.past else []) + tokens


class _Templated(_Drifting):
    """_Drifting with the inner tokenizer's chat template."""

    def __init__(self, inner, past: int, render=None):
        super().__init__(inner, past)
        self.chat_template = inner.chat_template
        self.apply_chat_template = render or inner.apply_chat_template


def test_the_load_time_sample_renders_a_conversation_in_the_chat_template():
    """The sample conversation, in the template's own special tokens, is longer
    than any joined sample: a difference there turns pieces off before any request."""
    tok = demo_tokenizer(1024)
    longest = max(len(t) for t in Pieces(tok)._split_samples())
    assert Pieces(_Drifting(tok, past=longest)).enabled  # no template: the joined samples agree
    assert not Pieces(_Templated(tok, past=longest)).enabled
    assert Pieces(_Templated(tok, past=100_000)).enabled


def test_a_template_that_renders_no_sample_leaves_the_joined_samples_to_decide():
    def refuse(messages, **kwargs):
        raise ValueError("roles must alternate user/assistant/user/assistant/...")

    tok = demo_tokenizer(1024)
    assert Pieces(_Templated(tok, past=100_000, render=refuse)).enabled


def test_the_check_waits_while_a_request_waits_for_its_first_token(monkeypatch):
    """The checking thread tokenizes nothing while `busy()` (a prefill would wait
    for it on two cores), and no longer than CHECK_WAIT_S a text."""
    tok = demo_tokenizer(1024)
    busy = threading.Event()
    busy.set()
    pieces = Pieces(tok, busy=busy.is_set)
    text = tok.apply_chat_template(conversation(random.Random(5), 1), add_generation_prompt=True, tokenize=False)
    assert pieces.encode(text) == tok.encode(text, add_special_tokens=False)
    time.sleep(0.3)
    assert pieces.counts["pieces_tokenized"] == 0 and pieces._agreed == 0
    busy.clear()
    assert pieces.settle()
    assert pieces.counts["pieces_tokenized"] > 0 and pieces._agreed == 1

    monkeypatch.setattr(pieces_module, "CHECK_WAIT_S", 0.2)
    always = Pieces(tok, busy=lambda: True)
    started = time.monotonic()
    always.encode(text)
    assert always.settle(timeout=5.0)  # checked all the same, once the wait was up
    assert always._agreed == 1 and time.monotonic() - started >= 0.2


def test_a_busy_signal_that_fails_does_not_stop_the_check():
    def broken():
        raise RuntimeError("the server is closing")

    tok = demo_tokenizer(1024)
    pieces = Pieces(tok, busy=broken)
    text = tok.apply_chat_template(conversation(random.Random(6), 1), add_generation_prompt=True, tokenize=False)
    pieces.encode(text)
    assert pieces.settle()
    assert pieces._agreed == 1


def test_a_difference_in_the_first_requests_turns_pieces_off_for_good():
    tokenizer = _Drifting(demo_tokenizer(1024))
    pieces = Pieces(tokenizer)
    assert pieces.enabled
    long = " ".join(WORDS[:600])
    text = f"<s><|system|>{long}<|end|><|user|>{long}<|end|>"
    assert pieces.encode(text) == tokenizer.encode(text)  # the whole text's tokens, not the pieces'
    assert pieces.settle()  # checked on the checking thread
    assert not pieces.enabled
    assert pieces.encode(text) == tokenizer.encode(text)


def test_pieces_are_used_only_once_the_first_texts_agreed():
    """Until CHECKED_REQUESTS texts agreed, a request gets its text's whole
    tokenizing, and the pieces are tokenized on the checking thread."""
    tok = demo_tokenizer(1024)
    pieces = Pieces(tok)
    on_the_caller, real = [], pieces.whole

    def whole(text):
        if threading.current_thread() is threading.main_thread():
            on_the_caller.append(len(text))
        return real(text)

    pieces.whole = whole
    texts = [
        tok.apply_chat_template(conversation(random.Random(20 + i), 2), add_generation_prompt=True, tokenize=False)
        for i in range(CHECKED_REQUESTS + 1)
    ]
    for text in texts[:CHECKED_REQUESTS]:
        assert pieces.encode(text) == tok.encode(text, add_special_tokens=False)
        assert len(text) in on_the_caller  # the request's own tokens: the whole text's
    assert pieces.settle()
    assert pieces.counts["pieces_tokenized"] > 0  # tokenized, and kept, on the checking thread
    on_the_caller.clear()
    assert pieces.encode(texts[-1]) == tok.encode(texts[-1], add_special_tokens=False)
    assert len(texts[-1]) not in on_the_caller  # checked: pieces now


def test_only_the_first_requests_are_tokenized_twice():
    tok = demo_tokenizer(1024)
    pieces = Pieces(tok)
    calls = []
    real = pieces.whole
    pieces.whole = lambda text: calls.append(len(text)) or real(text)
    text = tok.apply_chat_template(conversation(random.Random(7), 2), add_generation_prompt=True, tokenize=False)
    for _ in range(CHECKED_REQUESTS):
        pieces.encode(text)
    assert pieces.settle()
    calls.clear()
    pieces.encode(text)
    assert len(text) not in calls  # no whole-text check any more
    assert max(calls, default=0) < 64  # only the small pieces (role names, newlines) were tokenized


def test_pieces_are_kept_per_tenant():
    """One tenant's text tokenized fast never says another tenant sent it: pieces
    kept for one scope are tokenized again for another."""
    tok = demo_tokenizer(1024)
    pieces = Pieces(tok)
    past_the_check(pieces, tok)
    text = tok.apply_chat_template(conversation(random.Random(3), 1), add_generation_prompt=True, tokenize=False)
    whole = tok.encode(text, add_special_tokens=False)
    assert pieces.encode(text, "salt-a") == whole
    tokenized = pieces.counts["pieces_tokenized"]
    assert pieces.encode(text, "salt-a") == whole and pieces.counts["pieces_tokenized"] == tokenized
    assert pieces.encode(text, "salt-b") == whole and pieces.counts["pieces_tokenized"] > tokenized
