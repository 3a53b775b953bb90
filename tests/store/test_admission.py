"""The admit durability: each rule of the policy (store/admission.py), the write
budget, the retention hook, and the counters of what was written and read back."""

import time
from types import SimpleNamespace

import mlx.core as mx
import pytest

from promptstore import PromptStore
from promptstore import caches as C
from promptstore.config import Settings
from promptstore.errors import SettingsError
from promptstore.store.admission import Facts, WriteBudget, admit

from ..conftest import forward, greedy, prompt_tokens

IDLE = 60.0
CONVERSATION = prompt_tokens(160, seed=3)  # turns end at 40, 80, 120, 160
ONE_OFF = prompt_tokens(50, seed=4)
OTHER_ONE_OFF = prompt_tokens(50, seed=5)


class Clock:
    """A clock the test moves (tiers.clock)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _open(path, **settings):
    store = PromptStore.open(path, durability="admit", admit_idle_seconds=IDLE, **settings)
    clock = Clock()
    store.clock = clock
    return store, clock


def _turn(space, model, tokens, prefill_seconds=None):
    """One request: fetch, prefill the rest, insert (what a server does per prompt)."""
    hit = space.fetch(tokens)
    forward(model, hit.cache, tokens[hit.length :])
    space.insert(tokens, hit.cache, prefill_seconds=prefill_seconds)
    return hit


def _written(store) -> int:
    store.write_due()
    store.flush()
    return store.metrics().disk_written_bytes


def _closed(store):
    """What a closed store's process counted (its index is closed: no sizes)."""
    return store.tiers.metrics(hot_budget_bytes=0, stored_nodes=0, stored_bytes=0, disk_budget_bytes=0)


def _files(path):
    return [p for p in (path / "cold" / "files").rglob("*.safetensors") if ".tmp-" not in p.name]


def _restorable(path, model, tokens) -> int:
    """The hit a store reopened at `path` serves for `tokens` (from disk)."""
    with PromptStore.open(path, durability="write_back") as store:
        return store.bind(model, model_id="m").fetch(tokens).length


# --- the decision ----------------------------------------------------------------------


def _facts(**kw):
    return Facts(
        **{"nbytes": 100, "prefill_seconds": 0.1, "reused": False, "conversation": False, "idle_for": 0.0, **kw}
    )


@pytest.mark.parametrize(
    "event,facts,expected",
    [
        ("tick", _facts(), False),  # a new node waits
        ("tick", _facts(reused=True), True),
        ("tick", _facts(conversation=True, idle_for=IDLE - 1), False),
        ("tick", _facts(conversation=True, idle_for=IDLE), True),
        ("tick", _facts(idle_for=10 * IDLE), False),  # a one-off, however idle
        ("evicted", _facts(), False),
        ("evicted", _facts(conversation=True), True),
        ("evicted", _facts(prefill_seconds=30.0), True),  # costly to recompute
        ("shutdown", _facts(), False),
        ("shutdown", _facts(conversation=True), True),
        ("shutdown", _facts(prefill_seconds=300.0), False),  # costly, but a one-off nobody came back to
        ("shutdown", _facts(turn=True), True),  # a chat's turn: a client comes back to it
        ("evicted", _facts(turn=True), True),
        ("tick", _facts(turn=True, idle_for=10 * IDLE), False),  # steady state: a first turn waits for reuse
    ],
)
def test_the_decision(event, facts, expected):
    settings = Settings(durability="admit", admit_idle_seconds=IDLE, admit_prefill_seconds=30.0)
    assert admit(event, facts, 0.0, settings) is expected


def test_a_retention_class_decides_first():
    settings = Settings(durability="admit")
    never = SimpleNamespace(never_write=True, keep_until=None)
    keep = SimpleNamespace(never_write=False, keep_until=50.0)
    assert not admit("tick", _facts(reused=True, retention=never), 0.0, settings)
    assert not admit("shutdown", _facts(conversation=True, retention=never), 0.0, settings)
    assert admit("tick", _facts(retention=keep), 10.0, settings)  # kept until 50
    assert not admit("tick", _facts(retention=keep), 60.0, settings)  # expired: the rules decide


def test_the_budget_spends_an_hour_at_a_time():
    budget = WriteBudget(100)
    assert budget.take(60, 0.0) and not budget.take(60, 10.0) and budget.take(40, 10.0)
    assert not budget.take(1, 3599.0) and budget.take(60, 3600.0)
    assert WriteBudget(None).take(10**15, 0.0)


