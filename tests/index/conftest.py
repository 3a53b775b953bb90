"""Fixtures for index tests: temporary stores and a few namespace layouts."""

from __future__ import annotations

import pytest

from promptstore.index import Index, LayerSpec, NamespaceSpec, NodeRecord

# Range layers only; a hybrid with a sliding window; recurrent state inside a cache list;
# a hybrid with a recurrent layer.
SPECS = (
    NamespaceSpec(model_id="test/kv", layers=[LayerSpec(kind="kv"), LayerSpec(kind="kv")]),
    NamespaceSpec(
        model_id="test/hybrid",
        layers=[LayerSpec(kind="kv"), LayerSpec(kind="rotating", window=4)],
    ),
    NamespaceSpec(
        weights_digest="sha256:abc",
        layers=[
            LayerSpec(
                kind="cache_list",
                children=[LayerSpec(kind="arrays"), LayerSpec(kind="kv")],
            ),
            LayerSpec(kind="quantized", bits=4, group_size=64),
            LayerSpec(kind="batch_rotating", window=8, keep=1),
        ],
        tenant="7e" * 16,  # a tenant_digest
    ),
    NamespaceSpec(model_id="test/recurrent", layers=[LayerSpec(kind="kv"), LayerSpec(kind="arrays")]),
)


@pytest.fixture
def index(tmp_path):
    with Index.open(tmp_path / "index", sync=False) as ix:
        yield ix


@pytest.fixture
def spaces(index):
    return [index.register_namespace(spec) for spec in SPECS]


def full(ns, nbytes: int = 1) -> NodeRecord:
    """A record holding every layer."""
    return NodeRecord.blank(ns, nbytes=nbytes)


def branch(ns, nbytes: int = 1) -> NodeRecord:
    """A split's upper record: range layers present, whole-state layers not yet checkpointed."""
    return NodeRecord.blank(ns, present=[not w for w in ns.whole], nbytes=nbytes)
