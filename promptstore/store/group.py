"""A store kept by a distributed group (mlx.launch): each rank keeps its shard of
a model's cache, and the group restores only what every rank can.

Under tensor parallelism a rank's cache holds its attention heads; under pipeline
parallelism, its layers. So each rank keeps a store of its own, laid out under
the one folder the group is given (`ranks/<kind>-<size>/rank-<r>`; on machines of
their own, each machine's folder holds its rank's), and its namespace names the
shard (`Group.shard`), so a store written by another shape is never restored from.

A fetch is agreed: every rank looks up its own store, the group takes the shortest
hit, and a rank that restored more restores again to that length. A rank that
lost a file restores less, and so does the group: never a mixed state. Every rank
calls fetch with the same tokens, in the same order (as a sharded server's ranks
do, each running the same requests): each fetch is a collective.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx
import numpy as np

from ..errors import SettingsError
from .hit import Hit

if TYPE_CHECKING:
    from ..config import Settings

log = logging.getLogger("promptstore.store")

KINDS = ("tensor", "pipeline")
# Rounds of agreement before the group gives up on a hit and prefills from the start:
# each round a rank that restored more than another restores again, shorter.
AGREE_ROUNDS = 4


class GroupLost(BaseException):
    """A collective of the group failed: a rank is gone (killed, its machine lost).
    Not an Exception, so that no `except Exception` on the way (mlx-lm's loop
    fails one request at such a one and goes on) keeps a rank going: its next
    collective would wait for ever."""


@dataclass(frozen=True)
class Group:
    """One rank's place in a distributed group: `kind` of parallelism, `size`
    ranks, this one's `rank`. `handle`: the mx.distributed group its collectives use."""

    kind: Literal["tensor", "pipeline"]
    size: int
    rank: int
    handle: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, handle: Any = None, kind: str = "tensor") -> Group | None:
        """This process's group (`handle`, default mx.distributed.init()) as `kind`
        parallelism; None for a group of one, which keeps a plain store."""
        if kind not in KINDS:
            raise SettingsError(f"a group's parallelism is one of {KINDS}, not {kind!r}")
        handle = handle if handle is not None else mx.distributed.init()
        if handle.size() <= 1:
            return None
        return cls(kind, handle.size(), handle.rank(), handle)

    @property
    def name(self) -> str:
        """The group's shape: `tensor-2`, `pipeline-4`."""
        return f"{self.kind}-{self.size}"

    def folder(self, root: Path) -> Path:
        """This rank's store under the group's `root`."""
        return Path(root) / "ranks" / self.name / f"rank-{self.rank}"

    def settings(self, settings: Settings) -> Settings:
        """`settings` for a rank's store. Cold hits load or leave the rest to the
        prefill, never overlap: an overlapped hit prefills inside fetch, and a
        forward one rank runs alone waits forever for the others'. The remote tier
        is not kept per shard yet: refused."""
        if settings.remote_url is not None:
            raise SettingsError("a distributed group's store has no remote tier yet: leave remote_url unset")
        if settings.cold_plan in ("auto", "overlap"):
            return settings.model_copy(update={"cold_plan": "load"})
        return settings

    def shard(self, model: Any) -> str:
        """What of `model`'s cache this rank holds, as its namespace records it:
        `tensor 0/2`, `pipeline 1/2 layers 0-2` (the layers it runs)."""
        text = f"{self.kind} {self.rank}/{self.size}"
        inner = getattr(model, "model", None)
        if self.kind == "pipeline" and getattr(inner, "end_idx", None) is not None:
            text += f" layers {inner.start_idx}-{inner.end_idx}"
        return text

    # --- collectives: every rank calls each, in the same order ---------------------

    def span(self, value: int) -> tuple[int, int]:
        """The smallest and largest of every rank's `value`."""
        with self._collective():
            every = np.array(mx.distributed.all_gather(mx.array([int(value)], dtype=mx.int64), group=self.handle))
        return int(every.min()), int(every.max())

    def poll(self, flag: bool, leader: bool) -> tuple[bool, bool]:
        """In one collective: whether any rank's `flag` is set, and rank 0's `leader`."""
        mine = [int(bool(flag)), int(bool(leader)) if self.rank == 0 else 0]
        with self._collective():
            both = np.array(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=self.handle))
        return bool(both[0]), bool(both[1])

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, by rank (pickled; small objects only)."""
        data = pickle.dumps(obj)
        with self._collective():
            sizes = np.array(mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int64), group=self.handle))
            padded = np.zeros(int(sizes.max()), dtype=np.uint8)
            padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
            every = np.array(mx.distributed.all_gather(mx.array(padded), group=self.handle))
        rows = every.reshape(self.size, -1)
        return [pickle.loads(rows[r, : int(sizes[r])].tobytes()) for r in range(self.size)]

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank (pickled; small objects only)."""
        return self.gather(obj if self.rank == 0 else None)[0]

    @contextmanager
    def _collective(self):
        """A collective's failure as GroupLost: MLX says a peer is gone with a RuntimeError."""
        try:
            yield
        except RuntimeError as e:
            raise GroupLost(f"rank {self.rank}: {e}") from e

    def agreed(self, local: Callable[[int | None], Hit], empty: Callable[[], Hit]) -> tuple[Hit, int]:
        """The hit every rank restores, and how many times this rank restored again.

        local(limit): this rank's hit, at most `limit` tokens (None: as long as it
            has). One that raises is taken as an empty hit (`empty()`): a rank that
            left the collectives below would leave the others waiting.
        """
        hit, again = self._local(local, None, empty), 0
        for _ in range(AGREE_ROUNDS):
            low, high = self.span(hit.length)
            if low == high:
                break
            if hit.length > low:
                log.info("group: rank %d restores %d tokens again, to the group's %d", self.rank, hit.length, low)
                hit, again = self._local(local, low, empty), again + 1
        else:
            log.warning("group: the ranks did not agree on a hit in %d rounds; prefilling from the start", AGREE_ROUNDS)
            hit = empty()
        # The prefill takes its checkpoints where rank 0 says: ranks that split it
        # elsewhere would run a different number of forwards, each a collective.
        return replace(hit, checkpoints=tuple(self.share(tuple(p for p in hit.checkpoints if p > hit.length)))), again

    def _local(self, local: Callable[[int | None], Hit], limit: int | None, empty: Callable[[], Hit]) -> Hit:
        try:
            return local(limit)
        except Exception as e:  # noqa: BLE001 - any failure: this rank restores nothing
            log.error("group: rank %d could not fetch (%s: %s); it restores nothing", self.rank, type(e).__name__, e)
            return empty()


def rank_stores(root: Path) -> list[Path]:
    """The ranks' stores under a group's `root` (`ranks/<shape>/rank-<r>`, every
    shape a group ran there), in order; none where no group ran. Operator tools
    (stats, compact) take each as a store of its own."""
    found = [p for p in Path(root).glob("ranks/*/rank-*") if (p / "index" / "data.mdb").is_file()]
    return sorted(found, key=lambda p: (p.parent.name, len(p.name), p.name))
