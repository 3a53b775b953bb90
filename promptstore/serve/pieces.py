"""Tokenizing a rendered prompt piece by piece, keeping the pieces seen lately.

A chat's every request renders the whole conversation, and its text is
tokenized whole: mlx_lm.server does it twice (the prompt, then the system
prompt alone to find where it ends), about 9 ms each for 5k tokens of a
byte-level BPE on one core, the largest part of a hot round's work before its
prefill. A tokenizer splits its special tokens (those matched as they are
written: no whitespace stripped around them, no normalization) out of the text
before it tokenizes what lies between them, so the tokens of a piece between
two such tokens do not depend on the rest of the text. The system prompt, and
every earlier message, come back unchanged as such pieces; their tokens are
kept (least recently used out first) and only the new pieces are tokenized.
Pieces are kept per tenant (`scope`): how fast one tenant's text is tokenized
never says whether another tenant sent it.

Whether a tokenizer behaves so is checked, not assumed: when the model loads,
on a sample of texts joined by its special tokens and on a sample conversation
rendered by its own chat template; then on the first requests' texts. Until
that many have agreed, a text is tokenized whole (what the request uses) and
piece by piece on a thread of its own, which waits while a request waits for
its first token (`busy`: on two cores, tokenizing beside a prefill delays it);
any difference turns pieces off for good (with a warning), and every text is
tokenized whole again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from .replies import plain_special_tokens

log = logging.getLogger("promptstore.serve")

CHECKED_REQUESTS = 4  # texts that must agree both ways (after the samples) before pieces are used
CHECK_WAIT_S = 1.0  # the longest a text's check waits for no request to be waiting for its first token
CHECK_POLL_S = 0.005
KEPT_PIECES = 1024
KEPT_CHARS = 32 << 20
SMALL_PIECE = 64  # pieces shorter than this are tokenized, not kept (a role name, a newline)
SAMPLES = [
    "plain words",
    " a leading space",
    "trailing space ",
    "\nnew lines\n\n",
    "  two  spaces  ",
    "digits 12345 and 3.14159",
    "ünïcödé — “quotes” 漢字 🙂",
    "tabs\tand\r\nreturns",
    "'s 've n't 're",
]


class Pieces:
    """Tokens of rendered texts (`encode`), equal to `tokenizer.encode(text,
    add_special_tokens=False)`; thread-safe."""

    def __init__(self, tokenizer, busy: Callable[[], bool] | None = None):
        self.tokenizer = tokenizer
        self.busy = busy  # while true, the checking thread waits (at most CHECK_WAIT_S a text)
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()  # (scope, piece): its tokens
        self._chars = 0
        self._agreed = 0  # texts whose pieces agreed with their whole tokenizing
        self._to_check: deque[tuple[str, object, list[int]]] = deque()
        self._checker: threading.Thread | None = None
        self._checked = threading.Condition(self._lock)
        self.counts = {"pieces_reused": 0, "pieces_tokenized": 0}
        specials = plain_special_tokens(tokenizer)
        self._ids = {text: token_id for token_id, text in specials.items()}
        self._pattern = (
            re.compile("|".join(re.escape(t) for t in sorted(self._ids, key=len, reverse=True))) if self._ids else None
        )
        self.enabled = self._pattern is not None and self._sample_agrees()
        if not self.enabled:
            log.info("prompts are tokenized whole: the tokenizer does not tokenize them piece by piece alike")

    def whole(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def encode(self, text: str, scope=None) -> list[int]:
        """`text`'s tokens; `scope` (a tenant's salt) keeps its pieces apart from other scopes'."""
        if not self.enabled:
            return self.whole(text)
        if self._agreed >= CHECKED_REQUESTS:
            return self._pieced(text, scope)
        whole = self.whole(text)
        self._check_later(text, scope, whole)
        return whole

    def _check_later(self, text: str, scope, whole: list[int]) -> None:
        """Tokenize `text` piece by piece on the checking thread and compare (the
        request goes on with `whole` meanwhile); its pieces are kept."""
        with self._lock:
            if self._agreed + len(self._to_check) >= CHECKED_REQUESTS:
                return  # enough texts are being checked already
            self._to_check.append((text, scope, whole))
            if self._checker is None:
                self._checker = threading.Thread(target=self._check, name="promptstore-pieces-check", daemon=True)
                self._checker.start()

    def _check(self) -> None:
        while True:
            with self._lock:
                if not self._to_check or not self.enabled:
                    self._to_check.clear()
                    self._checker = None
                    self._checked.notify_all()
                    return
                text, scope, whole = self._to_check[0]
            self._give_way()
            try:
                agrees = self._pieced(text, scope) == whole
            except Exception as e:  # a text the pieces cannot tokenize: tokenize whole
                log.debug("piecewise tokenizing failed: %s", e)
                agrees = False
            with self._lock:
                self._to_check.popleft()
                if agrees:
                    self._agreed += 1
                else:
                    self.enabled = False
                    log.warning("prompts are tokenized whole from now on: a text tokenized piece by piece differed")

    def _give_way(self) -> None:
        """Wait while `busy()` says a request waits for its first token, at most CHECK_WAIT_S."""
        end = time.monotonic() + CHECK_WAIT_S
        try:
            while self.busy is not None and self.busy() and time.monotonic() < end:
                time.sleep(CHECK_POLL_S)
        except Exception as e:  # a server closing under it: check now
            log.debug("the pieces check did not wait: %s", e)

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until the texts handed to the checking thread are checked (tests, a
        clean close); whether they were within `timeout`."""
        with self._checked:
            return self._checked.wait_for(lambda: self._checker is None, timeout)

    def _pieced(self, text: str, scope) -> list[int]:
        return self._split(text, lambda piece: self._piece(piece, scope))

    def _split(self, text: str, encode_piece) -> list[int]:
        """The special tokens' ids, and `encode_piece` of the text between them."""
        out: list[int] = []
        at = 0
        for m in self._pattern.finditer(text):
            if m.start() > at:
                out += encode_piece(text[at : m.start()])
            out.append(self._ids[m.group()])
            at = m.end()
        if at < len(text):
            out += encode_piece(text[at:])
        return out

    def _piece(self, piece: str, scope) -> tuple[int, ...] | list[int]:
        if len(piece) < SMALL_PIECE:
            return self.whole(piece)
        key = (scope, piece)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                self.counts["pieces_reused"] += 1
                return kept
        tokens = tuple(self.whole(piece))
        with self._lock:
            self.counts["pieces_tokenized"] += 1
            if key not in self._kept and len(piece) <= KEPT_CHARS // 4:
                self._kept[key] = tokens
                self._chars += len(piece)
                while len(self._kept) > KEPT_PIECES or self._chars > KEPT_CHARS:
                    (_, old), _ = self._kept.popitem(last=False)
                    self._chars -= len(old)
        return tokens

    def _sample_agrees(self) -> bool:
        """Whether texts joined by special tokens, and a conversation rendered by
        the tokenizer's chat template, tokenize whole as piece by piece."""
        texts = self._split_samples()
        try:
            texts += self._rendered_samples()
            return all(self.whole(text) == self._split(text, self.whole) for text in texts)
        except Exception as e:  # a tokenizer this cannot read: tokenize whole
            log.debug("piecewise tokenizing not checked: %s", e)
            return False

    def _split_samples(self) -> list[str]:
        """The sample texts joined by special tokens."""
        specials = sorted(self._ids)
        return [
            a + special + SAMPLES[(i + 3) % len(SAMPLES)] + special + a
            for i, a in enumerate(SAMPLES)
            for special in specials[:4]
        ]

    def _rendered_samples(self) -> list[str]:
        """The sample texts as a conversation in the tokenizer's chat template (none
        without one, or where it renders no such conversation)."""
        render = getattr(self.tokenizer, "apply_chat_template", None)
        if render is None or not getattr(self.tokenizer, "chat_template", None):
            return []
        turns = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(SAMPLES)]
        out = []
        for messages in ([{"role": "system", "content": "".join(SAMPLES)}, *turns], turns):
            try:
                text = render(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # a template that takes no system message, or asks for other roles
                log.debug("the chat template did not render a sample: %s", e)
                continue
            if isinstance(text, str):
                out.append(text)
        return out


class PieceTokenizer:
    """A tokenizer whose `apply_chat_template(..., tokenize=True)` renders the
    text and tokenizes it through `Pieces` (in `scope`: a tenant's salt);
    everything else is the tokenizer's own."""

    def __init__(self, tokenizer, pieces: Pieces, scope=None):
        self._tokenizer, self._pieces, self._scope = tokenizer, pieces, scope

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, conversation, *args, **kwargs):
        tokenize = kwargs.get("tokenize", True)
        if not tokenize or kwargs.get("return_dict") or kwargs.get("return_tensors") or not self._pieces.enabled:
            return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)
        text = self._tokenizer.apply_chat_template(conversation, *args, **{**kwargs, "tokenize": False})
        if not isinstance(text, str):
            return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)
        return self._pieces.encode(text, self._scope)

    def encode(self, text, *args, **kwargs):
        if isinstance(text, str) and kwargs.get("add_special_tokens") is False and not args and len(kwargs) == 1:
            return self._pieces.encode(text, self._scope)
        return self._tokenizer.encode(text, *args, **kwargs)
