"""A deliberately naive reference trie the index is checked against.

A namespace's trie is the set of its node prefixes (tuples of tokens); a node's
parent is its longest proper prefix in the set. Everything is brute force.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def lcp(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class RefTrie:
    roles: tuple[str, ...]  # per layer: "range", "state" or "window"
    nodes: dict[tuple, tuple[tuple[bool, ...], int]] = field(default_factory=dict)  # prefix -> (present, nbytes)

    def matched(self, seq: tuple) -> int:
        return max((lcp(seq, p) for p in self.nodes), default=0)

    def parent(self, p: tuple) -> tuple:
        return max(
            (q for q in self.nodes if len(q) < len(p) and p[: len(q)] == q),
            key=len,
            default=(),
        )

    def path(self, seq: tuple) -> list[tuple]:
        m = self.matched(seq)
        path = sorted((p for p in self.nodes if len(p) <= m and seq[: len(p)] == p), key=len)
        if (len(path[-1]) if path else 0) < m:
            path.append(min((p for p in self.nodes if len(p) > m and p[:m] == seq[:m]), key=len))
        return path

    def spans(self, seq: tuple) -> list[tuple[int, int]]:
        return [(len(self.parent(p)), len(p)) for p in self.path(seq)]

    def restorable(self, seq: tuple) -> int:
        nodes = [(len(self.parent(p)), len(p), self.nodes[p][0]) for p in self.path(seq)]
        for pos in range(self.matched(seq), 0, -1):
            if all(self._reaches(i, role, pos, nodes) for i, role in enumerate(self.roles)):
                return pos
        return 0

    @staticmethod
    def _reaches(i: int, role: str, pos: int, nodes) -> bool:
        if role == "state":
            return any(end == pos and present[i] for _, end, present in nodes)
        if role == "window":
            return True  # the index leaves window layers to the store
        return all(present[i] for start, _, present in nodes if start < pos)

    def plan(self, seq: tuple) -> tuple[int, int | None, bool]:
        """(matched, split position or None, whether a new leaf is added)."""
        m = self.matched(seq)
        path = self.path(seq)
        split = m if path and len(path[-1]) > m else None
        return m, split, m < len(seq)

    def insert(self, seq: tuple, new, upper=None, lower=None) -> list[tuple]:
        """Apply an insert; records are (present, nbytes). Returns created prefixes in order."""
        m, split, leaf = self.plan(seq)
        created = []
        if split is not None:
            self.nodes[self.path(seq)[-1]] = lower
            self.nodes[seq[:m]] = upper
            created.append(seq[:m])
        if leaf:
            self.nodes[seq] = new
            created.append(seq)
        return created

    def is_leaf(self, p: tuple) -> bool:
        return not any(len(q) > len(p) and q[: len(p)] == p for q in self.nodes)

    def tokens_stored(self) -> int:
        return sum(len(p) - len(self.parent(p)) for p in self.nodes)