def test_settings_take_sizes_and_refuse_a_negative_budget():
    assert Settings.from_env(disk_write_budget="2GiB").disk_write_budget == 2 << 30
    assert Settings.from_env(disk_write_budget=1000).disk_write_budget == 1000
    assert Settings.from_env().disk_write_budget is None
    for bad in (-1, "-5GB", "lots"):
        with pytest.raises(SettingsError, match="disk_write_budget"):
            Settings.from_env(disk_write_budget=bad)
    with pytest.raises(SettingsError, match="admit_idle_seconds"):
        Settings.from_env(admit_idle_seconds=0)


# --- the rules, through a store ---------------------------------------------------------


def test_a_one_off_prompt_writes_nothing(tmp_path, model_of):
    model = model_of("llama")
    store, clock = _open(tmp_path)
    space = store.bind(model, model_id="m")
    _turn(space, model, ONE_OFF)
    clock.now += 10 * IDLE
    assert _written(store) == 0
    store.close()
    assert _files(tmp_path) == [] and _closed(store).declined_nodes >= 1
    with PromptStore.open(tmp_path) as again:
        assert again.index.stats()["nodes"] == 0  # its index entries went too
        assert again.index.stats()["disk_written_bytes"] == 0


def test_a_reused_node_is_written(tmp_path, model_of):
    model = model_of("llama")
    store, _ = _open(tmp_path)
    space = store.bind(model, model_id="m")
    _turn(space, model, CONVERSATION[:40])
    assert _written(store) == 0  # nobody came back yet
    hit = _turn(space, model, CONVERSATION[:80])
    assert hit.length == 40
    assert _written(store) > 0 and store.metrics().admitted["tick"] == 1
    assert len(_files(tmp_path)) == 1  # the first turn's node; the second waits (idle, or close)
    store.close()


def test_an_idle_conversation_is_written_after_the_idle_time(tmp_path, model_of):
    model = model_of("llama")
    store, clock = _open(tmp_path)
    space = store.bind(model, model_id="m")
    for end in (40, 80, 120):
        _turn(space, model, CONVERSATION[:end])
    reused = _written(store)  # the first two turns' nodes: reused
    assert store.metrics().admitted["tick"] == 2
    clock.now += IDLE - 1
    assert _written(store) == reused  # the last turn: not idle long enough
    clock.now += 1
    assert _written(store) > reused and store.metrics().admitted["tick"] == 3
    _turn(space, model, ONE_OFF)
    clock.now += 10 * IDLE
    after = _written(store)
    assert store.metrics().admitted["tick"] == 3  # a one-off is never a conversation
    store.close()
    assert _closed(store).disk_written_bytes == after
    assert _restorable(tmp_path, model, CONVERSATION) == 120
    assert _restorable(tmp_path, model, ONE_OFF) == 0


