"""Hostile input through the public API: every row is a typed error (a subclass of
promptstore.errors.PromptStoreError; InvalidTokensError for tokens) or a miss,
never another exception, never a crash, and never a file written outside the
store directory (each test walks the tmp directory's parent before and after).

Already covered elsewhere, so not repeated here:
- bad tokens at the index layer: tests/index/test_bad_input.py::test_bad_tokens_are_refused
  (its BAD_TOKENS table is reused below through Space.fetch / Space.insert);
- bad snapshots given to a cache's restore, malformed serialized snapshots:
  tests/caches/test_bad_input.py;
- damaged or crafted snapshot files and index records: tests/snapshots/test_cold.py,
  tests/store/test_corruption.py, tests/index/test_bad_input.py;
- bad namespace specs built directly (pydantic.ValidationError, a ValueError):
  tests/index/test_namespace.py::test_bad_layer_specs.
"""

from __future__ import annotations

import logging
import os
import stat

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

from promptstore import PromptStore
from promptstore import caches as C
from promptstore.errors import (
    IndexStoreError,
    InvalidTokensError,
    PromptStoreError,
    SettingsError,
    StoreDirectoryError,
)
from promptstore.store.compact import compact
from promptstore.testing.models import tiny_model

from ..conftest import _model, forward, fresh_cache, prompt_tokens
from ..index.test_bad_input import BAD_TOKENS
from ._util import TOL, changes_outside, continuation_error, prefill_insert, tree_state

MODEL_ID = "m"


@pytest.fixture
def guard(tmp_path):
    """guard.root: the store path. Nothing outside it under tmp_path's parent may change:
    checked after the test, or inside it by guard.check() (which xfail tests need).

    A test that prepares files of its own calls guard.rebase() once it has."""

    class Guard:
        root = tmp_path / "store"
        parent = tmp_path.parent
        checked = False

        def rebase(self):
            self.before = tree_state(self.parent)

        def check(self):
            self.checked = True
            assert changes_outside(self.before, tree_state(self.parent), [self.root]) == []

    g = Guard()
    g.rebase()
    yield g
    if not g.checked:
        g.check()


def nodes_and_files(store, space):
    nodes = list(store.index.iter_nodes(space.namespace))
    files = list((store.path / "cold" / "files").rglob("*.safetensors"))
    return nodes, files


# --- tokens --------------------------------------------------------------------------------

MX_BAD_TOKENS = {
    "mx float32": mx.array([1.0, 2.0]),
    "mx bfloat16": mx.array([1, 2], dtype=mx.bfloat16),
    "mx 2-D": mx.array([[1, 2], [3, 4]]),
    "mx negative int32": mx.array([5, -1]),
    "mx empty": mx.array([], dtype=mx.int32),
    "numpy uint64 >= 2**32": np.array([1, 2**32], dtype=np.uint64),
    "python int >= 2**64": [1, 2**64],
}
TOKEN_ROWS = {repr(t)[:40]: t for t in BAD_TOKENS} | MX_BAD_TOKENS


@pytest.mark.parametrize("name", sorted(TOKEN_ROWS))
def test_bad_tokens_through_the_store_are_invalid_tokens_errors(guard, model_of, name):
    tokens = TOKEN_ROWS[name]
    model = model_of("llama")
    with PromptStore.open(guard.root, durability="sync") as store:
        space = store.bind(model, model_id=MODEL_ID)
        with pytest.raises(InvalidTokensError):
            space.fetch(tokens)
        cache = fresh_cache(model)
        forward(model, cache, prompt_tokens(2))
        with pytest.raises(InvalidTokensError):
            space.insert(tokens, cache)
        assert nodes_and_files(store, space) == ([], [])


def test_empty_and_one_token_prompts(guard, model_of):
    """An empty prompt is an InvalidTokensError; a one-token prompt is a miss (the last
    token is always the caller's to compute), stored or not."""
    model = model_of("llama")
    with PromptStore.open(guard.root, durability="sync") as store:
        space = store.bind(model, model_id=MODEL_ID)
        with pytest.raises(InvalidTokensError):
            space.fetch([])
        with pytest.raises(InvalidTokensError):
            space.insert([], fresh_cache(model))
        one = prompt_tokens(1)
        assert space.fetch(one).length == 0
        prefill_insert(space, model, one)
        hit = space.fetch(one)
        assert hit.length == 0 and [c.offset for c in hit.cache] == [0] * len(hit.cache)
        length, err = continuation_error(space, model, mx.concatenate([one, prompt_tokens(3, seed=2)]))
        assert length == 1 and err < TOL


