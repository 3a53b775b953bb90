"""Namespace specs, fingerprints and isolation between namespaces."""

from __future__ import annotations

import pydantic
import pytest

from promptstore.index import LayerSpec, NamespaceSpec, prefix_key

from .conftest import SPECS, full


def test_fingerprint_is_stable_and_sensitive():
    spec = SPECS[1]
    again = NamespaceSpec.model_validate_json(spec.model_dump_json())
    assert again.fingerprint() == spec.fingerprint() and len(spec.fingerprint()) == 16
    assert spec.fingerprint_hex() == spec.fingerprint().hex()
    for change in (
        {"tenant": "ab" * 16},
        {"model_id": "other"},
        {"layers": spec.layers[:1]},
    ):
        assert spec.model_copy(update=change).fingerprint() != spec.fingerprint()
    window = LayerSpec(kind="rotating", window=5)
    assert spec.model_copy(update={"layers": [spec.layers[0], window]}).fingerprint() != spec.fingerprint()


def test_whole_state_follows_the_kind():
    assert [LayerSpec(kind=k).whole_state for k in ("kv", "quantized", "chunked", "batch_kv")] == [False] * 4
    assert [LayerSpec(kind=k).whole_state for k in ("rotating", "arrays", "batch_rotating")] == [True] * 3
    assert LayerSpec(kind="rotating", max_size=8).window == 8
    mamba_list = LayerSpec(kind="cache_list", children=[{"kind": "arrays"}, {"kind": "kv"}])
    assert mamba_list.whole_state
    assert not LayerSpec(kind="cache_list", children=[LayerSpec(kind="kv")]).whole_state
    assert SPECS[2].model_dump()["layers"][0]["whole_state"] is True


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "kv", "whole_state": True},
        {"kind": "mystery"},
        {"kind": "cache_list"},
        {"kind": "kv", "children": [{"kind": "kv"}]},
        {"kind": "rotating", "window": 0},
    ],
)
def test_bad_layer_specs(bad):
    with pytest.raises(pydantic.ValidationError):
        LayerSpec.model_validate(bad)


def test_namespace_needs_identity_and_layers():
    with pytest.raises(pydantic.ValidationError):
        NamespaceSpec(layers=[LayerSpec(kind="kv")])
    with pytest.raises(pydantic.ValidationError):
        NamespaceSpec(model_id="m", layers=[])


def test_register_is_idempotent_and_listed(index):
    a = index.register_namespace(SPECS[0])
    assert index.register_namespace(SPECS[0]) == a
    index.register_namespace(SPECS[1])
    assert {ns.key for ns in index.namespaces()} == {a.key, SPECS[1].fingerprint()}
    assert index.namespace(a.hex).spec == SPECS[0]


def test_namespaces_never_share_nodes(index, spaces):
    kv = spaces[0]
    salted = index.register_namespace(SPECS[0].model_copy(update={"tenant": "cd" * 16}))
    index.insert(kv, [1, 2, 3], full(kv))
    assert index.lookup(salted, [1, 2, 3]).matched == 0
    index.insert(salted, [1, 2, 3], full(salted))
    assert prefix_key(kv.key, [1, 2, 3]) != prefix_key(salted.key, [1, 2, 3])
    for ns in (kv, salted):
        assert all(node.namespace == ns.key for node in index.lookup(ns, [1, 2, 3]).path)
    assert index.counters(kv)["nodes"] == index.counters(salted)["nodes"] == 1


def test_dropping_a_namespace_drops_its_notes_and_no_other(tmp_path):
    """A namespace dropped (the schema 1 upgrade) leaves no note a later bind of the
    same fingerprint would read (the weights it was bound with, its rates)."""
    from promptstore.index import Index, trie

    with Index.open(tmp_path / "index", sync=False) as ix:
        gone, kept = ix.register_namespace(SPECS[0]), ix.register_namespace(SPECS[1])
        for ns in (gone, kept):
            ix.set_note(ns, "weights-fingerprint", b"w")
            ix.set_note(ns, "rates", b"r")
        ix._env.write(lambda txn, _: trie.drop_namespace(txn, ix._env.dbs, gone.key))
        assert ix.note(gone, "weights-fingerprint") is None and ix.note(gone, "rates") is None
        assert ix.note(kept, "weights-fingerprint") == b"w" and ix.note(kept, "rates") == b"r"
