"""Tenant isolation (DESIGN.md invariant 2, docs/library.md, "Tenants"): two
tenants with different salts on one store, same model and model_id.

An attacker tenant probes for a victim's prompt: the exact prompt, its
prefixes, and prompts that share a long prefix with it. No probe restores a
single token of the victim's state, none touches the victim's nodes, files or
counters, and each takes the same code path as a probe for a prefix nobody
stored. Timing is measured (many interleaved repetitions, medians and a
permutation test) and printed, never asserted: the structural facts are the
guarantee, the figures are the evidence.
"""

from __future__ import annotations

import random
import time

import mlx.core as mx
import numpy as np
import pytest

from promptstore import PromptStore
from promptstore.index import prefix_key, trie
from promptstore.store.compact import compact

from ..conftest import _model, insert_following_checkpoints, prompt_tokens
from ._util import TOL, continuation_error, prefill_insert

MODEL_ID = "shared-model-v1"
VICTIM, ATTACKER = "tenant-victim-5f1c", "tenant-attacker-09ad"

SYSTEM = prompt_tokens(96, seed=501)  # the victim's long system prompt
TURN = mx.concatenate([SYSTEM, prompt_tokens(40, seed=502)])  # a conversation on top of it
FAMILIES = ["llama", "qwen3_next"]  # range layers only; recurrent layers with checkpoints


def store_victim(root, family):
    """The victim stores half of SYSTEM, SYSTEM, then TURN, following hit.checkpoints (several nodes, on disk)."""
    model = _model(family)
    with PromptStore.open(root, durability="sync", checkpoint_interval=32) as store:
        victim = store.bind(model, model_id=MODEL_ID, salt=VICTIM)
        for tokens in (SYSTEM[:48], SYSTEM, TURN):
            insert_following_checkpoints(victim, model, tokens)
        nodes = list(store.index.iter_nodes(victim.namespace))
    assert len(nodes) >= 3
    return nodes


def probes() -> dict[str, mx.array]:
    other = prompt_tokens(64, seed=503)
    return {
        "exact system prompt": SYSTEM,
        "exact conversation": TURN,
        "conversation + 1": mx.concatenate([TURN, other[:1]]),
        "system prompt, last token changed": mx.concatenate([SYSTEM[:-1], (SYSTEM[-1:] + 1) % 256]),
        "first 95": SYSTEM[:95],
        "first 48": SYSTEM[:48],
        "first 2": SYSTEM[:2],
        "80 shared, then diverges": mx.concatenate([SYSTEM[:80], other]),
        "system prompt + another question": mx.concatenate([SYSTEM, other]),
    }


class Spy:
    """Counts what fetch does below the index lookup: child lookups, tier reads."""

    def __init__(self, monkeypatch, store):
        self.children: list = []
        self.tier_gets = 0
        real_child, real_get = trie._child, store.tiers.get

        def child(txn, dbs, ns, parent, token, depth, corrupt):
            node = real_child(txn, dbs, ns, parent, token, depth, corrupt)
            self.children.append(None if node is None else node.key)
            return node

        def get(node):
            self.tier_gets += 1
            return real_get(node)

        monkeypatch.setattr(trie, "_child", child)
        monkeypatch.setattr(store.tiers, "get", get)


def assert_isolated(store, attacker, victim, victim_keys, monkeypatch):
    """Every probe: a miss on the path of a never-stored prefix, touching nothing of the victim's."""
    spy = Spy(monkeypatch, store)
    loads, reports = store.counts["cold_loads"], len(store.reports)
    victim_counters = store.index.counters(victim.namespace)
    hot_clock = store.tiers.hot.clock
    for name, tokens in probes().items():
        spy.children.clear()
        hit = attacker.fetch(tokens)
        assert (hit.length, hit.nodes, hit.cold_nodes, hit.cold_tokens) == (0, 0, 0, 0), name
        assert [c.offset for c in hit.cache] == [0] * len(hit.cache), name  # fresh, empty caches
        # One child lookup under the attacker's own root, which finds nothing: the same
        # path a prefix nobody stored takes.
        assert spy.children == [None], (name, spy.children)
        match = store.index.lookup(attacker.namespace, tokens)
        assert (match.path, match.matched, match.restorable, match.corrupt) == ([], 0, 0, []), name
    assert spy.tier_gets == 0  # no snapshot, hot or cold, was even looked at
    assert store.counts["cold_loads"] == loads and len(store.reports) == reports
    assert store.tiers.hot.clock == hot_clock  # not even a hot-tier lookup
    assert store.index.counters(victim.namespace) == victim_counters  # the victim's hit/miss counters did not move
    assert list(store.index.iter_nodes(attacker.namespace)) == []
    assert {n.key for n in store.index.iter_nodes(victim.namespace)} == victim_keys


@pytest.mark.parametrize("family", FAMILIES)
def test_attacker_restores_nothing_of_the_victims_prefix(tmp_path, family, monkeypatch):
    model = _model(family)
    root = tmp_path / "store"
    victim_keys = {n.key for n in store_victim(root, family)}
    # Cold (a restarted server) and hot (the victim's snapshots in this process's memory).
    for hot_bytes in (0, 1 << 30):
        with PromptStore.open(root, hot_bytes=hot_bytes) as store:
            victim = store.bind(model, model_id=MODEL_ID, salt=VICTIM)
            attacker = store.bind(model, model_id=MODEL_ID, salt=ATTACKER)
            assert attacker.namespace.key != victim.namespace.key
            if hot_bytes:
                assert victim.fetch(TURN).length > 0  # the victim's nodes are hot now
                assert len(store.tiers.hot) > 0
            with monkeypatch.context() as m:
                assert_isolated(store, attacker, victim, victim_keys, m)
            # The victim still gets its own prefix, exactly.
            length, err = continuation_error(victim, model, mx.concatenate([TURN, SYSTEM[:3]]))
            assert length == len(TURN) and err < TOL


def test_attacker_storing_the_same_prompt_gets_its_own_nodes(tmp_path):
    """Inserting the victim's exact prompt as the attacker creates separate nodes and files and
    changes none of the victim's; each tenant then hits only its own."""
    model = _model("llama")
    root = tmp_path / "store"
    victim_nodes = store_victim(root, "llama")
    files_before = {p: p.read_bytes() for p in (root / "cold" / "files").rglob("*.safetensors")}
    with PromptStore.open(root, durability="sync") as store:
        attacker = store.bind(model, model_id=MODEL_ID, salt=ATTACKER)
        prefill_insert(attacker, model, TURN)
        mine = list(store.index.iter_nodes(attacker.namespace))
        assert mine and not {n.key for n in mine} & {n.key for n in victim_nodes}
        assert not {n.record.file for n in mine} & {n.record.file for n in victim_nodes}
    for p, raw in files_before.items():
        assert p.read_bytes() == raw  # the victim's files are untouched
    with PromptStore.open(root, hot_bytes=0) as store:
        victim = store.bind(model, model_id=MODEL_ID, salt=VICTIM)
        attacker = store.bind(model, model_id=MODEL_ID, salt=ATTACKER)
        assert [(n.key, n.start, n.end) for n in store.index.iter_nodes(victim.namespace)] == [
            (n.key, n.start, n.end) for n in victim_nodes
        ]
        for space in (victim, attacker):
            length, err = continuation_error(space, model, mx.concatenate([TURN, SYSTEM[:2]]))
            assert length == len(TURN) and err < TOL


def test_same_salt_shares_across_processes(tmp_path):
    """Two bindings with the same salt (here: after a restart) share one trie."""
    model = _model("llama")
    root = tmp_path / "store"
    store_victim(root, "llama")
    with PromptStore.open(root, hot_bytes=0) as store:
        again = store.bind(model, model_id=MODEL_ID, salt=VICTIM)
        length, err = continuation_error(again, model, mx.concatenate([TURN, SYSTEM[:2]]))
        assert length == len(TURN) and err < TOL


@pytest.mark.parametrize(
    "first,second", [(None, VICTIM), (VICTIM, None)], ids=["unsalted-then-salted", "salted-then-unsalted"]
)
def test_salted_and_unsalted_do_not_share(tmp_path, first, second):
    model = _model("llama")
    with PromptStore.open(tmp_path / "store", durability="sync") as store:
        owner = store.bind(model, model_id=MODEL_ID, salt=first)
        other = store.bind(model, model_id=MODEL_ID, salt=second)
        prefill_insert(owner, model, SYSTEM)
        for tokens in (SYSTEM, mx.concatenate([SYSTEM, SYSTEM[:4]]), SYSTEM[:50]):
            hit = other.fetch(tokens)
            assert (hit.length, hit.nodes) == (0, 0)
        assert store.index.lookup(other.namespace, SYSTEM).matched == 0
        assert owner.fetch(mx.concatenate([SYSTEM, SYSTEM[:4]])).length == len(SYSTEM)