# --- caches given to insert ------------------------------------------------------------------

N = 20


def _tokens(i):
    return prompt_tokens(N, seed=900 + i)


def _model_cache(model, tokens, **kw):
    cache = fresh_cache(model, **kw)
    forward(model, cache, tokens)
    return cache


def _kv_like(model, tokens, change):
    """The right model's KV cache for `tokens`, with its arrays changed by `change`."""
    right = _model_cache(model, tokens)
    cache = C.make_prompt_cache(model)
    for layer, src in zip(cache, right):
        k, v = src.keys[..., : src.offset, :], src.values[..., : src.offset, :]
        layer.update_and_fetch(change(k), change(v))
    return cache


def _rotating(model, tokens):
    cache = [C.RotatingKVCache(max_size=8) for _ in model.layers]
    forward(model, cache, tokens)
    return cache


def _mlx_lm_native(model, tokens):
    cache = mlx_cache.make_prompt_cache(model)  # mlx-lm's own classes, not adopted
    forward(model, cache, tokens)
    return cache


# name -> cache builder (model, tokens) -> cache. Regressions (were defects):
# - Space.insert ran C.prompt_position on whatever it was given: None or one cache raised
#   TypeError, a list of non-caches or of mlx-lm's own caches AttributeError;
# - Space._check_cache compared each layer's kind, window, bits, group size, chunk size and
#   dtype, but not the arrays' head count, head dim or batch size, so another model's cache
#   with the same layer kinds (or a batch of 2) was stored and then served to this model.
#   insert now compares every layer's array signature with a one-token forward's.
BAD_CACHES = {
    "another model's cache (4 layers for 2)": lambda m, t: _model_cache(_model("gemma3_text"), t),
    "too few layers": lambda m, t: _model_cache(m, t)[:1],
    "too many layers": lambda m, t: _model_cache(m, t) * 2,
    "cache at another position than len(tokens)": lambda m, t: _model_cache(m, t[:-3]),
    "empty cache list": lambda m, t: [],
    "None": lambda m, t: None,
    "a single cache, not a list": lambda m, t: _model_cache(m, t)[0],
    "a list of strings": lambda m, t: ["keys", "values"],
    "mlx-lm's own (not adopted) caches": _mlx_lm_native,
    "another head count and head dim": lambda m, t: _model_cache(_model("llama", "hd32"), t),
    "quantized KV in a float KV namespace": lambda m, t: _model_cache(_model("llama", "hd32"), t, kv_bits=8),
    "batch of 2": lambda m, t: _kv_like(m, t, lambda a: mx.concatenate([a, a])),
    "float16 arrays in a float32 namespace": lambda m, t: _kv_like(m, t, lambda a: a.astype(mx.float16)),
    "rotating layers in a KV namespace": _rotating,
}


@pytest.mark.parametrize("name", list(BAD_CACHES))
def test_bad_cache_is_a_typed_error_and_stores_nothing(guard, model_of, name, caplog):
    build = BAD_CACHES[name]
    model = model_of("llama")
    tokens = _tokens(list(BAD_CACHES).index(name))
    cache = build(model, tokens)
    with caplog.at_level(logging.CRITICAL), PromptStore.open(guard.root, durability="sync") as store:
        space = store.bind(model, model_id=MODEL_ID)
        with pytest.raises(PromptStoreError):
            space.insert(tokens, cache)
        assert nodes_and_files(store, space) == ([], [])


@pytest.mark.parametrize("name", list(BAD_CACHES))
def test_bad_cache_never_poisons_the_namespace(guard, model_of, name, caplog):
    """Whatever insert did with the bad cache, later fetches of that prefix, in this process
    and after a restart, raise nothing and continue exactly like a full prefill."""
    build = BAD_CACHES[name]
    model = model_of("llama")
    tokens = _tokens(list(BAD_CACHES).index(name))
    query = mx.concatenate([tokens, prompt_tokens(4, seed=77)])
    with caplog.at_level(logging.CRITICAL):
        with PromptStore.open(guard.root, durability="sync") as store:
            space = store.bind(model, model_id=MODEL_ID)
            try:
                space.insert(tokens, build(model, tokens))
            except PromptStoreError:
                pass
            _, err = continuation_error(space, model, query)
            assert err < TOL
        with PromptStore.open(guard.root, hot_bytes=0) as store:
            _, err = continuation_error(store.bind(model, model_id=MODEL_ID), model, query)
            assert err < TOL


