"""mlx-lm prompt-cache files: read into promptstore caches, and the other way round."""

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from promptstore import caches as C
from promptstore.errors import SnapshotFormatError, UnknownKindError

from ..conftest import forward, fresh_cache, prompt_tokens

FAMILIES = ["llama", "gemma3_text", "qwen3_next", "llama4", "falcon_h1", "baichuan_m1"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_file_mlx_lm_wrote_loads_and_generates_the_same(model_of, tmp_path, family):
    model = model_of(family)
    tokens = prompt_tokens(50, seed=9)
    plain = mlx_cache.make_prompt_cache(model)
    forward(model, plain, tokens[:37])
    path = tmp_path / "cache.safetensors"
    mlx_cache.save_prompt_cache(str(path), plain, {"note": "hi"})
    loaded, meta = C.load_mlx_lm_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "hi"}
    assert all(type(c).__module__.startswith("promptstore.") for c in loaded)
    assert C.prompt_position(loaded) == 37
    want = forward(model, fresh_cache(model), tokens)
    # Usable directly, and through a snapshot of it.
    snaps = C.snapshot_prompt_cache(loaded, 0)
    got = forward(model, loaded, tokens[37:])
    hit = fresh_cache(model)
    assert C.restore_prompt_cache(hit, snaps, 37)
    again = forward(model, hit, tokens[37:])
    assert mx.abs(want - got).max().item() < 1e-4
    assert mx.abs(want - again).max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "falcon_h1"])
def test_mlx_lm_loads_a_file_of_our_caches(model_of, tmp_path, family):
    model = model_of(family)
    tokens = prompt_tokens(40, seed=10)
    ours = fresh_cache(model)
    forward(model, ours, tokens[:30])
    path = tmp_path / "ours.safetensors"
    C.save_mlx_lm_prompt_cache(str(path), ours)
    theirs = mlx_cache.load_prompt_cache(str(path))
    want = forward(model, fresh_cache(model), tokens)
    got = forward(model, theirs, tokens[30:])
    assert mx.abs(want - got).max().item() < 1e-4


def test_a_class_name_in_a_file_cannot_choose_code(tmp_path):
    cache = [C.KVCache()]
    cache[0].update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    path = tmp_path / "evil.safetensors"
    arrays, meta = mx.load(str(_saved(cache, tmp_path)), return_metadata=True)
    meta = {k: ("create_attention_mask" if v == "KVCache" else v) for k, v in meta.items()}
    mx.save_safetensors(str(path), arrays, meta)
    with pytest.raises(UnknownKindError):
        C.load_mlx_lm_prompt_cache(path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(SnapshotFormatError):
        C.load_mlx_lm_prompt_cache(junk)


def _saved(cache, tmp_path):
    path = tmp_path / "plain.safetensors"
    mlx_cache.save_prompt_cache(str(path), cache)
    return path
