"""A disk that refuses writes never costs what was stored: a split, a checkpoint
filled in or a restart keep a node's old file named until its replacement is on
disk, and a store closed on a full disk restores every conversation it had
stored, from a real small filesystem (a tmpfs) and from ENOSPC injected at
every write point of the cold tier."""

from __future__ import annotations

import errno
import os

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore.errors import DiskWriteError
from promptstore.snapshots import cold, safetensors_writer
from promptstore.store.compact import compact

from ..conftest import assert_hit_whole, forward, fresh_cache, insert_following_checkpoints, prompt_tokens

DURABILITIES = ("write_back", "write_through", "sync", "admit")
A = prompt_tokens(600, seed=61)
B = mx.concatenate([A[:9], prompt_tokens(591, seed=62)])  # splits A's node at 9, as a new chat would


def turn(space, model, tokens) -> None:
    """Store `tokens` as a chat turn (what the server's inserts are): prefill past the hit."""
    hit = space.fetch(tokens)
    forward(model, hit.cache, tokens[hit.length :])
    space.insert(tokens, hit.cache, turn=True)


def problems(root) -> dict:
    """What compact --verify (dry run) finds wrong: failed reads, missing files, bad records."""
    report = compact(root, verify=True, dry_run=True, lmdb=False, merge=False)
    bad = ("failed verify", "corrupt index records", "missing files")
    found = {k: v for k, v in report.actions.items() if k.startswith(bad) and any(v.values())}
    return found | ({"errors": report.errors} if report.errors else {})


def files_named(store) -> tuple[set[str], bool]:
    """The files the index names, and whether any record still reads a wider one."""
    names, wider = set(), False
    for ns in store.index.namespaces():
        for node in store.index.iter_nodes(ns):
            if node.record.file:
                names.add(node.record.file)
                wider |= node.record.file_node is not None
    return names, wider


def on_disk(root) -> set[str]:
    files = (root / "cold" / "files").rglob("*.safetensors")
    return {str(p.relative_to(root / "cold")) for p in files if ".tmp-" not in p.name}


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_split_the_full_disk_refuses_keeps_the_stored_conversation_whole(small_disk, model_of, durability):
    model = model_of("llama")
    disk = small_disk(8 << 20)
    root = disk.path / "store"
    settings = dict(durability=durability, warm_start=False)
    with PromptStore.open(root, **settings) as store:
        turn(store.bind(model, model_id="m"), model, A)
    assert store.unwritten == (0, 0)

    disk.fill(leave=96 << 10)  # room for the index's pages, none for A's halves or B
    with PromptStore.open(root, **settings) as store:
        space = store.bind(model, model_id="m")
        turn(space, model, B)  # the split: both halves' own files are refused
        disk.fill(leave=96 << 10)  # what a file freed meanwhile is taken, as other writers would
        assert_hit_whole(space, model, A)
    assert store.unwritten[0] > 0  # B's own node at least: the disk refused it

    with PromptStore.open(root, **settings) as store:  # the disk still full
        space = store.bind(model, model_id="m")
        assert_hit_whole(space, model, A)  # both halves, from A's old file
        assert space.fetch(B).length >= 9
    assert problems(root) == {}

    disk.free()
    with PromptStore.open(root, **settings) as store:
        space = store.bind(model, model_id="m")
        assert_hit_whole(space, model, A)  # the halves read now get files of their own
        turn(space, model, B)
    with PromptStore.open(root, **settings) as store:
        space = store.bind(model, model_id="m")
        assert_hit_whole(space, model, A)
        assert_hit_whole(space, model, B)
        names, wider = files_named(store)
    assert not wider and names == on_disk(root)  # each node its own file; the old one is gone
    assert problems(root) == {}


class RefusingOS:
    """The `os` module as the cold tier's writing code sees it, but from the
    `k`-th call that writes (creates, writes, syncs, renames or links) on, every
    such call says ENOSPC: the disk filled up there and stays full."""

    WRITES = {"write", "pwrite", "fsync", "replace", "link", "rename"}

    def __init__(self, k: int):
        self.k, self.calls = k, 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in self.WRITES and name != "open":
            return real

        def call(*args, **kwargs):
            if name == "open" and not (len(args) > 1 and args[1] & os.O_CREAT):
                return real(*args, **kwargs)  # reading or syncing a folder
            self.calls += 1
            if self.calls >= self.k:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real(*args, **kwargs)

        return call


