"""Snapshot file names carry a node's key and a random tag, never its span (issue 16:
a listing of the cold tier told every stored prompt's length). Files named the old
way ("<key>-<start>-<end>-<tag>") keep being read, owned and kept."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from promptstore import PromptStore
from promptstore.identity import NodeId
from promptstore.snapshots.cold import ColdTier
from promptstore.store.compact import compact

from ..conftest import _model, prompt_tokens
from ..reliability._util import TOL, continuation_error, prefill_insert

TOKENS = prompt_tokens(64, seed=62)


def test_names_hold_no_span(tmp_path):
    model = _model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        for n in (20, 40, 64):
            prefill_insert(space, model, TOKENS[:n])
        nodes = list(store.index.iter_nodes(space.namespace))
    assert len(nodes) == 3
    for node in nodes:
        h = node.key.hex()
        assert re.fullmatch(rf"files/{h[:2]}/{h[2:4]}/{h}-[0-9a-f]{{8}}\.safetensors", node.record.file)


def test_owns_names_written_before(tmp_path):
    tier = ColdTier(tmp_path)
    node = NodeId(bytes(range(16)), bytes(16), 5, 21)
    stem = tier.relative_path(node)[: -len(".safetensors")]
    for rest, owned in [
        ("-5-21", True),  # the old untagged name
        ("-5-21-0123abcd", True),  # the old tagged name
        ("-0123abcd", True),
        ("-5-22-0123abcd", False),  # another span of this key
        ("-4-21", False),
        ("-5-21-0123abcd-0123abcd", False),
    ]:
        assert tier.owns(f"{stem}{rest}.safetensors", node) == owned, rest


def rename_the_old_way(root, store, space) -> list[str]:
    """Give every file the name the code before this change gave it, and point its record at it."""
    names = []
    for node in list(store.index.iter_nodes(space.namespace)):
        old = node.record.file
        tag = old[-len("0123abcd.safetensors") : -len(".safetensors")]
        new = f"{old.rsplit('-', 1)[0]}-{node.start}-{node.end}-{tag}.safetensors"
        (root / "cold" / old).rename(root / "cold" / new)
        store.index.update_record(node.key, node.record.model_copy(update={"file": new}))
        names.append(new)
    return names


def test_a_store_with_old_names_keeps_serving(tmp_path, caplog):
    model = _model("llama")
    with PromptStore.open(tmp_path, durability="sync") as store:
        space = store.bind(model, model_id="m")
        for n in (20, 40):
            prefill_insert(space, model, TOKENS[:n])
        old_names = rename_the_old_way(tmp_path, store, space)
    report = compact(tmp_path, verify=True, merge=False, max_bytes=1 << 30)
    assert "orphan files" not in report.actions and not any("verify" in r for r in report.actions)
    with PromptStore.open(tmp_path, hot_bytes=0) as store:
        space = store.bind(model, model_id="m")
        length, err = continuation_error(space, model, TOKENS[:40])
        assert length == 39 and err < TOL
        assert sorted(n.record.file for n in store.index.iter_nodes(space.namespace)) == sorted(old_names)
    # A damaged file of the old name is this node's: quarantined, not left in place.
    deep = tmp_path / "cold" / max(old_names, key=lambda n: int(n.split("-")[-2]))
    deep.write_bytes(deep.read_bytes()[:-5])
    with caplog.at_level(logging.CRITICAL), PromptStore.open(tmp_path, hot_bytes=0) as store:
        length, err = continuation_error(store.bind(model, model_id="m"), model, TOKENS[:40])
        assert length == 20 and err < TOL
    assert not deep.exists() and len(list((tmp_path / "cold" / "quarantine").iterdir())) == 1


def test_the_store_written_at_dd4fc98_keeps_serving(tmp_path, caplog):
    """tests/data/legacy-store-v2, written by the code before this change (schema 1,
    file names with spans): it upgrades at its first open, every prompt it stored hits
    and continues exactly like a full prefill, and compact verifies and keeps every file."""
    import shutil

    from tests.data.make_legacy_store import FAMILIES, A, B, C

    root = tmp_path / "store"
    shutil.copytree(Path(__file__).parents[1] / "data" / "legacy-store-v2", root)
    names = sorted(str(p.relative_to(root / "cold")) for p in (root / "cold" / "files").rglob("*.safetensors"))
    assert names and all(re.search(r"-\d+-\d+-[0-9a-f]{8}\.safetensors$", n) for n in names)
    with caplog.at_level(logging.CRITICAL), PromptStore.open(root, hot_bytes=0, checkpoint_interval=16) as store:
        for family in FAMILIES:
            space = store.bind(_model(family), model_id=f"legacy-{family}")
            for tokens in (A, B, C):
                length, err = continuation_error(space, _model(family), tokens)
                assert length > 0 and err < TOL, (family, len(tokens))
        assert not store.reports, list(store.reports)
    report = compact(root, verify=True, merge=False, max_bytes=1 << 30)
    assert not {"orphan files", "missing files"} & set(report.actions), report.actions
    assert not any("verify" in k or "stray" in k for k in report.actions), report.actions
    assert sorted(str(p.relative_to(root / "cold")) for p in (root / "cold" / "files").rglob("*.safetensors")) == names
