"""Random interleavings of insert, lookup, touch, update and remove, checked against
the reference trie over three namespaces with a three-token alphabet (so edges split often)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from promptstore.errors import NodeHasChildrenError
from promptstore.index import Index, NodeRecord, prefix_key

from .conftest import SPECS
from .reference import RefTrie

seqs = st.lists(st.integers(0, 2), min_size=1, max_size=8).map(tuple)
which = st.integers(0, len(SPECS) - 1)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ps-index-"))
        self.ix = Index.open(self.dir / "index", sync=False, map_size=1 << 20)
        self.spaces = [self.ix.register_namespace(spec) for spec in SPECS]
        self.refs = [RefTrie(ns.roles) for ns in self.spaces]
        self.order: list[tuple[int, tuple]] = []  # access order, oldest first

    def teardown(self) -> None:
        self.ix.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def record(self, data, i: int) -> tuple[NodeRecord, tuple]:
        ns = self.spaces[i]
        present = tuple(data.draw(st.lists(st.booleans(), min_size=ns.n_layers, max_size=ns.n_layers)))
        nbytes = data.draw(st.integers(0, 1000))
        return NodeRecord.blank(ns, present=list(present), nbytes=nbytes), (
            present,
            nbytes,
        )

    def key(self, i: int, prefix: tuple) -> bytes:
        return prefix_key(self.spaces[i].key, prefix)

    def some_node(self, data, i: int, leaves_only: bool = False) -> tuple | None:
        ref = self.refs[i]
        nodes = sorted(p for p in ref.nodes if not leaves_only or ref.is_leaf(p))
        return data.draw(st.sampled_from(nodes)) if nodes else None

    @rule(data=st.data(), i=which, seq=seqs)
    def insert(self, data, i, seq):
        self.insert_seq(data, i, seq)

    @precondition(lambda self: any(ref.nodes for ref in self.refs))
    @rule(
        data=st.data(),
        cut=st.integers(0, 8),
        tail=st.lists(st.integers(0, 2), max_size=4),
    )
    def insert_near(self, data, cut, tail):
        """Insert a sequence sharing a prefix with a stored one, to split and extend edges."""
        i = data.draw(st.sampled_from([j for j, ref in enumerate(self.refs) if ref.nodes]))
        prefix = self.some_node(data, i)
        seq = prefix[: max(1, len(prefix) - cut)] + tuple(tail)
        self.insert_seq(data, i, seq)

    def insert_seq(self, data, i: int, seq: tuple) -> None:
        ns, ref = self.spaces[i], self.refs[i]
        plan = self.ix.plan_insert(ns, seq)
        matched, split, leaf = ref.plan(seq)
        assert (plan.matched, plan.split.at if plan.split else None) == (matched, split)
        assert (plan.leaf_key is not None, plan.span) == (leaf, (matched, len(seq)))
        new, new_ref = self.record(data, i)
        upper, upper_ref = self.record(data, i)
        lower, lower_ref = self.record(data, i)
        result = self.ix.commit_insert(plan, new, (upper, lower) if plan.split else None)
        created = ref.insert(seq, new_ref, upper_ref, lower_ref)
        assert result.created == tuple(self.key(i, p) for p in created)
        assert result.key == self.key(i, seq)
        self.order += [(i, p) for p in created]

    @rule(i=which, seq=seqs)
    def lookup(self, i, seq):
        self.check_lookup(i, seq)

    @precondition(lambda self: any(ref.nodes for ref in self.refs))
    @rule(data=st.data(), i=which)
    def touch(self, data, i):
        ref = self.refs[i]
        if not ref.nodes:
            return
        chosen = data.draw(st.lists(st.sampled_from(sorted(ref.nodes)), max_size=4))
        assert self.ix.touch(self.key(i, p) for p in chosen) == len(chosen)
        for p in chosen:
            self.order.remove((i, p))
            self.order.append((i, p))

    @precondition(lambda self: any(ref.nodes for ref in self.refs))
    @rule(data=st.data(), i=which)
    def update_record(self, data, i):
        prefix = self.some_node(data, i)
        if prefix is None:
            return
        record, record_ref = self.record(data, i)
        node = self.ix.update_record(self.key(i, prefix), record)
        assert node.record == record
        self.refs[i].nodes[prefix] = record_ref

    @precondition(lambda self: any(ref.nodes for ref in self.refs))
    @rule(data=st.data(), i=which)
    def remove_leaf(self, data, i):
        prefix = self.some_node(data, i, leaves_only=True)
        if prefix is None:
            return
        node = self.ix.remove(self.spaces[i], self.key(i, prefix))
        assert node.end == len(prefix)
        del self.refs[i].nodes[prefix]
        self.order.remove((i, prefix))

    @precondition(lambda self: any(len(ref.nodes) > 1 for ref in self.refs))
    @rule(data=st.data(), i=which)
    def remove_inner_refused(self, data, i):
        ref = self.refs[i]
        inner = sorted(p for p in ref.nodes if not ref.is_leaf(p))
        if inner:
            with pytest.raises(NodeHasChildrenError):
                self.ix.remove(self.spaces[i], self.key(i, data.draw(st.sampled_from(inner))))

    def check_lookup(self, i: int, seq: tuple) -> None:
        ns, ref = self.spaces[i], self.refs[i]
        match = self.ix.lookup(ns, seq)
        assert match.matched == ref.matched(seq)
        assert [(n.start, n.end) for n in match.path] == ref.spans(seq)
        assert match.restorable == ref.restorable(seq)
        assert not match.corrupt
        if match.path:
            assert tuple(int(t) for n in match.path for t in n.tokens)[: match.matched] == seq[: match.matched]
        d = match.restorable_depth
        assert (d == -1) if match.restorable == 0 else match.path[d].start < match.restorable <= match.path[d].end

    @invariant()
    def same_nodes(self):
        for i, (ns, ref) in enumerate(zip(self.spaces, self.refs)):
            nodes = list(self.ix.iter_nodes(ns))
            got = {}
            for node in nodes:
                prefix = self.prefix_of(i, node, nodes)
                assert node.key == self.key(i, prefix)  # keys depend on the prefix only
                got[prefix] = (
                    (node.start, node.end),
                    tuple(lr.present for lr in node.record.layers),
                )
            want = {p: ((len(ref.parent(p)), len(p)), present) for p, (present, _) in ref.nodes.items()}
            assert got == want
            counts = self.ix.counters(ns)
            assert counts["nodes"] == len(ref.nodes)
            assert counts["nbytes"] == sum(nbytes for _, nbytes in ref.nodes.values())
            assert counts["tokens_stored"] == ref.tokens_stored()
            for p in ref.nodes:
                assert self.ix.is_leaf(self.key(i, p)) == ref.is_leaf(p)

    @invariant()
    def same_access_order(self):
        for i, ns in enumerate(self.spaces):
            got = [node.key for node in self.ix.iter_by_access(ns)]
            assert got == [self.key(j, p) for j, p in self.order if j == i]

    @invariant()
    def lookups_of_stored_sequences(self):
        for i, ref in enumerate(self.refs):
            for p in list(ref.nodes)[:5]:
                self.check_lookup(i, p + (2,))

    def prefix_of(self, i: int, node, nodes) -> tuple:
        by_key = {n.key: n for n in nodes}
        parts = []
        while node is not None:
            parts.append(tuple(int(t) for t in node.tokens))
            node = by_key.get(node.parent)
        return tuple(t for part in reversed(parts) for t in part)


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase
