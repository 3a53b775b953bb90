"""A model id that lies: a namespace bound with a model_id keeps the fingerprint of
the weights it was bound with, and other weights under the same id are refused
(nothing written) unless the caller says the id spans versions of the weights.
On real mlx-lm model classes with random weights and a real store."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from promptstore import PromptStore
from promptstore.errors import ModelIdentityError, SettingsError
from promptstore.store.model import FINGERPRINT_SAMPLES, weights_digest, weights_fingerprint
from promptstore.store.space import WEIGHTS_NOTE
from promptstore.testing.models import tiny_model

from ..conftest import forward, fresh_cache, prompt_tokens

HD32 = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}  # quantized KV needs head dim 32


def scaled(factor: float = 1.01, **overrides):
    """The tiny llama with every weight times `factor`: another model to the cache."""
    model = tiny_model("llama", **overrides)
    model.update(tree_map(lambda p: p * factor, model.parameters()))
    mx.eval(model.parameters())
    return model


def stored(store: PromptStore, space, model, n: int = 48) -> mx.array:
    """Prefill `n` tokens with `model` and insert them in `space`; returns the tokens."""
    tokens = prompt_tokens(n)
    cache = fresh_cache(model)
    forward(model, cache, tokens)
    assert space.insert(tokens, cache) == n
    store.flush()
    return tokens


def state(store: PromptStore, space) -> tuple:
    """What a refused bind must leave as it was: namespaces, totals, the recorded fingerprint."""
    stats = store.index.stats()
    keys = sorted(ns.key for ns in store.index.namespaces())
    return keys, stats["node_entries"], stats["used_bytes"], store.index.note(space.namespace, WEIGHTS_NOTE)


def test_the_fingerprint_follows_the_weights_and_reads_a_few_values_of_each():
    model = tiny_model("llama")
    fp = weights_fingerprint(model)
    assert fp == weights_fingerprint(tiny_model("llama"))  # the same weights, built again
    assert fp != weights_fingerprint(scaled())
    assert fp != weights_fingerprint(tiny_model("llama", seed=1))
    assert fp != weights_fingerprint(tiny_model("llama", dtype=mx.bfloat16))
    # What it can miss: one weight where no sample reads (the embedding is
    # larger than FINGERPRINT_SAMPLES, so every other value at least is unread).
    # weights_digest, which reads every one, tells it apart.
    assert model.model.embed_tokens.weight.size >= 2 * FINGERPRINT_SAMPLES
    nudged = tiny_model("llama")
    weight = nudged.model.embed_tokens.weight.reshape(-1)
    weight[1] = weight[1] + 1.0  # position 1: between the samples at 0 and `step`
    nudged.model.embed_tokens.weight = weight.reshape(model.model.embed_tokens.weight.shape)
    mx.eval(nudged.parameters())
    assert weights_fingerprint(nudged) == fp and weights_digest(nudged) != weights_digest(model)


def test_the_same_model_binds_its_namespace_again(tmp_path):
    model = tiny_model("llama")
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="m")
        tokens = stored(store, space, model)
        assert store.index.note(space.namespace, WEIGHTS_NOTE) == weights_fingerprint(model).encode()
    with PromptStore.open(tmp_path) as store:
        again = store.bind(tiny_model("llama"), model_id="m")  # the same weights, loaded again
        assert again.namespace.key == space.namespace.key
        assert again.fetch(tokens).length == len(tokens) - 1


def test_other_weights_under_the_same_model_id_are_refused_and_nothing_changes(tmp_path):
    model, other = tiny_model("llama"), scaled()
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="m")
        tokens = stored(store, space, model)
    with PromptStore.open(tmp_path) as store:
        before = state(store, space)
        with pytest.raises(
            ModelIdentityError, match=r"model_id 'm' was bound to other weights.*spans_weights=True"
        ) as e:
            store.bind(other, model_id="m")
        assert isinstance(e.value, SettingsError) and e.value.model_id == "m"
        assert state(store, space) == before
        assert store.spaces == []  # nothing bound
        # The model the namespace was bound with still finds its prompt.
        assert store.bind(model, model_id="m").fetch(tokens).length == len(tokens) - 1


def test_spans_weights_binds_other_weights_and_keeps_the_newest(tmp_path):
    model, other = tiny_model("llama"), scaled()
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="m")
        tokens = stored(store, space, model)
        spanning = store.bind(other, model_id="m", spans_weights=True)
        assert spanning.namespace.key == space.namespace.key
        assert spanning.fetch(tokens).length == len(tokens) - 1  # the operator said the id spans these weights
        # The namespace's next entries come from the newest weights: a later bind is checked against them.
        assert store.index.note(space.namespace, WEIGHTS_NOTE) == weights_fingerprint(other).encode()
        store.bind(other, model_id="m")
        with pytest.raises(ModelIdentityError):
            store.bind(model, model_id="m")


def test_a_namespace_bound_before_fingerprints_were_kept_records_one_at_its_next_bind(tmp_path):
    model, other = tiny_model("llama"), scaled()
    with PromptStore.open(tmp_path / "a") as store:
        spec = store.bind(model, model_id="m").namespace.spec
    with PromptStore.open(tmp_path / "b") as store:
        ns = store.index.register_namespace(spec)  # as a store of an earlier version holds it: no note
        assert store.index.note(ns, WEIGHTS_NOTE) is None
        assert store.bind(other, model_id="m").namespace.key == ns.key  # nothing to refuse it by
        assert store.index.note(ns, WEIGHTS_NOTE) == weights_fingerprint(other).encode()
        with pytest.raises(ModelIdentityError):
            store.bind(model, model_id="m")


def test_a_fingerprint_of_another_version_is_replaced_not_refused(tmp_path):
    model = tiny_model("llama")
    with PromptStore.open(tmp_path) as store:
        ns = store.bind(model, model_id="m").namespace
        store.index.set_note(ns, WEIGHTS_NOTE, b"xxh3-sampled-v0:0123")
        store.bind(model, model_id="m")
        assert store.index.note(ns, WEIGHTS_NOTE) == weights_fingerprint(model).encode()


def test_each_tenant_and_kv_bits_namespace_keeps_its_own(tmp_path):
    model, other = tiny_model("llama", **HD32), scaled(**HD32)
    quantized = {"kv_bits": 8, "kv_group_size": 32}
    with PromptStore.open(tmp_path) as store:
        store.bind(model, model_id="m", salt="tenant-a")
        store.bind(model, model_id="m", **quantized)
        # Namespaces the first model never bound take the other's.
        store.bind(other, model_id="m", salt="tenant-b")
        store.bind(other, model_id="m")
        for weights, kwargs in (
            (other, {"salt": "tenant-a"}),
            (other, quantized),
            (model, {"salt": "tenant-b"}),
            (model, {}),
        ):
            with pytest.raises(ModelIdentityError):
                store.bind(weights, model_id="m", **kwargs)


def test_without_a_model_id_other_weights_are_another_namespace(tmp_path):
    model, other = tiny_model("llama"), scaled()
    with PromptStore.open(tmp_path) as store:
        space = store.bind(model)
        tokens = stored(store, space, model)
        elsewhere = store.bind(other)
        assert elsewhere.namespace.key != space.namespace.key
        assert elsewhere.fetch(tokens).length == 0
        assert store.index.note(space.namespace, WEIGHTS_NOTE) is None  # the digest is the identity


def test_a_given_fingerprint_is_checked_as_a_computed_one(tmp_path):
    """A server binds a namespace per tenant with the fingerprint it computed once."""
    model, other = tiny_model("llama"), scaled()
    with PromptStore.open(tmp_path) as store:
        store.bind(model, model_id="m", fingerprint=weights_fingerprint(model))
        with pytest.raises(ModelIdentityError):
            store.bind(model, model_id="m", fingerprint=weights_fingerprint(other))


def test_the_first_note_of_two_stays(tmp_path):
    with PromptStore.open(tmp_path) as store:
        ns = store.bind(tiny_model("llama"), model_id="m").namespace
        kept = store.index.note(ns, WEIGHTS_NOTE)
        assert store.index.first_note(ns, WEIGHTS_NOTE, b"another") == kept
        assert store.index.note(ns, WEIGHTS_NOTE) == kept