# --- timing: measured and printed, not asserted -------------------------------------------


def permutation_p(a: np.ndarray, b: np.ndarray, rounds: int = 2000, seed: int = 0) -> float:
    """Two-sided p-value of |median(a) - median(b)| under random relabelling."""
    rng = np.random.default_rng(seed)
    observed = abs(np.median(a) - np.median(b))
    pooled = np.concatenate([a, b])
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        hits += abs(np.median(pooled[: len(a)]) - np.median(pooled[len(a) :])) >= observed
    return (hits + 1) / (rounds + 1)


@pytest.mark.parametrize("tier", ["cold", "hot"])
def test_probe_timing_is_recorded(tmp_path, tier, monkeypatch, record_property, capsys):
    """The attacker times fetches of the victim's prefix against fetches of a never-stored
    prefix of the same length, interleaved in random order. Asserted: both take the same
    code path every time. Printed: medians, spread and a permutation test."""
    model = _model("llama")
    root = tmp_path / "store"
    store_victim(root, "llama")
    reps = 300
    control = mx.concatenate([(SYSTEM[:1] + 128) % 256, prompt_tokens(len(SYSTEM) - 1, seed=504)])
    assert control[0].item() != SYSTEM[0].item()
    with PromptStore.open(root, hot_bytes=0 if tier == "cold" else 1 << 30) as store:
        victim = store.bind(model, model_id=MODEL_ID, salt=VICTIM)
        attacker = store.bind(model, model_id=MODEL_ID, salt=ATTACKER)
        if tier == "hot":
            victim.fetch(TURN)
        spy = Spy(monkeypatch, store)
        times = {"victim": [], "control": []}
        inner = {"victim": [], "control": []}
        rng = random.Random(7)
        for name in ("victim", "control") * 10:  # warm-up, discarded
            attacker.fetch(SYSTEM if name == "victim" else control)
        for _ in range(reps):
            for name in rng.sample(["victim", "control"], 2):
                tokens = SYSTEM if name == "victim" else control
                spy.children.clear()
                t0 = time.perf_counter_ns()
                hit = attacker.fetch(tokens)
                times[name].append(time.perf_counter_ns() - t0)
                inner[name].append(hit.seconds * 1e9)
                assert (hit.length, hit.nodes, hit.cold_nodes) == (0, 0, 0)
                assert spy.children == [None]
        assert spy.tier_gets == 0
    v, c = np.array(times["victim"]) / 1e3, np.array(times["control"]) / 1e3  # microseconds
    vi, ci = np.array(inner["victim"]) / 1e3, np.array(inner["control"]) / 1e3
    figures = {
        "reps": reps,
        "victim_median_us": round(float(np.median(v)), 1),
        "control_median_us": round(float(np.median(c)), 1),
        "median_diff_us": round(float(np.median(v) - np.median(c)), 1),
        "victim_iqr_us": [round(float(x), 1) for x in np.percentile(v, [25, 75])],
        "control_iqr_us": [round(float(x), 1) for x in np.percentile(c, [25, 75])],
        "permutation_p": round(float(permutation_p(v, c)), 3),
        "hit_seconds_median_diff_us": round(float(np.median(vi) - np.median(ci)), 1),
        "hit_seconds_permutation_p": round(float(permutation_p(vi, ci)), 3),
    }
    for k, val in figures.items():
        record_property(f"timing_{tier}_{k}", val)
    with capsys.disabled():
        print(f"\n[isolation timing, {tier}] {figures}")


def test_no_salt_is_written_anywhere(tmp_path):
    """Issue 16, defect 3: the namespace spec in the index held the salt in clear. No
    file under the store may hold either tenant's salt, before or after compact."""
    from promptstore.store.compact import compact

    model = _model("llama")
    root = tmp_path / "store"
    store_victim(root, "llama")
    with PromptStore.open(root, durability="sync") as store:
        prefill_insert(store.bind(model, model_id=MODEL_ID, salt=ATTACKER), model, TURN)
    for step in ("after use", "after compact"):
        files = [p for p in root.rglob("*") if p.is_file()]
        assert len(files) > 4, step
        for p in files:
            raw = p.read_bytes()
            assert VICTIM.encode() not in raw and ATTACKER.encode() not in raw, (step, p)
        compact(root, max_bytes=1 << 30)