# --- unusual but valid caches ----------------------------------------------------------------


def test_sliding_window_model_with_several_kv_heads_persists(guard, caplog):
    """Was a defect, fixed in the working tree while these tests were written: cold.py
    checksum() hashed memoryview(array), which needs a C-contiguous buffer; a rotating layer
    filled in one forward keeps mlx-lm's transposed keys/values (not contiguous with 2+ KV
    heads), so every spill raised BufferError (a 'disk' miss) and the node never reached
    disk. The tiny gemma3_text has 1 KV head, which hid it; Gemma 3 4B and larger have 4-16."""
    model = tiny_model("gemma3_text", num_key_value_heads=2)
    tokens = prompt_tokens(40, seed=31)
    with caplog.at_level(logging.CRITICAL):
        with PromptStore.open(guard.root, durability="sync") as store:
            space = store.bind(model, model_id=MODEL_ID)
            cache = space.new_cache()
            forward(model, cache, tokens)  # one forward: the usual prefill of a short prompt
            space.insert(tokens, cache)
            assert not store.reports, list(store.reports)
        with PromptStore.open(guard.root, hot_bytes=0) as store:
            space = store.bind(model, model_id=MODEL_ID)
            length, err = continuation_error(space, model, mx.concatenate([tokens, prompt_tokens(3, seed=32)]))
    assert length == len(tokens) and err < TOL


# --- the store directory ---------------------------------------------------------------------


