"""When the inserts mlx-lm hands the prompt cache run, on the generation thread.

Who owns an insert's tokens is settled when it is handed over (serve/cache.py);
the store's work (an index commit synced to disk among it) is done later, never
inside a request's time to its first token. A part of a prompt (mlx-lm stores
it at a segment's end, before it hands out the prompt's first token) waits for
`run_deferred`, which the generation thread calls before a batch step once no
request waits for its first token, before it waits for a request, and before
any fetch (so a fetch finds every earlier part of a prompt); at most one part
of each request waits (its next part replaces it where every cache restores any
prefix of what it holds, and runs it first where a layer's state there is had
only now). A finished request's insert (its reply, rendered as the next turn
will send it, which costs a prefill) waits for `run_background`: when the
generation thread has no request to take, or no request in its batch still
waits for its first token; the chat replies then waiting run together, up to
`reply_batch` of them in one batched prefill (serve/reply_inserts.py). The
next turn of that conversation, when it comes first, runs it (with the other
replies waiting) before its fetch (`replies_before_fetch`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import PromptStoreError
from ..store.group import GroupLost

log = logging.getLogger("promptstore.serve")

FINISHED_LIMIT = 32  # finished requests' inserts that may wait, unless the server says its batch's size
REPLY_CHUNK_CPU = 8  # tokens of a reply's prefill between the points where it gives way to a request
REPLY_GRACE_CPU_S = 0.03  # on CPU, a finished request's insert begins no sooner than this after it ended


@dataclass(frozen=True)
class InsertSettings:
    """How the scheduler runs what waits.

    finished_at_once: a finished request's insert runs as it is handed over
        (distributed ranks must make the same calls at the same points).
    finished_limit: at most this many finished requests' inserts wait, each
        keeping its request's cache alive (the server's batch size).
    replies_before_fetch: a request runs the waiting insert of its own
        conversation's last reply before its fetch. mlx-lm pads a batch's prompts
        to the longest, so a next turn that prefills its previous reply makes
        every prompt of its batch that long: on CPU that multiplies the batch's
        prefill (a round of six chats on 2 cores: 550 ms to the first tokens
        against 165); on an H200 a batch of four ~5k-token chats padded from ~19
        to ~69 new tokens took 60-100 ms longer, a reply's insert alone 21-74 ms,
        median 38 (docs/serve.md).
    reply_chunk: tokens of a reply's prefill between the points where a waiting
        insert gives way to a request that came (None: all at once). On CPU a
        reply of ~40 tokens took ~30 ms, and the requests of a new conversation
        arriving meanwhile waited all of it (chat round 1 of bench_serve: 21-51 ms).
    reply_grace: seconds a finished request's insert waits before it may begin
        (0: at once). Clients send as a reply ends: bench_serve's chat sends the
        other users' requests 6 ms after the first user's reply, and on CPU they
        waited 10-18 ms behind the first chunk of its insert, begun at once. Its
        next turn, or a close, runs it whatever the grace.
    in_group: a rank of a distributed group: an insert that fails outside the
        store (its forward: a collective whose peer is gone) fails the generation
        loop, and the group stops; going on, the rank would wait in its next
        collective for ever, and its store could not close (the stream is held).
    reply_batch: at most this many chat replies waiting are prefilled together,
        in one batched forward per chunk (1: one after another). On an H200 a
        reply's prefill alone took 23-70 ms, and 8 of them one after another
        ~300 ms in front of the next round (issue 62).
    """

    finished_at_once: bool = False
    finished_limit: int = FINISHED_LIMIT
    replies_before_fetch: bool = True
    reply_chunk: int | None = None
    reply_grace: float = 0.0
    reply_batch: int = 1
    in_group: bool = False

    @classmethod
    def for_server(cls, *, batch: int, replies_before_fetch: bool, reply_batch: int | None = None) -> InsertSettings:
        """The server's, for the device MLX runs on: on CPU a reply's prefill gives
        way every REPLY_CHUNK_CPU tokens and waits its grace; on a GPU one forward
        of the whole reply costs about what one of 8 tokens does (a grace there
        was not measured: none). reply_batch: None for the device's default: on
        CPU the batch's size, where a reply prefilled alone runs as ~6 forwards
        of 8 tokens and a group of 8 as ~6 forwards in all (bench_serve's
        chat-8: rounds 2-7 at 316-411 ms against 383-658 one at a time); on a
        GPU 1: on an H200 a batched forward of 8 replies took 130-370 ms against
        25-42 ms a reply alone, and one at a time gives way to a request
        between replies (docs/serve.md, "Storing the replies of a round")."""
        on_cpu = mx.default_device() == mx.cpu
        in_group = mx.distributed.init().size() > 1
        return cls(
            finished_at_once=in_group,
            in_group=in_group,
            finished_limit=max(1, batch),
            replies_before_fetch=replies_before_fetch,
            # A group stores a reply as it finishes, with nothing to give way to between
            # chunks: each chunk would only be one more forward, a collective round on every rank.
            reply_chunk=REPLY_CHUNK_CPU if on_cpu and not in_group else None,
            reply_grace=REPLY_GRACE_CPU_S if on_cpu else 0.0,
            reply_batch=max(1, reply_batch or (batch if on_cpu else 1)),
        )


@dataclass
class WaitingInsert:
    """An insert handed over by mlx-lm and not yet done."""

    work: Callable[[], Iterator[None]]  # its steps: a reply's prefill yields between chunks
    n_tokens: int
    cache_type: str
    owners: frozenset  # the requests whose tokens these are (at most one part of each request's prompt waits)
    asked: list[int]  # a finished request's prompt: its next turn goes on with it
    steps: Iterator[None] | None = None  # begun and paused (run_background's `until`)
    tokens: list[int] = field(default_factory=list)  # a part of a prompt: its tokens
    ranged: bool = False  # its caches restore any prefix of what they hold (a longer part stores its tokens too)
    ready_at: float = 0.0  # a finished request's insert: not begun before this (time.monotonic; `reply_grace`)
    reply: object | None = None  # a chat reply's job, which may run together with others (serve/reply_inserts.py)
    members: tuple = ()  # a group of replies run together: theirs

    def said(self) -> str:
        if self.members:
            return f"{len(self.members)} replies, {self.n_tokens} tokens"
        return f"{self.n_tokens} tokens ({self.cache_type})"

    def goes_on_with(self, prompt: list[int]) -> bool:
        """Whether `prompt` goes on with this finished request's (or a member's)."""
        return any(_goes_on_with(prompt, m.asked) for m in self.members) or _goes_on_with(prompt, self.asked)


def _goes_on_with(prompt: list[int], earlier: list[int]) -> bool:
    """Whether `earlier` is a prefix of `prompt`. Its last token is compared first:
    a fetch asks this of every waiting reply (up to the batch's size), and the
    slice and compare of ~5k tokens each took ~0.2 ms for 32 of them."""
    n = len(earlier)
    return 0 < n <= len(prompt) and prompt[n - 1] == earlier[-1] and prompt[:n] == earlier


class InsertScheduler:
    """The inserts waiting: parts of prompts (`_deferred`) and finished requests'
    (`_background`). counts: where what it drops, pauses and replaces is counted;
    timed: a context manager around each insert's work (the generation thread's
    time in store calls)."""

    def __init__(
        self,
        settings: InsertSettings,
        counts: Counter,
        timed: Callable[[], AbstractContextManager[None]],
        together: Callable[[list], Iterator[None]] | None = None,
    ):
        """together: runs several replies' jobs as one insert (their `reply`s)."""
        self.settings = settings
        self._counts, self._timed, self._together = counts, timed, together
        self._deferred: deque[WaitingInsert] = deque()  # parts of prompts handed over, not yet done
        self._background: deque[WaitingInsert] = deque()  # finished requests', done when nothing waits

    def add_part(self, item: WaitingInsert) -> None:
        """A part of a prompt: it waits for run_deferred."""
        earlier = [waiting for waiting in self._deferred if item.owners & waiting.owners]
        if earlier and all(
            w.ranged and w.owners <= item.owners and w.tokens == item.tokens[: len(w.tokens)] for w in earlier
        ):
            # Its own request's earlier part, of caches that restore any prefix
            # and owned by no other request: this insert stores its tokens too
            # (with the same owners' retention), so it need not run now, in
            # front of the request's first token.
            for waiting in earlier:
                self._deferred.remove(waiting)
                self._counts["prompt_parts_superseded"] += 1
        elif earlier:
            self.run_deferred()  # at most one part of each request's prompt waits
        self._deferred.append(item)

    def add_finished(self, item: WaitingInsert) -> None:
        """A finished request's insert: it waits for run_background (at once with
        `finished_at_once`), the oldest dropped past `finished_limit`."""
        if self.settings.finished_at_once:
            self._run(item)
            return
        if len(self._background) >= self.settings.finished_limit:
            dropped = self._background.popleft()  # the oldest reply: its next turn re-prefills it, if it comes
            self._counts["reply_inserts_dropped"] += max(1, len(dropped.members))
            log.debug("a finished request's insert dropped: %d wait already", self.settings.finished_limit)
        item.ready_at = time.monotonic() + self.settings.reply_grace
        self._background.append(item)

    def run_deferred(self) -> None:
        """Do the inserts handed over since the last call, in order (generation thread)."""
        while self._deferred:
            self._run(self._deferred.popleft())

    @property
    def has_background(self) -> bool:
        return bool(self._background)

    def background_wait(self) -> float:
        """Seconds until the oldest finished request's insert may begin (0: it
        may now, or has begun; `reply_grace`); call with `has_background`."""
        item = self._background[0]
        return 0.0 if item.steps is not None else max(0.0, item.ready_at - time.monotonic())

    def run_background(self, n: int | None = None, until: Callable[[], bool] | None = None) -> None:
        """Do up to `n` (all when None) of the finished requests' inserts, oldest
        first (generation thread), after the parts of prompts handed over before them.
        until: asked between the chunks of a reply's prefill (`reply_chunk`); once
        it says so (a request waits), the insert pauses and keeps its place, to go
        on at the next call or when its conversation's next turn comes."""
        self.run_deferred()
        while self._background and (n is None or n > 0):
            item = self._next()
            if self._run(item, until) is None:
                self._background.appendleft(item)
                self._counts["reply_inserts_paused"] += 1
                return
            n = None if n is None else n - 1

    def run_replies_of(self, prompt: list[int]) -> None:
        """Run the waiting inserts of the conversations `prompt` goes on with (their
        finished request's prompt is a prefix of it), oldest first."""
        own = [item for item in self._background if item.goes_on_with(prompt)]
        for item in own:
            if item not in self._background:
                continue  # run already, in a group with an earlier one
            self._background.remove(item)
            self._background.appendleft(item)
            self._run(self._next())

    def flush(self) -> tuple[int, list[str]]:
        """Run every insert still waiting, parts of prompts first (generation
        thread, at the close): how many were stored, and what was not."""
        stored, failed = 0, []
        while self._deferred or self._background:
            item = self._deferred.popleft() if self._deferred else self._next()
            if self._run(item):
                stored += max(1, len(item.members))
            else:
                failed.append(item.said())
        return stored, failed

    def waiting(self) -> list[str]:
        """Every insert still waiting, as the closing line names one."""
        return [m.said() for item in (*self._deferred, *self._background) for m in (item.members or (item,))]

    def _next(self) -> WaitingInsert:
        """The oldest finished request's insert, taken out: a chat reply not begun
        goes with the other replies not begun, up to `reply_batch`, as one group."""
        item = self._background.popleft()
        if item.reply is None or item.steps is not None or self.settings.reply_batch < 2 or self._together is None:
            return item
        members = [item]
        for other in list(self._background):
            if len(members) >= self.settings.reply_batch:
                break
            if other.reply is not None and other.steps is None:
                self._background.remove(other)
                members.append(other)
        if len(members) == 1:
            return item
        jobs = [m.reply for m in members]
        together = self._together
        return WaitingInsert(
            lambda: together(jobs),
            sum(m.n_tokens for m in members),
            "replies",
            frozenset().union(*(m.owners for m in members)),
            [],
            members=tuple(members),
        )

    def _run(self, item: WaitingInsert, until: Callable[[], bool] | None = None) -> bool | None:
        """Run an insert to its end (True), or until `until()` between its steps
        (None: paused, its state kept); False if it failed (logged: the store
        leaves itself as it was)."""
        try:
            with self._timed():
                if item.steps is None:
                    item.steps = item.work()
                for _ in item.steps:
                    if until is not None and until():
                        return None
            return True
        except Exception as e:
            if self.settings.in_group and not isinstance(e, PromptStoreError):
                raise GroupLost(f"an insert's forward failed: {type(e).__name__}: {e}") from e
            log.exception("insert of %d tokens (%s) not stored", item.n_tokens, item.cache_type)
            return False
