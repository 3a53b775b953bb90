"""What a snapshot is: one layer's cache state over a span of token positions.

A range snapshot holds the positions `[start, end)`; a whole-state snapshot
holds everything the layer needs to continue from `end` (start only records
the span it was taken over). Snapshots own their arrays: nothing in them is a
view of a live cache buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

Scalar = int | float | bool | str | None


@dataclass(eq=False)
class Snapshot:
    """One layer's state over `[start, end)`, as evaluated, owned MLX arrays.

    kind: registry name of the cache kind that made it (e.g. "kv").
    start, end: the span of token positions it covers.
    whole: True when it is the whole state at `end` (window, recurrent kinds).
    arrays: kind-specific arrays, by name.
    scalars: kind-specific settings and cursors (bits, window size, ...).
    children: per-sub-cache snapshots, for composite kinds (cache lists);
        None for a whole-state sub-cache with no state at `end` (see `complete`).
    """

    kind: str
    start: int
    end: int
    whole: bool
    arrays: dict[str, mx.array] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)
    children: tuple[Snapshot | None, ...] = ()

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        own = sum(a.nbytes for a in self.arrays.values())
        return own + sum(c.nbytes for c in self.children if c is not None)

    @property
    def complete(self) -> bool:
        """Restorable at `end` on its own chain: no sub-cache lacks its state there.
        (A cache list split where its recurrent sub-cache has no state keeps its
        attention sub-cache's range, and None for the recurrent one.)"""
        return all(c is not None and c.complete for c in self.children)

    def all_arrays(self) -> list[mx.array]:
        out = list(self.arrays.values())
        for c in self.children:
            if c is not None:
                out.extend(c.all_arrays())
        return out

    def eval(self) -> Snapshot:
        """Materialise every array now (snapshots are taken lazily)."""
        mx.eval(self.all_arrays())
        return self

    def __repr__(self) -> str:
        return (
            f"Snapshot(kind={self.kind!r}, span=[{self.start}, {self.end}), whole={self.whole}, nbytes={self.nbytes})"
        )


def own(x: mx.array) -> mx.array:
    """A copy of `x` that shares no buffer with it (a slice must not pin its parent)."""
    # mx.contiguous returns its input when that is already contiguous, sharing
    # the buffer; constructing an array from an array always copies.
    return mx.array(x)


def arrays_equal(a: Snapshot | None, b: Snapshot | None) -> bool:
    """Bitwise equality of two snapshots: span, scalars, dtypes, shapes and bytes."""
    if a is None or b is None:
        return a is b
    if (a.kind, a.start, a.end, a.whole, a.scalars) != (
        b.kind,
        b.start,
        b.end,
        b.whole,
        b.scalars,
    ):
        return False
    if a.arrays.keys() != b.arrays.keys() or len(a.children) != len(b.children):
        return False
    for name, x in a.arrays.items():
        y = b.arrays[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.size and not mx.array_equal(x.view(mx.uint8), y.view(mx.uint8)).item():
            return False
    return all(arrays_equal(x, y) for x, y in zip(a.children, b.children))  # None == None only
