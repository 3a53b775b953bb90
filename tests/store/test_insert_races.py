"""An insert whose plan another insert made stale before its commit: it plans
again and stores its tokens, never a snapshot of positions its cache lacks."""

import mlx.core as mx

from promptstore import PromptStore
from promptstore.index import index as index_module

from ..conftest import assert_hit_whole, forward, fresh_cache, prompt_tokens


def _filled(model, tokens):
    cache = fresh_cache(model)
    forward(model, cache, tokens)
    return cache


def test_a_node_cut_elsewhere_between_the_plan_and_the_split_is_planned_again(tmp_path, model_of, monkeypatch):
    """`a` is stored as one node [0, 60). An insert of `b`, a[:54] (a cache at the
    cut), plans to cut that node at 54; before it commits, an insert of `c`
    (a[:56] and a tail of its own) cuts it at 56, so the node's key now names
    [56, 60), past the 54 positions `b`'s cache holds. The stale plan is found
    and planned again (the race failed such an insert with a SnapshotRangeError
    in a four-process run)."""
    model = model_of("llama")
    a = prompt_tokens(60, seed=1)
    b = a[:54]
    c = mx.concatenate([a[:56], prompt_tokens(4, seed=3)])
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="m")
        space.insert(a, _filled(model, a))
        real, cut = index_module.Index.plan_insert, []

        def plan_then_cut(self, namespace, tokens):
            planned = real(self, namespace, tokens)
            if not cut and len(tokens) == len(b) and planned.split is not None:
                cut.append(planned.split.at)
                space.insert(c, _filled(model, c))  # another writer, meanwhile
            return planned

        monkeypatch.setattr(index_module.Index, "plan_insert", plan_then_cut)
        assert space.insert(b, _filled(model, b)) == 0  # a cut: no new tokens
        assert cut == [54]
        monkeypatch.undo()
        assert [n.end for n in store.index.lookup(space.namespace, b).path] == [54]  # the cut is a node end
        for tokens in (a, b, c):
            assert_hit_whole(space, model, tokens)
        assert not store.reports