def test_a_schema_1_store_keeps_its_unsalted_data_and_drops_its_salted(tmp_path):
    """A store written before salts were digested: its unsalted namespace still hits; the
    salted one is dropped at the first open, and compact reclaims its files and scrubs the
    index pages that held the salt."""
    from promptstore.store.compact import compact

    from ..index.test_tenant import as_schema_1

    model = _model("llama")
    root = tmp_path / "store"
    with PromptStore.open(root, durability="sync") as store:
        plain = store.bind(model, model_id=MODEL_ID)
        secret = store.bind(model, model_id=MODEL_ID, salt=VICTIM)
        for space in (plain, secret):
            prefill_insert(space, model, SYSTEM)
        files = {space: {n.record.file for n in store.index.iter_nodes(space.namespace)} for space in (plain, secret)}
        keys = plain.namespace.key, secret.namespace.key
    as_schema_1(root / "index", {keys[0]: None, keys[1]: VICTIM})
    assert VICTIM.encode() in (root / "index" / "data.mdb").read_bytes()
    with PromptStore.open(root, hot_bytes=0) as store:
        assert [ns.key for ns in store.index.namespaces()] == [keys[0]]
        length, err = continuation_error(store.bind(model, model_id=MODEL_ID), model, TURN)
        assert length == len(SYSTEM) and err < TOL
        assert store.bind(model, model_id=MODEL_ID, salt=VICTIM).fetch(TURN).length == 0
    report = compact(root, max_bytes=1 << 30)
    assert report.actions["orphan files"]["files"] == len(files[secret]) > 0
    left = {str(p.relative_to(root / "cold")) for p in (root / "cold" / "files").rglob("*.safetensors")}
    assert left == files[plain]
    assert not [p for p in root.rglob("*") if p.is_file() and VICTIM.encode() in p.read_bytes()]


# --- budgets: per tenant ------------------------------------------------------------------

ATTACKER_PROMPTS = [prompt_tokens(40, seed=600 + i) for i in range(6)]
NODE_BYTES = 40 * 2 * 2 * 2 * 16 * 4  # tokens x layers x (keys, values) x KV heads x head dim x float32
BUDGET = 4 * NODE_BYTES + NODE_BYTES // 2  # four of the attacker's six prompts fit


def attacker_keeps(root, victim: bool, tier: str) -> list[int]:
    """Which of its six prompts the attacker still has in `tier` after storing them all,
    with or without the victim storing (before) and using (after) prompts of its own."""
    model = _model("llama")
    mine = [prompt_tokens(60, seed=seed) for seed in (701, 702, 703)]
    with PromptStore.open(root, durability="sync", hot_bytes=BUDGET) as store:
        them = store.bind(model, model_id=MODEL_ID, salt=VICTIM)
        for tokens in mine if victim else []:
            prefill_insert(them, model, tokens)
        attacker = store.bind(model, model_id=MODEL_ID, salt=ATTACKER)
        for tokens in ATTACKER_PROMPTS:
            prefill_insert(attacker, model, tokens)
        for tokens in mine if victim else []:
            them.fetch(tokens)  # the victim's data is in use: recent, so worth keeping
        key = attacker.namespace.key
        hot = [e.node for e in store.tiers.hot.entries.values() if e.node.namespace == key]
    if tier == "disk":
        report = compact(root, max_bytes=BUDGET, merge=False, lmdb=False)
        assert report.status == "clean" and report.actions["over budget"]["nodes"] > 0  # eviction: upkeep
        with PromptStore.open(root) as store:
            space = store.bind(model, model_id=MODEL_ID, salt=ATTACKER)
            kept = [n.id for n in store.index.iter_nodes(space.namespace) if n.record.file]
    else:
        kept = hot
    prompt = {prefix_key(key, t): i for i, t in enumerate(ATTACKER_PROMPTS)}  # one node each
    return sorted(prompt[n.key] for n in kept)


@pytest.mark.parametrize("tier", ["hot", "disk"])
def test_what_a_tenant_keeps_does_not_depend_on_another_tenants_data(tmp_path, tier):
    """Issue 16's probe: with the victim's prefixes stored, the attacker kept fewer tokens
    (1,178 against 1,240), telling it the victim's data was there. Budgets are per tenant
    now: the attacker keeps exactly the same nodes either way."""
    alone = attacker_keeps(tmp_path / "alone", victim=False, tier=tier)
    beside = attacker_keeps(tmp_path / "beside", victim=True, tier=tier)
    assert 0 < len(alone) < len(ATTACKER_PROMPTS)  # over budget: something was evicted
    assert beside == alone