def test_symlink_is_refused_and_its_target_untouched(guard, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    guard.root.symlink_to(target)
    guard.rebase()
    with pytest.raises(StoreDirectoryError):
        PromptStore.open(guard.root)
    assert list(target.iterdir()) == []


def test_dangling_symlink_is_refused_and_nothing_created(guard, tmp_path):
    guard.root.symlink_to(tmp_path / "nowhere")
    guard.rebase()
    with pytest.raises(StoreDirectoryError):
        PromptStore.open(guard.root)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_another_users_directory_is_refused(guard):
    guard.root.mkdir(mode=0o700)
    os.chown(guard.root, 54321, 54321)
    guard.rebase()
    with pytest.raises(StoreDirectoryError):
        PromptStore.open(guard.root)
    assert list(guard.root.iterdir()) == []  # nothing written inside it either


NOT_A_DIR = (
    "store.py _prepare(): root.mkdir(parents=True, exist_ok=True) raises FileExistsError (a "
    "regular file) or NotADirectoryError (a path under one) before the S_ISDIR check can raise "
    "StoreDirectoryError; fix: catch OSError around mkdir and raise StoreDirectoryError"
)


@pytest.mark.parametrize("where", ["the path itself", "a parent"])
def test_a_regular_file_is_refused(guard, where):
    guard.root.write_text("not a store")
    guard.rebase()
    path = guard.root if where == "the path itself" else guard.root / "sub"
    with pytest.raises(StoreDirectoryError):
        PromptStore.open(path)
    assert guard.root.read_text() == "not a store"


def test_compact_of_a_regular_file_is_refused(guard):
    guard.root.write_text("not a store")
    guard.rebase()
    with pytest.raises(StoreDirectoryError):
        compact(guard.root)


PERMISSIVE = (
    "store.py _prepare() checks only symlink, directory and owner, never the mode: an existing "
    "store directory that others can write to is used as it is (and stays 0777); another local "
    "user can then plant 'lock', 'index' or 'cold' as symlinks, which the store follows "
    "(os.open(lock, O_CREAT) in _lock_file, lmdb.open, ColdTier mkdir/write), creating files "
    "outside the store. Fix: refuse (or chmod to dir_mode) a directory with group/other write "
    "bits, open 'lock' with O_NOFOLLOW and refuse symlinked 'index' / 'cold' / 'cold/files'"
)


def test_a_directory_others_can_write_is_refused_or_made_private(guard):
    guard.root.mkdir()
    os.chmod(guard.root, 0o777)
    guard.rebase()
    try:
        PromptStore.open(guard.root).close()
    except StoreDirectoryError:
        return
    assert stat.S_IMODE(guard.root.stat().st_mode) & 0o022 == 0


@pytest.mark.parametrize("planted", ["lock", "index", "cold"])
def test_planted_symlinks_write_nothing_outside(guard, tmp_path, planted):
    """A store directory in which someone planted a symlink: opening it either refuses
    (StoreDirectoryError) or writes nothing outside the store."""
    guard.root.mkdir(mode=0o700)
    outside = tmp_path / f"outside-{planted}"
    if planted != "lock":
        outside.mkdir()
    (guard.root / planted).symlink_to(outside)
    guard.rebase()
    try:
        with PromptStore.open(guard.root, durability="sync") as store:
            model = _model("llama")
            prefill_insert(store.bind(model, model_id=MODEL_ID), model, prompt_tokens(10))
    except StoreDirectoryError:
        pass
    guard.check()


# --- after close ----------------------------------------------------------------------------


def test_use_after_close_is_a_typed_error(guard, model_of):
    model = model_of("llama")
    store = PromptStore.open(guard.root, durability="write_back")
    space = store.bind(model, model_id=MODEL_ID)
    tokens = prompt_tokens(12)
    cache = _model_cache(model, tokens)
    store.close()
    for call in (
        lambda: space.fetch(tokens),
        lambda: space.insert(tokens, cache),
        lambda: store.bind(model, model_id=MODEL_ID),
    ):
        with pytest.raises(IndexStoreError):
            call()
    try:  # a one-token prompt never reaches the index: a miss, or the typed error
        assert space.fetch(tokens[:1]).length == 0
    except IndexStoreError:
        pass
    store.flush()  # harmless
    store.close()  # idempotent
    # A Space of the closed store stays closed even when the path is opened again.
    with PromptStore.open(guard.root) as again:
        with pytest.raises(IndexStoreError):
            space.fetch(tokens)
        assert again.bind(model, model_id=MODEL_ID).fetch(tokens).length == 0


# --- settings and namespace arguments ----------------------------------------------------------

BAD_SETTINGS = [
    {"map_size": 1},
    {"hot_bytes": -1},
    {"disk_bytes": -5},
    {"durability": "eventually"},
    {"checkpoint_interval": 0},
    {"no_such_setting": 1},
    {"hot_bytes": "lots"},
    {"file_mode": 0o444},
    {"file_mode": 0o1777},
    {"dir_mode": 0o600},
    {"dir_mode": -1},
]


# Regression (was a defect): bad settings raised pydantic's ValidationError, not a typed error
@pytest.mark.parametrize("settings", BAD_SETTINGS, ids=repr)
def test_bad_settings_are_refused_before_anything_is_written(guard, settings):
    with pytest.raises(SettingsError) as info:
        PromptStore.open(guard.root, **settings)
    assert next(iter(settings)) in str(info.value)
    assert not guard.root.exists()


@pytest.mark.parametrize("name,value", [("HOT_BYTES", "-1"), ("FILE_MODE", "rw-------"), ("DURABILITY", "maybe")])
def test_bad_settings_from_the_environment_are_refused(guard, monkeypatch, name, value):
    monkeypatch.setenv(f"PROMPTSTORE_{name}", value)
    with pytest.raises(SettingsError) as info:
        PromptStore.open(guard.root)
    assert name.lower() in str(info.value).lower()
    assert not guard.root.exists()


@pytest.mark.parametrize("kwargs", [{"salt": 123}, {"model_id": 5}, {"salt": ["a"]}], ids=repr)
def test_bad_namespace_arguments_are_refused(guard, model_of, kwargs):
    model = model_of("llama")
    with PromptStore.open(guard.root) as store:
        with pytest.raises(SettingsError):
            store.bind(model, **{"model_id": MODEL_ID, **kwargs})
        assert store.index.namespaces() == []


# --- crafted but self-consistent files ------------------------------------------------------


def test_a_self_consistent_file_of_another_kind_is_a_miss(guard, model_of):
    from promptstore.snapshots.cold import ColdTier

    model = model_of("llama")
    tokens = prompt_tokens(30, seed=3)
    with PromptStore.open(guard.root, durability="sync") as store:
        space = store.bind(model, model_id=MODEL_ID)
        prefill_insert(space, model, tokens)
        (node,) = list(store.index.iter_nodes(space.namespace))
        other = _model("llama", "hd32")
        quantized = _model_cache(other, tokens, kv_bits=8)
        tier = ColdTier(guard.root / "cold")
        ref = tier.write(node.id, [c.snapshot(0) for c in quantized])
        assert tier.owns(ref.path, node.id)
        os.replace(tier.absolute(ref.path), tier.absolute(node.record.file))  # in place of the node's own file
    with PromptStore.open(guard.root, hot_bytes=0) as store:
        space = store.bind(model, model_id=MODEL_ID)
        length, err = continuation_error(space, model, tokens)
        assert length == 0 and err < TOL
        assert [r.reason for r in store.reports]