def test_the_admission_thread_writes_an_idle_conversation(tmp_path, model_of):
    model = model_of("llama")
    store, clock = _open(tmp_path)
    space = store.bind(model, model_id="m")
    for end in (40, 80):
        _turn(space, model, CONVERSATION[:end])
    clock.now += IDLE
    deadline = time.monotonic() + 30
    while store.metrics().admitted["tick"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # bounded: the thread looks every second
    assert store.metrics().admitted["tick"] == 2
    store.close()


def test_eviction_keeps_what_is_worth_keeping(tmp_path, model_of):
    model = model_of("llama")
    store, _ = _open(tmp_path, admit_prefill_seconds=30.0)
    space = store.bind(model, model_id="m")
    for end in (40, 80):
        _turn(space, model, CONVERSATION[:end])  # the second: a conversation's tip, not reused
    _turn(space, model, ONE_OFF, prefill_seconds=100.0)  # costly to recompute
    store.tiers.hot.budget = 0
    _turn(space, model, OTHER_ONE_OFF)  # evicts every node, itself too
    store.flush()
    m = store.metrics()
    assert m.hot_nodes == 0 and m.admitted["evicted"] >= 2 and m.declined_nodes == 1
    store.close()
    assert _restorable(tmp_path, model, CONVERSATION[:100]) == 80
    assert _restorable(tmp_path, model, ONE_OFF) == 49
    assert _restorable(tmp_path, model, OTHER_ONE_OFF) == 0


def test_close_writes_the_conversation_and_drops_one_offs(tmp_path, model_of):
    model = model_of("llama")
    store, _ = _open(tmp_path)
    space = store.bind(model, model_id="m")
    for end in (40, 80, 120):
        _turn(space, model, CONVERSATION[:end])
    _turn(space, model, ONE_OFF)
    assert set(store.only_in_memory()) <= set(store.tiers.hot.entries)
    assert len(store.only_in_memory()) == 1  # the last turn, which close writes; not the one-off
    store.close()
    assert store.unwritten == (0, 0)  # declined is not refused
    assert _closed(store).admitted["shutdown"] == 1
    assert _restorable(tmp_path, model, CONVERSATION) == 120
    assert _restorable(tmp_path, model, ONE_OFF) == 0


def test_a_restore_after_admit_equals_a_full_prefill(tmp_path, model_of):
    model = model_of("llama")
    store, _ = _open(tmp_path)
    space = store.bind(model, model_id="m")
    for end in (40, 80):
        _turn(space, model, CONVERSATION[:end])
    store.close()
    with PromptStore.open(tmp_path) as again:
        hit = again.bind(model, model_id="m").fetch(CONVERSATION[:100])
        assert hit.length == 80
        restored = greedy(model, hit.cache, forward(model, hit.cache, CONVERSATION[80:100]), 8)
        m = again.metrics()
        assert m.read_back_bytes > 0
    full = C.make_prompt_cache(model)
    assert restored == greedy(model, full, forward(model, full, CONVERSATION[:100]), 8)


def test_the_budget_writes_less_and_never_blocks_an_insert(tmp_path, model_of):
    model = model_of("llama")
    store, clock = _open(tmp_path, disk_write_budget=0)
    space = store.bind(model, model_id="m")
    for end in (40, 80, 120, 160):
        _turn(space, model, CONVERSATION[:end])
    clock.now += IDLE
    assert _written(store) == 0
    m = store.metrics()
    assert m.over_budget_nodes >= 3 and m.hot_nodes == 4  # still served from memory
    assert space.fetch(CONVERSATION).length == 159
    store.close()


def test_the_budget_writes_the_most_valuable_first(tmp_path, model_of):
    model = model_of("llama")
    store, clock = _open(tmp_path, disk_write_budget=0)  # nothing written while the turns run
    space = store.bind(model, model_id="m")
    _turn(space, model, CONVERSATION[:40], prefill_seconds=0.001)
    _turn(space, model, CONVERSATION[:80], prefill_seconds=5.0)
    _turn(space, model, CONVERSATION[:120], prefill_seconds=0.001)
    entries = {e.node.end: e for e in store.tiers.hot.entries.values()}
    store.tiers.durability.admission.budget.per_hour = entries[80].nbytes  # room for one node
    store.tiers.durability.admission.used([e.key for e in entries.values()], clock())  # all three reused
    store.write_due()
    store.flush()
    assert not entries[80].dirty and entries[40].dirty and entries[120].dirty
    assert store.metrics().over_budget_nodes == 3  # each counted once, the first time it did not fit
    store.close()


def test_a_retention_class_that_never_writes_is_obeyed(tmp_path, model_of):
    model = model_of("llama")
    store, _ = _open(tmp_path)
    store.tiers.keeping.of = lambda key: SimpleNamespace(never_write=True, keep_until=None)
    space = store.bind(model, model_id="m")
    for end in (40, 80, 120):
        _turn(space, model, CONVERSATION[:end])
    assert _written(store) == 0
    store.close()
    assert _files(tmp_path) == []


@pytest.mark.parametrize("durability", ["write_back", "write_through", "sync"])
def test_the_other_durabilities_still_write_one_offs(tmp_path, model_of, durability):
    model = model_of("llama")
    with PromptStore.open(tmp_path, durability=durability) as store:
        space = store.bind(model, model_id="m")
        _turn(space, model, ONE_OFF)
        assert store.write_due() == 0  # admission is not theirs
    assert _restorable(tmp_path, model, ONE_OFF) == 49


def test_counters_of_bytes_written_and_read_back_persist(tmp_path, model_of):
    model = model_of("llama")
    store, _ = _open(tmp_path)
    space = store.bind(model, model_id="m")
    for end in (40, 80):
        _turn(space, model, CONVERSATION[:end])
    store.close()
    written = _closed(store).disk_written_bytes
    assert written == sum(p.stat().st_size for p in _files(tmp_path))
    with PromptStore.open(tmp_path) as again:
        space = again.bind(model, model_id="m")
        space.fetch(CONVERSATION[:100])
        m = again.metrics()
        assert m.read_back_bytes > 0 and m.write_amplification == pytest.approx(0.0)  # wrote nothing yet
    with PromptStore.open(tmp_path) as third:
        stats = third.index.stats()
    assert stats["disk_written_bytes"] == written and stats["disk_read_bytes"] == m.read_back_bytes
    mx.clear_cache()
