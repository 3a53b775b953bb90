"""A group restores only what every rank can, and never from a store another shape
wrote: a rank's lost or damaged files, a rank's store in another rank's place, a
group of another size."""

from __future__ import annotations

import shutil

import pytest

from .conftest import launch
from .test_fidelity import _agreed, _faithful, _prompt


def _stored(tmp_path, model, kind="tensor"):
    """A store two turns filled, and the turn that comes back to them."""
    store = tmp_path / "store"
    first = _prompt(70)
    second = first + _prompt(40, 1)
    ranks = launch(tmp_path, model, store, [{"tokens": first}, {"tokens": second}], kind=kind)
    _faithful(ranks)
    return store, second, second + _prompt(20, 2)


def test_a_rank_that_lost_files_makes_the_group_restore_less(tmp_path, group_model):
    model = group_model("llama")
    store, second, third = _stored(tmp_path, model)
    whole = tmp_path / "whole"
    shutil.copytree(store, whole)
    # Rank 1 loses the file of the newest node it stored (the deepest of the conversation).
    files = sorted((store / "ranks/tensor-2/rank-1/cold/files").rglob("*.safetensors"), key=lambda f: f.stat().st_mtime)
    assert len(files) >= 2
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)  # its arrays zeroed: fails its checksum
    files[-1].write_bytes(bytes(data))
    intact = launch(tmp_path, model, whole, [{"tokens": third}])
    damaged = launch(tmp_path, model, store, [{"tokens": third}])
    full, less = _agreed(intact)[0], _agreed(damaged)[0]
    assert full >= len(second) - 16
    assert less < full, f"a damaged rank restored {less} tokens, as many as an intact group's {full}"
    _faithful(intact)
    _faithful(damaged)
    # Rank 0 had the whole conversation: it restored again, to the group's length.
    assert damaged[0]["counts"].get("group_restored_again", 0) >= 1
    assert damaged[1]["counts"].get("group_restored_again", 0) == 0


@pytest.mark.slow  # 21 s on 2 cores; a rank that lost some files stays in `make test`
def test_a_rank_that_lost_every_file_makes_the_group_prefill(tmp_path, group_model):
    model = group_model("llama")
    store, _, third = _stored(tmp_path, model)
    shutil.rmtree(store / "ranks/tensor-2/rank-0")
    ranks = launch(tmp_path, model, store, [{"tokens": third}])
    assert _agreed(ranks) == [0]
    _faithful(ranks)


def test_another_ranks_store_in_its_place_is_not_restored_from(tmp_path, group_model):
    model = group_model("llama")
    store, _, third = _stored(tmp_path, model)
    # Rank 0's store copied into rank 1's place: the other heads' keys and values.
    rank1 = store / "ranks/tensor-2/rank-1"
    shutil.rmtree(rank1)
    shutil.copytree(store / "ranks/tensor-2/rank-0", rank1)
    ranks = launch(tmp_path, model, store, [{"tokens": third}])
    assert _agreed(ranks) == [0]
    _faithful(ranks)


@pytest.mark.slow  # two groups started in turn (50 s on 2 cores): `make test-slow`
def test_a_group_of_another_size_starts_afresh(tmp_path, group_model):
    model = group_model("llama", num_attention_heads=4, num_key_value_heads=4)
    store, second, third = _stored(tmp_path, model)
    alone = launch(tmp_path, model, store, [{"tokens": third}], ranks=1)
    assert _agreed(alone) == [0]
    _faithful(alone)
    four = launch(tmp_path, model, store, [{"tokens": third}], ranks=4)
    assert _agreed(four) == [0]
    _faithful(four)
    # And each shape finds its own store again.
    again = launch(tmp_path, model, store, [{"tokens": third + _prompt(5, 9)}], ranks=4)
    assert _agreed(again)[0] >= len(third) - 16
    _faithful(again)
    two = launch(tmp_path, model, store, [{"tokens": third}])
    assert _agreed(two)[0] >= len(second) - 16
    assert all(r["folder"].endswith(f"tensor-2/rank-{r['rank']}") for r in two)