def test_enospc_at_every_write_point_of_a_split_keeps_the_stored_conversation_whole(tmp_path, model_of, monkeypatch):
    model = model_of("llama")
    k = 0
    while True:
        k += 1
        assert k < 200, "the writes never stopped meeting the injected fault"
        root = tmp_path / f"store{k}"
        with PromptStore.open(root, durability="sync", warm_start=False) as store:
            turn(store.bind(model, model_id="m"), model, A)
        refusing = RefusingOS(k)
        with monkeypatch.context() as patch:
            patch.setattr(cold, "os", refusing)
            patch.setattr(safetensors_writer, "os", refusing)
            with PromptStore.open(root, durability="sync", warm_start=False) as store:
                turn(store.bind(model, model_id="m"), model, B)
        with PromptStore.open(root, durability="sync", warm_start=False) as store:
            space = store.bind(model, model_id="m")
            assert_hit_whole(space, model, A)
            assert space.fetch(B).length >= 9
        assert problems(root) == {}
        if refusing.calls < k:
            break  # every write point of the split and of the close has refused once


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text", "falcon_h1"])
def test_a_full_disk_costs_no_stored_state_of_any_cache_kind(small_disk, model_of, family):
    """Recurrent states, sliding windows and cache lists: what A restored before a
    split the full disk refused, it restores after a restart, as a full prefill
    computes it; a checkpoint a later prompt filled in and the disk refused is
    read back without it, and the record says so."""
    model = model_of(family)
    disk = small_disk(8 << 20)
    root = disk.path / "store"
    settings = dict(durability="write_back", warm_start=False)  # its halves' writes come at the close
    past_a = mx.concatenate([A, prompt_tokens(1, seed=63)])  # restores through A's end, where its states are

    def restored(space) -> int:
        hit = space.fetch(past_a)
        want = forward(model, fresh_cache(model), past_a)
        got = forward(model, hit.cache, past_a[hit.length :])
        assert mx.abs(want - got).max().item() < 1e-4
        return hit.length

    with PromptStore.open(root, **settings) as store:
        space = store.bind(model, model_id="m")
        insert_following_checkpoints(space, model, A)
    with PromptStore.open(root, **settings) as store:
        before = restored(store.bind(model, model_id="m"))
    assert before == len(A)

    disk.fill(leave=96 << 10)
    with PromptStore.open(root, **settings) as store:
        space = store.bind(model, model_id="m")
        insert_following_checkpoints(space, model, B, checkpoints=[9])  # a checkpoint at the branch point
        disk.fill(leave=96 << 10)
    with PromptStore.open(root, **settings) as store:
        assert restored(store.bind(model, model_id="m")) == before
    assert problems(root) == {}
    disk.free()
    with PromptStore.open(root, **settings) as store:
        space = store.bind(model, model_id="m")
        insert_following_checkpoints(space, model, B, checkpoints=[9])
        assert restored(space) == before
    assert problems(root) == {}


def test_what_waits_for_a_refusing_disk_stays_within_the_memory_budget(tmp_path, model_of, monkeypatch):
    """A long spell: nodes memory evicts and the disk refuses wait in memory, but
    no more than hot_bytes of them; the oldest go (counted), the process's memory
    stays bounded, and what is served is still a prefill's state."""
    model = model_of("llama")
    budget = 256 << 10  # about two of these prompts' nodes
    with PromptStore.open(tmp_path, durability="write_back", hot_bytes=budget, warm_start=False) as store:
        space = store.bind(model, model_id="m")

        def refused(*args, **kwargs):
            raise DiskWriteError("could not write: No space left on device")

        monkeypatch.setattr(store.tiers.cold, "write", refused)
        prompts = [prompt_tokens(300, seed=80 + i) for i in range(12)]
        for tokens in prompts:
            turn(space, model, tokens)
            with store.tiers.spills.lock:
                waiting = sum(
                    sum(s.nbytes for s in j.snapshots if s is not None) for j in store.tiers.spills.stranded.values()
                )
            assert waiting <= budget
        disk = store.disk()
        assert disk.refusing and disk.dropped_nodes > 0 and disk.dropped_bytes > 0
        assert_hit_whole(space, model, prompts[-1])  # the newest is still in memory
        monkeypatch.undo()
    assert problems(tmp_path) == {}
    with PromptStore.open(tmp_path, warm_start=False) as store:  # what the close wrote serves as a prefill's
        space = store.bind(model, model_id="m")
        assert_hit_whole(space, model, prompts[-1])
        for tokens in prompts[:-1]:
            hit = space.fetch(tokens)
            assert hit.length in (0, len(tokens) - 1)
