"""The radix trie of a namespace, as operations on one LMDB transaction.

Lookup walks children entries from the namespace root and compares edge tokens,
so a key can only ever cost a miss. Insert is planned in a read transaction and
applied in a write transaction that first re-walks to prove the plan is current.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import lmdb
import numpy as np

from promptstore.errors import (
    CorruptRecordError,
    KeyCollisionError,
    NodeHasChildrenError,
    NodeNotFoundError,
    RecordLayoutError,
    StaleInsertError,
    UnknownNamespaceError,
)

from . import access, counters, keys
from .env import Dbs
from .namespace import Namespace
from .records import Node, NodeRecord, check_record_layout, decode_node, encode_node, stored_namespace

log = logging.getLogger("promptstore.index")


@dataclass(frozen=True)
class Match:
    """The longest stored prefix of a token sequence, and how much of it can be restored.

    path: nodes from the root down; the last may be matched only partly.
    matched: leading tokens found in the trie.
    restorable: deepest position <= matched that every layer can restore to.
    restorable_depth: index in path of the node with start < restorable <= end (-1 at 0).
    checkpoints: positions in (restorable, matched] where snapshots taken while
        prefilling would make later requests that diverge there restorable (state
        layers' state at a node end; a branch point inside the last node).
    corrupt: keys of nodes that failed to decode or verify (the walk stopped there).
    """

    namespace: Namespace
    path: list[Node]
    matched: int
    restorable: int
    restorable_depth: int
    checkpoints: tuple[int, ...] = ()
    corrupt: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class SplitPlan:
    """Node `key` covering [start, end) is cut at `at`: a new node `upper_key` takes
    [start, at) and `key` keeps [at, end) (its key is that of its prefix, unchanged)."""

    key: bytes
    upper_key: bytes
    start: int
    at: int
    end: int


@dataclass(frozen=True)
class InsertPlan:
    """What inserting `tokens` needs: an optional split, then a leaf for [matched, len)."""

    namespace: Namespace
    tokens: np.ndarray
    match: Match
    split: SplitPlan | None
    parent: bytes
    leaf_key: bytes | None
    collision: bytes | None = None

    @property
    def matched(self) -> int:
        return self.match.matched

    @property
    def span(self) -> tuple[int, int]:
        """The new tokens to store, [matched, len(tokens)); empty if all are stored."""
        return self.match.matched, len(self.tokens)

    @property
    def path_keys(self) -> tuple[bytes, ...]:
        return tuple(node.key for node in self.match.path)

    @property
    def changes_nothing(self) -> bool:
        return self.split is None and self.leaf_key is None


@dataclass(frozen=True)
class InsertResult:
    """key: the node that ends at len(tokens); created: new node keys; stored: new tokens;
    unnamed: cold files that records named before this insert and name no more (a split
    node's file spans its old edge), read inside the write transaction."""

    key: bytes
    created: tuple[bytes, ...]
    split: bytes | None
    stored: int
    unnamed: tuple[str, ...] = ()


SplitRecords = tuple[NodeRecord, NodeRecord]


# --- reading ----------------------------------------------------------------


def read_node(txn: lmdb.Transaction, dbs: Dbs, key: bytes) -> Node | None:
    """The node at `key`, None if absent; CorruptRecordError if it does not verify."""
    value = txn.get(key, db=dbs.nodes)
    if value is None:
        return None
    return decode_node(key, value, txn.get(key, db=dbs.edges))


def child_keys(txn: lmdb.Transaction, dbs: Dbs, parent: bytes) -> list[bytes]:
    cursor = txn.cursor(db=dbs.children)
    if not cursor.set_range(parent):
        return []
    out = []
    for k, v in cursor:
        if bytes(k[: keys.KEY_SIZE]) != parent:
            break
        if len(v) == keys.KEY_SIZE:  # a damaged entry is no child
            out.append(bytes(v))
    return out


def has_children(txn: lmdb.Transaction, dbs: Dbs, parent: bytes) -> bool:
    cursor = txn.cursor(db=dbs.children)
    return cursor.set_range(parent) and bytes(cursor.key()[: keys.KEY_SIZE]) == parent


# --- lookup -----------------------------------------------------------------


def walk(txn: lmdb.Transaction, dbs: Dbs, ns: Namespace, tokens: np.ndarray) -> Match:
    """Follow `tokens` from the root of `ns` as far as stored edges agree."""
    query = tokens.tobytes()
    n = len(tokens)
    path: list[Node] = []
    corrupt: list[bytes] = []
    parent, depth, matched = ns.key, 0, 0
    while depth < n:
        node = _child(txn, dbs, ns, parent, int(tokens[depth]), depth, corrupt)
        if node is None:
            break
        agree = _agreeing(node, query, tokens, depth)
        if agree == 0:
            _report(corrupt, node.key, "edge does not start with its child token")
            break
        path.append(node)
        matched = depth + agree
        if matched < node.end:
            break
        parent, depth = node.key, node.end
    return _match(ns, path, matched, corrupt)


def _child(txn, dbs, ns, parent: bytes, token: int, depth: int, corrupt: list[bytes]) -> Node | None:
    key = txn.get(keys.child_key(parent, token), db=dbs.children)
    if key is None:
        return None
    key = bytes(key)
    if len(key) != keys.KEY_SIZE:
        _report(corrupt, key, f"children entry of {len(key)} bytes is not a node key")
        return None
    try:
        node = read_node(txn, dbs, key)
    except CorruptRecordError as e:
        _report(corrupt, key, str(e))
        return None
    if node is None:
        _report(corrupt, key, "children entry points at a missing node")
    elif (node.namespace, node.parent, node.start, node.n_layers) != (
        ns.key,
        parent,
        depth,
        ns.n_layers,
    ):
        _report(corrupt, key, "node header disagrees with its place in the trie")
        return None
    return node


def _report(corrupt: list[bytes], key: bytes, why: str) -> None:
    log.warning("index node %s treated as missing: %s", key.hex(), why)
    corrupt.append(key)


def _agreeing(node: Node, query: bytes, tokens: np.ndarray, depth: int) -> int:
    """How many of the node's edge tokens agree with the query from `depth` on."""
    span = min(node.end - node.start, len(tokens) - depth)
    if node.edge[: 4 * span] == query[4 * depth : 4 * (depth + span)]:
        return span
    differs = node.tokens[:span] != tokens[depth : depth + span]
    return int(np.argmax(differs))


def _match(ns: Namespace, path: list[Node], matched: int, corrupt: list[bytes]) -> Match:
    restorable = _restorable(ns, path, matched)
    depth = next((i for i, node in enumerate(path) if node.start < restorable <= node.end), -1)
    return Match(
        ns,
        path,
        matched,
        restorable,
        depth,
        _checkpoints(ns, path, matched, restorable),
        corrupt,
    )


def _restorable(ns: Namespace, path: list[Node], matched: int) -> int:
    # Range layers reach any position up to the first node that lacks one of them;
    # state layers only the end of a node that holds all of them. Window layers are
    # taken to reach wherever the others do: the store, which sees their positions,
    # restores at the deepest node end before this where they do.
    limit = matched
    for node in path:
        if ns.range_mask & ~node.present:
            limit = min(limit, node.start)
            break
    if not ns.state_mask:
        return limit
    best = 0
    for node in path:
        if node.end > limit:
            break
        if node.present & ns.state_mask == ns.state_mask:
            best = node.end
    return best


def _checkpoints(ns: Namespace, path: list[Node], matched: int, restorable: int) -> tuple[int, ...]:
    if not (ns.state_mask or ns.window_mask) or not path:
        return ()
    ends = [
        node.end for node in path if restorable < node.end <= matched and node.present & ns.state_mask != ns.state_mask
    ]
    if path[-1].start < matched < path[-1].end:
        ends.append(matched)  # the insert will split here, making a branch point
    return tuple(ends)


# --- insert -----------------------------------------------------------------


def plan(txn: lmdb.Transaction, dbs: Dbs, ns: Namespace, tokens: np.ndarray) -> InsertPlan:
    """What inserting `tokens` would change, as seen by `txn`."""
    match = walk(txn, dbs, ns, tokens)
    if match.corrupt:
        raise CorruptRecordError(
            f"cannot insert through corrupt node {match.corrupt[0].hex()}; remove or repair it first"
        )
    m, n = match.matched, len(tokens)
    hasher = keys.prefix_hasher(ns.key)
    hasher.update(tokens[:m].tobytes())
    split, parent = None, ns.key
    if match.path:
        last = match.path[-1]
        parent = last.key
        if m < last.end:
            split = SplitPlan(last.key, keys.digest(hasher.copy()), last.start, m, last.end)
            parent = split.upper_key
    leaf_key = None
    if m < n:
        hasher.update(tokens[m:].tobytes())
        leaf_key = keys.digest(hasher)
    collision = _collision(txn, dbs, ns, [split.upper_key if split else None, leaf_key])
    return InsertPlan(ns, tokens, match, split, parent, leaf_key, collision)


def _collision(txn, dbs, ns: Namespace, new_keys: Sequence[bytes | None]) -> bytes | None:
    """A new key that is already some other node's or namespace's address, if any."""
    seen = {ns.key}
    for key in new_keys:
        if key is None:
            continue
        taken = key in seen or txn.get(key, db=dbs.nodes) is not None
        if taken or txn.get(key, db=dbs.namespaces) is not None:
            return key
        seen.add(key)
    return None


@dataclass(frozen=True)
class CheckedInsert:
    """A plan proven current inside a write txn, with the records it needs."""

    plan: InsertPlan
    new_record: NodeRecord | None
    split_records: SplitRecords | None


def check(txn, dbs: Dbs, stale: InsertPlan, new_record, split_records) -> CheckedInsert:
    """Re-plan inside the write txn; refuse, before writing, a stale or unfit insert.

    split_records: a pair, or a function of the current plan that returns one.
    """
    current = plan(txn, dbs, stale.namespace, stale.tokens)
    if _decisions(current) != _decisions(stale):
        raise StaleInsertError(
            f"trie changed since plan_insert (matched {stale.matched} -> {current.matched}); plan again"
        )
    return vet(txn, dbs, current, new_record, split_records)


def vet(txn, dbs: Dbs, current: InsertPlan, new_record, split_records) -> CheckedInsert:
    """Refuse, before writing, colliding keys, an unknown namespace or unfit records."""
    ns = current.namespace
    if current.collision is not None:
        raise KeyCollisionError(f"key {current.collision.hex()} is taken by another prefix; insert refused")
    if txn.get(ns.key, db=dbs.namespaces) is None:
        raise UnknownNamespaceError(f"namespace {ns.hex} is not registered")
    if callable(split_records):
        split_records = split_records(current) if current.split else None
    _check_records(current, new_record, split_records)
    return CheckedInsert(current, new_record, split_records)


def _decisions(p: InsertPlan) -> tuple:
    return p.matched, p.path_keys, p.split


def _check_records(p: InsertPlan, new_record, split_records) -> None:
    if p.split is not None:
        if split_records is None:
            raise RecordLayoutError(
                f"insert splits node {p.split.key.hex()} at {p.split.at}; split_records=(upper, lower) required"
            )
        for record in split_records:
            check_record_layout(p.namespace, record)
    if p.leaf_key is not None:
        if new_record is None:
            raise RecordLayoutError(f"insert stores {p.span}; new_record required")
        check_record_layout(p.namespace, new_record)


def apply(txn: lmdb.Transaction, dbs: Dbs, checked: CheckedInsert) -> InsertResult:
    """Write a checked insert: the split, if any, then the new leaf."""
    p = checked.plan
    created: list[bytes] = []
    if p.split is not None:
        _split(txn, dbs, p, *checked.split_records)
        created.append(p.split.upper_key)
    if p.leaf_key is not None:
        _add_leaf(txn, dbs, p, checked.new_record)
        created.append(p.leaf_key)
    split_key = p.split.upper_key if p.split else None
    end_key = p.leaf_key or split_key or p.path_keys[-1]
    m, n = p.span
    unnamed = ()
    if p.split is not None:  # the split node's file goes, unless a half still names it
        kept = {r.file for r in checked.split_records}
        unnamed = tuple(f for f in file_of(p.match.path[-1]) if f not in kept)
    return InsertResult(end_key, tuple(created), split_key, n - m, unnamed)


def file_of(node: Node) -> tuple[str, ...]:
    """The cold file a node's record names, if any (none when the record is unreadable)."""
    try:
        return (node.record.file,) if node.record.file else ()
    except CorruptRecordError:
        return ()


def _split(txn, dbs, p: InsertPlan, upper: NodeRecord, lower: NodeRecord) -> None:
    """[start, end) becomes a new node [start, at) and the old one, re-parented, [at, end)."""
    ns_key, split, old = p.namespace.key, p.split, p.match.path[-1]
    cut = 4 * (split.at - split.start)
    upper_span, lower_span = (split.start, split.at), (split.at, split.end)
    _put_node(txn, dbs, split.upper_key, ns_key, old.parent, upper_span, upper, old.edge[:cut])
    _put_node(txn, dbs, old.key, ns_key, split.upper_key, lower_span, lower, old.edge[cut:])
    access.stamp(txn, dbs, split.upper_key)
    nbytes = upper.nbytes + lower.nbytes - old.nbytes
    counters.add(txn, dbs, ns_key, {"nodes": 1, "nbytes": nbytes})


def _add_leaf(txn, dbs, p: InsertPlan, record: NodeRecord) -> None:
    ns_key, (m, n) = p.namespace.key, p.span
    edge = p.tokens[m:].tobytes()
    _put_node(txn, dbs, p.leaf_key, ns_key, p.parent, (m, n), record, edge)
    access.stamp(txn, dbs, p.leaf_key)
    deltas = {"nodes": 1, "nbytes": record.nbytes, "tokens_stored": n - m}
    counters.add(txn, dbs, ns_key, deltas)


def _put_node(txn, dbs, key, ns_key, parent, span, record, edge: bytes) -> None:
    """Write a node and the children entry that reaches it from its parent."""
    start, end = span
    txn.put(key, encode_node(ns_key, parent, start, end, record, edge), db=dbs.nodes)
    txn.put(key, edge, db=dbs.edges)
    first = int.from_bytes(edge[:4], "little")
    txn.put(keys.child_key(parent, first), key, db=dbs.children)


# --- changing nodes ---------------------------------------------------------


def node_in(txn, dbs: Dbs, ns_key: bytes, key: bytes) -> Node:
    node = read_node(txn, dbs, key)
    if node is None or node.namespace != ns_key:
        raise NodeNotFoundError(f"no node {key.hex()} in namespace {ns_key.hex()}")
    return node


def removable_leaf(txn, dbs: Dbs, ns: Namespace, key: bytes) -> Node:
    """The leaf `key` of `ns`; NodeNotFoundError or NodeHasChildrenError otherwise."""
    node = node_in(txn, dbs, ns.key, key)
    if has_children(txn, dbs, key):
        raise NodeHasChildrenError(f"node {key.hex()} [{node.start}, {node.end}) has children")
    return node


def joinable(txn, dbs: Dbs, ns: Namespace, key: bytes) -> tuple[Node, Node]:
    """(node, its only child): a node that is no branch point; else NodeHasChildrenError."""
    node = node_in(txn, dbs, ns.key, key)
    kids = child_keys(txn, dbs, key)
    if len(kids) != 1:
        raise NodeHasChildrenError(f"node {key.hex()} has {len(kids)} children; only a run of single children joins")
    return node, node_in(txn, dbs, ns.key, kids[0])


def join_child(txn, dbs: Dbs, pair: tuple[Node, Node], record: NodeRecord) -> Node:
    """Replace node and its only child by one node [node.start, child.end).

    The joined node keeps the child's key (a key depends only on its prefix),
    so the child's own children stay where they are.
    """
    node, child = pair
    txn.delete(node.key, db=dbs.nodes)
    txn.delete(node.key, db=dbs.edges)
    txn.delete(keys.child_key(node.key, int(child.tokens[0])), db=dbs.children)
    access.forget(txn, dbs, node.key)
    span = (node.start, child.end)
    _put_node(txn, dbs, child.key, node.namespace, node.parent, span, record, node.edge + child.edge)
    deltas = {"nodes": -1, "nbytes": record.nbytes - node.nbytes - child.nbytes}
    counters.add(txn, dbs, node.namespace, deltas)
    return read_node(txn, dbs, child.key)


def remove_leaf(txn: lmdb.Transaction, dbs: Dbs, node: Node) -> Node:
    txn.delete(node.key, db=dbs.nodes)
    txn.delete(node.key, db=dbs.edges)
    entry = keys.child_key(node.parent, int(node.tokens[0]))
    if txn.get(entry, db=dbs.children) == node.key:
        txn.delete(entry, db=dbs.children)
    access.forget(txn, dbs, node.key)
    size = node.end - node.start
    deltas = {"nodes": -1, "nbytes": -node.nbytes, "tokens_stored": -size}
    counters.add(txn, dbs, node.namespace, deltas)
    return node


def replace_record(txn, dbs: Dbs, node: Node, record: NodeRecord, bump: dict[str, int] | None = None) -> Node:
    """Rewrite a node with a new record (its layout already checked); `bump`: counters to add to."""
    span = (node.start, node.end)
    value = encode_node(node.namespace, node.parent, *span, record, node.edge)
    txn.put(node.key, value, db=dbs.nodes)
    counters.add(txn, dbs, node.namespace, {"nbytes": record.nbytes - node.nbytes, **(bump or {})})
    return read_node(txn, dbs, node.key)


def drop_namespace(txn: lmdb.Transaction, dbs: Dbs, ns_key: bytes) -> int:
    """Remove a namespace: its spec, counters, notes, and every node, edge, children entry and
    access stamp of its nodes (found by a scan, so unreachable ones go too). Returns nodes removed."""
    doomed = [bytes(k) for k, v in txn.cursor(db=dbs.nodes) if stored_namespace(v) == ns_key]
    for key in [ns_key, *doomed]:
        cursor = txn.cursor(db=dbs.children)
        while cursor.set_range(key) and bytes(cursor.key()[: keys.KEY_SIZE]) == key:
            cursor.delete()
    for key in doomed:
        txn.delete(key, db=dbs.nodes)
        txn.delete(key, db=dbs.edges)
        access.forget(txn, dbs, key)
    for name in counters.NAMES:
        txn.delete(ns_key + name.encode(), db=dbs.counters)
    notes = txn.cursor(db=dbs.meta)  # its notes (rates, the weights it was bound with): Index._note_key
    prefix = b"note/" + ns_key + b"/"
    while notes.set_range(prefix) and bytes(notes.key()).startswith(prefix):
        notes.delete()
    txn.delete(ns_key, db=dbs.namespaces)
    return len(doomed)
