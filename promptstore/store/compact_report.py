"""What compact found and did: each action with its reason, routine upkeep or a
repair of damage, and the status a run ends with (clean, repaired, failed)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why compact acts on a healthy store: its upkeep, and what normal work or a crash
# leaves behind by design (DESIGN.md, invariant 3: a killed process leaves leftovers
# compact reclaims). Every other reason is damage: data a record names that is bad
# or gone, something planted where a snapshot file belongs, damaged index entries.
ROUTINE = frozenset(
    {
        "temporary files",  # a writer died before renaming its file
        "orphan files",  # a crash between writing and publishing, or unpublishing and deleting
        "merged chains",
        "over budget",
        "counters",  # totals recounted from the trie
        "remote blobs gone from the server",
        "LMDB space",
    }
)


@dataclass(frozen=True)
class Action:
    """One thing compact did, or in a dry run would do, and why."""

    kind: str  # the verb: delete, quarantine, unfile, drop, rebuild, merge, evict, recount, forget, compact, set aside
    target: str  # what it acts on: a path in the store, a node, a namespace, the index
    reason: str  # why: a row of the report's table
    damage: bool  # a repair (the store was damaged) rather than routine upkeep
    done: bool  # False in a dry run: it would be done
    nodes: int = 0
    files: int = 0
    bytes: int = 0


@dataclass
class CompactReport:
    """What compact found and did (or, in a dry run, would do)."""

    dry_run: bool
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    actions: dict = field(default_factory=dict)  # reason -> {"nodes", "files", "bytes"}: the log's totals
    log: list = field(default_factory=list)  # every Action, in order
    skipped: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    seconds: float = 0.0
    remote: dict | None = None  # with a remote tier: what this store published, what is stale

    def add(self, kind: str, target: str, reason: str, nodes: int = 0, files: int = 0, nbytes: int = 0) -> None:
        """Record an action (done, or in a dry run due); its reason says whether it repairs damage."""
        action = Action(kind, target, reason, reason not in ROUTINE, not self.dry_run, nodes, files, nbytes)
        self.log.append(action)
        row = self.actions.setdefault(reason, {"nodes": 0, "files": 0, "bytes": 0})
        row["nodes"] += nodes
        row["files"] += files
        row["bytes"] += nbytes

    @property
    def changed(self) -> bool:
        return any(any(v for v in row.values()) for row in self.actions.values())

    @property
    def damaged(self) -> bool:
        """Whether compact found damage (and repaired it, or in a dry run would)."""
        return any(a.damage for a in self.log)

    @property
    def status(self) -> str:
        """clean: healthy, whatever routine upkeep ran; repaired: damage found and repaired
        (a dry run: found, and a run would repair it); failed: a step failed."""
        if self.errors:
            return "failed"
        return "repaired" if self.damaged else "clean"
