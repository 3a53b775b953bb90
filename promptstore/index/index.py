"""Index: the public face of the LMDB index, one short transaction per call.

It composes the environment, namespaces, the trie operations, access order and
counters; the logic of each lives in the module named after it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from typing import Self

from pydantic import ValidationError

from promptstore.errors import (
    CorruptRecordError,
    IndexStoreError,
    KeyCollisionError,
    NodeNotFoundError,
    ReadOnlyIndexError,
    StaleInsertError,
    UnknownNamespaceError,
)

from . import access, counters, env, keys, trie
from .namespace import Namespace, NamespaceSpec, tenant_digest
from .records import Node, NodeRecord, check_record_layout
from .trie import InsertPlan, InsertResult, Match, SplitRecords
from .upgrade import upgrade

# A pair of records for a split, or a function of the plan that makes them (bulk inserts).
SplitRecordsArg = SplitRecords | Callable[[InsertPlan], SplitRecords] | None

_BATCH = 256  # nodes read per transaction by the iterators, so none holds a reader long
_TENANT_KEY = b"tenant_key"  # in meta: the key of tenant_digest, random per store


class Index:
    """The LMDB index of one store. Threads may share it; each call is its own transaction."""

    def __init__(self, environment: env.Environment, readonly: bool) -> None:
        self._env = environment
        self.readonly = readonly
        self._namespaces: dict[bytes, Namespace] = {}
        self._closed = False

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        map_size: int = env.DEFAULT_MAP_SIZE,
        readonly: bool = False,
        sync: bool = True,
    ) -> Index:
        """Open (creating it 0700 unless readonly) the index directory `path`.

        map_size: initial LMDB map in bytes; it grows when full.
        sync: False skips fsync at commit (faster; a system crash may lose the last commits).
        The first open of a path in a process sets map_size and sync for every later one.
        A writable open upgrades an index of an older schema (see upgrade.py).
        """
        index = cls(env.acquire(path, map_size, readonly, sync), readonly)
        if not readonly:
            try:
                upgrade(index._env)
            except BaseException:
                index.close()
                raise
        return index

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            env.release(self._env)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def path(self) -> str:
        return self._env.path

    # --- namespaces -------------------------------------------------------

    def register_namespace(self, spec: NamespaceSpec) -> Namespace:
        """Store `spec` (idempotent) and return its Namespace.

        A stored spec that no longer hashes to its key was damaged; `spec` hashes to
        that key, so it is what was stored there, and it is written back.
        """
        ns = Namespace.of(spec)

        def needs_put(txn) -> bool:
            stored = txn.get(ns.key, db=self._dbs.namespaces)
            if stored is not None:
                return not _same_spec(ns, bytes(stored))  # another process got there first
            if txn.get(ns.key, db=self._dbs.nodes) is not None:
                raise KeyCollisionError(f"namespace fingerprint {ns.hex} is a node's key")
            return True

        def put(txn, needed: bool) -> None:
            if needed:
                txn.put(ns.key, spec.model_dump_json(exclude=spec.unset()).encode(), db=self._dbs.namespaces)

        stored = self._stored_spec(ns.key)
        if stored is None or not _same_spec(ns, stored):
            self._write(put, needs_put)
        self._namespaces[ns.key] = ns
        return ns

    def tenant_digest(self, salt: str, key: bytes | None = None) -> str:
        """What a namespace holds for a tenant's salt: scrypt keyed by `key` (a key
        replicas share), else by this store's own random tenant key."""
        return tenant_digest(salt, key if key is not None else self._tenant_key())

    def _tenant_key(self) -> bytes:
        # Made by the first bind that needs it; one write txn, so concurrent binds agree.
        with self._read() as txn:
            key = txn.get(_TENANT_KEY, db=self._dbs.meta)
            if key is not None:
                return bytes(key)

        def made(txn) -> bytes | None:
            found = txn.get(_TENANT_KEY, db=self._dbs.meta)
            return None if found is None else bytes(found)

        def put(txn, found: bytes | None) -> bytes:
            if found is not None:
                return found
            key = secrets.token_bytes(32)
            txn.put(_TENANT_KEY, key, db=self._dbs.meta)
            return key

        return self._write(put, made)

    def namespace(self, key: bytes | str) -> Namespace:
        """A registered namespace by fingerprint (bytes or hex)."""
        key = bytes.fromhex(key) if isinstance(key, str) else key
        if key not in self._namespaces:
            with self._read() as txn:
                return self._namespace_in(txn, key)
        return self._namespaces[key]

    def _namespace_in(self, txn, key: bytes) -> Namespace:
        ns = self._namespaces.get(key)
        if ns is None:
            stored = txn.get(key, db=self._dbs.namespaces)
            if stored is None:
                raise UnknownNamespaceError(f"no namespace {key.hex()} in {self.path}")
            ns = self._namespaces[key] = Namespace(_decode_spec(key, bytes(stored)), key)
        return ns

    def namespaces(self) -> list[Namespace]:
        """Every registered namespace; one whose spec is damaged is logged and skipped."""
        out = []
        with self._read() as txn:
            cursor = txn.cursor(db=self._dbs.namespaces)
            for key in [bytes(k) for k in cursor.iternext(values=False)]:
                try:
                    out.append(self._namespace_in(txn, key))
                except CorruptRecordError as e:
                    trie.log.warning("skipping namespace: %s", e)
        return out

    # --- lookup -----------------------------------------------------------

    def lookup(self, ns: Namespace, tokens) -> Match:
        """The longest stored prefix of `tokens` in `ns` and its restorable position."""
        tokens = keys.as_tokens(tokens)
        with self._read() as txn:
            return trie.walk(txn, self._dbs, ns, tokens)

    def get(self, key: bytes) -> Node | None:
        """The node at `key`, or None; CorruptRecordError if it does not verify."""
        with self._read() as txn:
            return trie.read_node(txn, self._dbs, key)

    def children(self, key: bytes) -> list[Node]:
        """The children of a node (or of a namespace root, by its fingerprint)."""
        with self._read() as txn:
            return self._nodes_at(txn, trie.child_keys(txn, self._dbs, key))

    def is_leaf(self, key: bytes) -> bool:
        with self._read() as txn:
            return not trie.has_children(txn, self._dbs, key)

    def iter_nodes(self, ns: Namespace) -> Iterator[Node]:
        """Every node of `ns`, parents before children (changes made meanwhile may show)."""
        stack = [ns.key]
        while stack:
            with self._read() as txn:
                batch = self._walk_some(txn, stack)
            yield from batch

    def _walk_some(self, txn, stack: list[bytes]) -> list[Node]:
        out: list[Node] = []
        while stack and len(out) < _BATCH:
            kids = self._nodes_at(txn, trie.child_keys(txn, self._dbs, stack.pop()))
            out.extend(kids)
            stack.extend(node.key for node in reversed(kids))
        return out

    def _nodes_at(self, txn, node_keys: Iterable[bytes]) -> list[Node]:
        out = []
        for key in node_keys:
            try:
                node = trie.read_node(txn, self._dbs, key)
            except IndexStoreError as e:
                trie.log.warning("skipping node %s: %s", key.hex(), e)
                continue
            if node is not None:
                out.append(node)
        return out

    # --- insert -----------------------------------------------------------

    def plan_insert(self, ns: Namespace, tokens) -> InsertPlan:
        """What inserting `tokens` would change (read txn); write snapshots, then commit."""
        tokens = keys.as_tokens(tokens)
        with self._read() as txn:
            return trie.plan(txn, self._dbs, ns, tokens)

    def commit_insert(
        self,
        plan: InsertPlan,
        new_record: NodeRecord | None = None,
        split_records: SplitRecordsArg = None,
    ) -> InsertResult:
        """Apply `plan` in one write txn; StaleInsertError if the trie changed since.

        new_record: the new leaf's record (needed when plan.span is not empty).
        split_records: (upper, lower) records when plan.split is set.
        """
        if plan.collision is not None:
            raise KeyCollisionError(f"key {plan.collision.hex()} is taken by another prefix; insert refused")
        return self._write(
            lambda txn, checked: trie.apply(txn, self._dbs, checked),
            lambda txn: trie.check(txn, self._dbs, plan, new_record, split_records),
        )

    def insert(
        self,
        ns: Namespace,
        tokens,
        new_record: NodeRecord,
        split_records: SplitRecordsArg = None,
    ) -> InsertResult:
        """plan_insert + commit_insert, re-planning a few times if another writer interleaves."""
        for _ in range(3):
            plan = self.plan_insert(ns, tokens)
            try:
                return self.commit_insert(plan, new_record, split_records)
            except StaleInsertError:
                continue
        return self.commit_insert(self.plan_insert(ns, tokens), new_record, split_records)

    def insert_many(
        self,
        ns: Namespace,
        items: Iterable[tuple[object, NodeRecord]],
        split_records: SplitRecordsArg = None,
    ) -> list[InsertResult]:
        """Insert (tokens, record) pairs in one write txn: all or none. Keep batches modest."""
        prepared = [(keys.as_tokens(tokens), record) for tokens, record in items]

        def apply_all(txn, _) -> list[InsertResult]:
            results = []
            for tokens, record in prepared:
                current = trie.plan(txn, self._dbs, ns, tokens)
                checked = trie.vet(txn, self._dbs, current, record, split_records)
                results.append(trie.apply(txn, self._dbs, checked))
            return results

        return self._write(apply_all)

    # --- changing nodes ---------------------------------------------------

    def update_record(self, key: bytes, record: NodeRecord, expect=None, bump: dict[str, int] | None = None) -> Node:
        """Replace a node's record (tier moves, a checkpoint filling a whole-state layer).

        expect: a test of the node as stored now; when it fails, StaleInsertError
        and nothing changes (a record read earlier may be out of date).
        bump: counters of its namespace to add to in the same transaction.
        """
        if bump:
            counters.check_names(bump)

        def fits(txn) -> Node:
            node = trie.read_node(txn, self._dbs, key)
            if node is None:
                raise NodeNotFoundError(f"no node {key.hex()}")
            if expect is not None and not expect(node):
                raise StaleInsertError(f"node {key.hex()} changed since it was read")
            check_record_layout(self._namespace_in(txn, node.namespace), record)
            return node

        return self._write(lambda txn, node: trie.replace_record(txn, self._dbs, node, record, bump), fits)

    def remove(self, ns: Namespace, key: bytes) -> Node:
        """Remove a leaf of `ns`; NodeHasChildrenError if it is not one."""
        return self._write(
            lambda txn, node: trie.remove_leaf(txn, self._dbs, node),
            lambda txn: trie.removable_leaf(txn, self._dbs, ns, key),
        )

    def join_child(self, ns: Namespace, key: bytes, record: NodeRecord, expect=None) -> tuple[Node, tuple[str, ...]]:
        """Merge node `key` with its only child into one node holding `record`
        (NodeHasChildrenError if `key` is a branch point or a leaf). Returns the
        joined node and the files the two records named (read in the transaction).

        expect: the (node, child) the record was made from; StaleInsertError if
        either changed since (another process split or joined them).
        """

        def fits(txn):
            pair = trie.joinable(txn, self._dbs, ns, key)
            if expect is not None and any(
                (a.key, a.start, a.end) != (b.key, b.start, b.end) for a, b in zip(pair, expect)
            ):
                raise StaleInsertError(f"node {key.hex()} or its child changed since they were read")
            check_record_layout(ns, record)
            return pair

        def join(txn, pair):
            unnamed = tuple(f for n in pair for f in trie.file_of(n) if f != record.file)
            return trie.join_child(txn, self._dbs, pair, record), unnamed

        return self._write(join, fits)

    def corrupt_nodes(self) -> list[bytes]:
        """Keys of stored nodes that fail to decode or verify (a full scan)."""
        bad = []
        with self._read() as txn:
            for key, _ in txn.cursor(db=self._dbs.nodes):
                key = bytes(key)
                try:
                    trie.read_node(txn, self._dbs, key)
                except IndexStoreError:
                    bad.append(key)
        return bad

    def repair_children(self, dry_run: bool = False) -> int:
        """Make children entries agree with the sound nodes they lead to (a full scan):
        an entry whose node is missing, damaged or not its child goes, and a sound
        node no entry reaches gets its entry back. Returns the entries changed."""

        def apply(txn, _) -> int:
            d = self._dbs
            want: dict[bytes, bytes] = {}
            for key, _value in txn.cursor(db=d.nodes):
                try:
                    node = trie.read_node(txn, d, bytes(key))
                except IndexStoreError:
                    continue  # compact drops damaged nodes with their subtrees
                want.setdefault(keys.child_key(node.parent, int(node.tokens[0])), node.key)
            wrong = [bytes(k) for k, v in txn.cursor(db=d.children) if want.get(bytes(k)) != bytes(v)]
            missing = [k for k, v in want.items() if bytes(txn.get(k, db=d.children) or b"") != v]
            if not dry_run:
                for entry in wrong:
                    txn.delete(entry, db=d.children)
                for entry in missing:
                    txn.put(entry, want[entry], db=d.children)
            return len(set(wrong) | set(missing))

        if dry_run:
            with self._read() as txn:
                return apply(txn, None)
        return self._write(apply)

    def drop_subtree(self, key: bytes) -> int:
        """Remove node `key` and everything below it, even if its record is
        unreadable (repair). Returns the nodes removed; totals are left to a
        recount (the namespace of an unreadable node is unknown)."""

        def apply(txn, _) -> int:
            d = self._dbs
            for entry, target in list(txn.cursor(db=d.children)):
                if bytes(target) == key:
                    txn.delete(bytes(entry), db=d.children)
            removed, stack = 0, [key]
            while stack:
                k = stack.pop()
                for child in trie.child_keys(txn, d, k):
                    stack.append(child)
                cursor = txn.cursor(db=d.children)
                while cursor.set_range(k) and bytes(cursor.key()[: len(k)]) == k:
                    cursor.delete()
                removed += txn.delete(k, db=d.nodes)
                txn.delete(k, db=d.edges)
                access.forget(txn, d, k)
            return removed

        return self._write(apply)

    @staticmethod
    def set_aside(path: str | os.PathLike, dry_run: bool = False) -> str | None:
        """Move a damaged index (one that opening refuses with IndexCorruptError) aside,
        kept, so the next open starts empty; returns where it went, None if it is sound.
        The caller must hold the store idle."""
        return env.set_aside(os.fspath(path), dry_run)

    @staticmethod
    def compact_in_place(path: str | os.PathLike) -> int:
        """Replace the index at `path` by a compacting copy of itself; returns the
        bytes reclaimed. The caller must hold the store idle (no process has it
        open): other processes' maps would still point into the old file."""
        return env.compact_in_place(os.fspath(path))

    # --- access order and counters ----------------------------------------

    def touch(self, node_keys: Iterable[bytes]) -> int:
        """Move nodes to the newest end of the access order, in the order given."""
        node_keys = list(node_keys)

        def stamp_all(txn, _) -> int:
            present = [k for k in node_keys if txn.get(k, db=self._dbs.nodes) is not None]
            for key in present:
                access.stamp(txn, self._dbs, key)
            return len(present)

        return self._write(stamp_all)

    def iter_by_access(self, ns: Namespace | None = None) -> Iterator[Node]:
        """Nodes, least recently used first; of one namespace or all."""
        after = None
        while True:
            with self._read() as txn:
                batch = access.oldest(txn, self._dbs, after, _BATCH)
                nodes = self._nodes_at(txn, [key for _, key in batch])
            if not batch:
                return
            after = batch[-1][0]
            yield from (node for node in nodes if ns is None or node.namespace == ns.key)

    def bump(self, ns: Namespace, **deltas: int) -> None:
        """Add to counters of `ns`: hits, misses, tokens_served (and the maintained totals)."""
        counters.check_names(deltas)
        self._write(lambda txn, _: counters.add(txn, self._dbs, ns.key, deltas))

    def counters(self, ns: Namespace) -> dict[str, int]:
        with self._read() as txn:
            return counters.read(txn, self._dbs, ns.key)

    def note(self, ns: Namespace, name: str) -> bytes | None:
        """A small advisory value kept for `ns` (measured rates, say), or None."""
        with self._read() as txn:
            raw = txn.get(_note_key(ns, name), db=self._dbs.meta)
            return None if raw is None else bytes(raw)

    def set_note(self, ns: Namespace, name: str, value: bytes) -> None:
        """Keep `value` under `name` for `ns` (the last writer wins)."""
        self._write(lambda txn, _: txn.put(_note_key(ns, name), value, db=self._dbs.meta))

    def first_note(self, ns: Namespace, name: str, value: bytes) -> bytes:
        """Keep `value` under `name` for `ns` unless a value is there; returns the one
        kept. One write transaction: of processes that race, the first one's stays."""
        key = _note_key(ns, name)

        def kept(txn) -> bytes | None:
            found = txn.get(key, db=self._dbs.meta)
            return None if found is None else bytes(found)

        def put(txn, found: bytes | None) -> bytes:
            if found is not None:
                return found
            txn.put(key, value, db=self._dbs.meta)
            return value

        return self._write(put, kept)

    def stats(self) -> dict[str, int | str]:
        """Totals over every namespace, plus the size of the LMDB map and data."""
        spaces = self.namespaces()
        totals = dict.fromkeys(counters.NAMES, 0)
        with self._read() as txn:
            for ns in spaces:
                for name, value in counters.read(txn, self._dbs, ns.key).items():
                    totals[name] += value
            entries = txn.stat(self._dbs.nodes)["entries"]
        info, stat = self._env.env.info(), self._env.env.stat()
        return {
            "path": self.path,
            "schema_version": env.SCHEMA_VERSION,
            "namespaces": len(spaces),
            "node_entries": entries,
            **totals,
            "map_size": info["map_size"],
            "used_bytes": (info["last_pgno"] + 1) * stat["psize"],
        }

    # --- plumbing -----------------------------------------------------------

    @property
    def _dbs(self) -> env.Dbs:
        return self._env.dbs

    def _read(self):
        if self._closed:
            raise IndexStoreError(f"index at {self.path} is closed")
        return self._env.read()

    def _write(self, apply, check=None):
        if self._closed:
            raise IndexStoreError(f"index at {self.path} is closed")
        if self.readonly:
            raise ReadOnlyIndexError(f"index at {self.path} was opened read-only")
        return self._env.write(apply, check)

    def _stored_spec(self, key: bytes) -> bytes | None:
        with self._read() as txn:
            stored = txn.get(key, db=self._dbs.namespaces)
            return None if stored is None else bytes(stored)


def _note_key(ns: Namespace, name: str) -> bytes:
    return b"note/" + ns.key + b"/" + name.encode()


def _decode_spec(key: bytes, stored: bytes) -> NamespaceSpec:
    try:
        spec = NamespaceSpec.model_validate_json(stored)
    except ValidationError as e:
        raise CorruptRecordError(f"namespace {key.hex()}: spec does not validate: {e}") from e
    if spec.fingerprint() != key:
        raise CorruptRecordError(f"namespace {key.hex()}: spec does not hash to its key")
    return spec


def _same_spec(ns: Namespace, stored: bytes) -> bool:
    """Whether `stored` is ns's spec; False if it is damaged (to be written again)."""
    try:
        found = _decode_spec(ns.key, stored)
    except CorruptRecordError as e:
        trie.log.warning("rewriting a damaged namespace spec: %s", e)
        return False
    if found != ns.spec:
        raise KeyCollisionError(f"namespace fingerprint {ns.hex} is taken by another spec")
    return True
