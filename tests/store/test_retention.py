"""Retention: prefixes a client asked to keep outlast memory and disk pressure for
their time, and no longer; in_memory never reaches disk; the stronger class wins.
Time is the tiers' clock, set by each test (nothing sleeps)."""

import mlx.core as mx
import pytest

import promptstore
from promptstore import PromptStore, Retention
from promptstore.errors import SettingsError
from promptstore.store.retention import CLASSES
from promptstore.testing.tokenizer import demo_tokenizer

from ..conftest import forward, fresh_cache, prompt_tokens
from .test_end_to_end import chat_model


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def files(root):
    return [p for p in (root / "cold" / "files").rglob("*.safetensors") if ".tmp-" not in p.name]


def stored(store, model, tokens, retention=None):
    """Prefill `tokens` from their hit and insert them; the node that ends at their end."""
    space = store.bind(model, model_id="m")
    hit = space.fetch(tokens)
    forward(model, hit.cache, tokens[hit.length :])
    space.insert(tokens, hit.cache, retention=retention)
    return space, last_node(store, space, tokens)


def last_node(store, space, tokens):
    return store.index.lookup(space.namespace, tokens).path[-1]


def held(store, node) -> bool:
    return node.key in store.tiers.hot


def with_clock(store) -> Clock:
    clock = Clock()
    store.clock = clock
    return clock


def restores_like_a_prefill(model, space, tokens) -> bool:
    hit = space.fetch(tokens)
    assert hit.length == len(tokens) - 1
    want = forward(model, fresh_cache(model), tokens)
    got = forward(model, hit.cache, tokens[hit.length :])
    return mx.abs(want - got).max().item() < 1e-4


def test_a_prefix_kept_an_hour_outlasts_memory_pressure_for_its_hour_then_goes_first(tmp_path, model_of):
    model = model_of("llama")
    with PromptStore.open(tmp_path) as store:
        clock = with_clock(store)
        kept_tokens = prompt_tokens(40, seed=1)
        space, kept = stored(store, model, kept_tokens, retention="1h")
        store.tiers.hot.budget = int(2.5 * store.in_memory()[1])  # room for two nodes like it
        assert store.retention_of(kept.key).keep_until == clock.now + 3600
        for seed in range(2, 8):  # newer prefixes, worth more by recency, nobody asked to keep
            clock.now += 60
            stored(store, model, prompt_tokens(40, seed=seed))
            assert held(store, kept)
        m = store.metrics().retention
        assert m.held["1h"] == 1 and m.kept >= 1

        clock.now += 3600  # its hour is over: it is worth what its use says, the least here
        stored(store, model, prompt_tokens(40, seed=8))
        assert not held(store, kept)
        assert store.metrics().retention.expired == 1 and store.metrics().retention.held["1h"] == 0
        assert restores_like_a_prefill(model, space, kept_tokens)  # spilled to disk, not lost


def test_a_5m_prefix_pins_nothing_after_five_minutes(tmp_path, model_of):
    model = model_of("llama")
    with PromptStore.open(tmp_path) as store:
        clock = with_clock(store)
        _, kept = stored(store, model, prompt_tokens(40, seed=1), retention="5m")
        store.tiers.hot.budget = int(2.5 * store.in_memory()[1])
        clock.now += 200
        stored(store, model, prompt_tokens(40, seed=2))
        stored(store, model, prompt_tokens(40, seed=3))
        assert held(store, kept) and store.retention_of(kept.key).kept(clock.now)
        clock.now += 101  # five minutes and a second since it was asked for
        assert not store.retention_of(kept.key).kept(clock.now)
        stored(store, model, prompt_tokens(40, seed=4))
        assert not held(store, kept)


@pytest.mark.parametrize("durability", ["write_through", "sync", "write_back"])
def test_in_memory_never_reaches_disk(tmp_path, model_of, durability):
    model = model_of("llama")
    root = tmp_path / "store"
    private = prompt_tokens(40, seed=1)
    with PromptStore.open(root, durability=durability) as store:
        with_clock(store)
        space, node = stored(store, model, private, retention="in_memory")
        r = store.retention_of(node.key)
        assert r.never_write and r.name == "in_memory"
        store.flush()
        assert files(root) == [] and store.index.get(node.key).record.file is None
        stored(store, model, prompt_tokens(40, seed=2))  # not asked: written as the durability says
        store.flush()
        written = len(files(root))
        assert written == (0 if durability == "write_back" else 1)
        assert restores_like_a_prefill(model, space, private)  # served from memory meanwhile

        store.tiers.hot.budget = 0  # memory pressure: everything leaves memory
        stored(store, model, prompt_tokens(40, seed=3))
        store.flush()
        assert store.metrics().retention.never_written == 1
        assert not held(store, node) and store.retention_of(node.key) is None
    # After the close, which writes everything else, the private prefix is still on no disk.
    assert len(files(root)) == 2
    with PromptStore.open(root) as store:
        space = store.bind(model, model_id="m")
        assert space.fetch(private).length == 0
        node = store.index.lookup(space.namespace, private).path[-1]
        assert node.record.file is None


def test_in_memory_prefixes_left_at_close_are_not_written(tmp_path, model_of):
    model = model_of("llama")
    with PromptStore.open(tmp_path) as store:
        space, _ = stored(store, model, prompt_tokens(40, seed=1), retention="in_memory")
        stored(store, model, prompt_tokens(40, seed=2))
    assert len(files(tmp_path)) == 1 and store.unwritten == (0, 0)
    with PromptStore.open(tmp_path) as store:  # and its node went with it: no node without data is left
        space = store.bind(model, model_id="m")
        assert store.index.lookup(space.namespace, prompt_tokens(40, seed=1)).path == []
        assert len(list(store.index.iter_nodes(space.namespace))) == 1


def test_the_stronger_class_wins_on_a_shared_node(tmp_path, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(40, seed=1)
    with PromptStore.open(tmp_path) as store:
        clock = with_clock(store)
        space, node = stored(store, model, tokens, retention="5m")
        assert store.retention_of(node.key).name == "5m"
        clock.now += 10
        assert space.retain(tokens, "1h") == 1
        assert store.retention_of(node.key).name == "1h"
        clock.now += 10
        space.retain(tokens, "5m")  # a weaker class later: the hour stays
        space.retain(tokens, "in_memory")
        r = store.retention_of(node.key)
        assert (r.name, r.never_write, r.keep_until) == ("1h", False, clock.now - 10 + 3600)
        clock.now += 3590  # the hour nearly over: five minutes from now outlast it
        space.retain(tokens, "5m")
        assert store.retention_of(node.key).keep_until == clock.now + 300

        other = prompt_tokens(40, seed=2)
        _, node = stored(store, model, other, retention="in_memory")
        space.retain(other, "24h")  # a longer keep that may be written wins over in_memory
        r = store.retention_of(node.key)
        assert (r.name, r.never_write) == ("24h", False)


def test_a_split_node_keeps_its_retention_in_both_halves(tmp_path, model_of):
    model = model_of("llama")
    a = prompt_tokens(60, seed=50)
    b = mx.concatenate([a[:30], prompt_tokens(30, seed=51)])
    with PromptStore.open(tmp_path) as store:
        with_clock(store)
        space, _ = stored(store, model, a, retention="1h")
        stored(store, model, b)  # splits [0, 60) at 30
        upper, lower = store.index.lookup(space.namespace, a).path
        assert (upper.end, lower.end) == (30, 60)
        assert store.retention_of(upper.key).name == store.retention_of(lower.key).name == "1h"
        b_leaf = last_node(store, space, b)
        assert store.retention_of(b_leaf.key) is None


def test_marks_keep_each_prefix_by_its_own_class(tmp_path, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(60, seed=3)
    with PromptStore.open(tmp_path) as store:
        with_clock(store)
        space = store.bind(model, model_id="m")
        cache = fresh_cache(model)
        forward(model, cache, tokens[:30])
        space.insert(tokens[:30], cache)
        forward(model, cache, tokens[30:])
        space.insert(tokens, cache, retention=[(30, "1h"), (60, "5m")])
        head, tail = store.index.lookup(space.namespace, tokens).path
        assert store.retention_of(head.key).name == "1h"
        assert store.retention_of(tail.key).name == "5m"


def test_a_mark_inside_a_new_span_is_a_node_boundary(tmp_path, model_of):
    """One insert of a span with marks inside it (no earlier insert cut it there):
    each mark's end becomes a node's end, each node keeps its own class, and the
    prefix to each mark restores like a prefill."""
    model = model_of("llama")
    tokens = prompt_tokens(60, seed=4)
    with PromptStore.open(tmp_path) as store:
        with_clock(store)
        space = store.bind(model, model_id="m")
        cache = fresh_cache(model)
        forward(model, cache, tokens)
        space.insert(tokens, cache, retention=[(20, "24h"), (45, "1h"), (60, "5m")])
        path = store.index.lookup(space.namespace, tokens).path
        assert [n.end for n in path] == [20, 45, 60]
        assert [store.retention_of(n.key).name for n in path] == ["24h", "1h", "5m"]
        for n in (21, 46, 60):
            assert restores_like_a_prefill(model, space, tokens[:n])


def test_the_disk_budget_keeps_a_retained_leaf_across_a_restart_until_its_time(tmp_path, model_of):
    model = model_of("llama")
    kept_tokens, plain_tokens = prompt_tokens(40, seed=1), prompt_tokens(40, seed=2)
    with PromptStore.open(tmp_path, durability="sync") as store:
        clock = with_clock(store)
        # The plain prefix is newer and used twice: worth more, by use alone.
        _, kept = stored(store, model, kept_tokens, retention="1h")
        space, plain = stored(store, model, plain_tokens)
        space.fetch(plain_tokens)
        until = clock.now + 3600
    with PromptStore.open(tmp_path, hot_bytes=0) as store:  # another process: compact's, or a restart
        clock = with_clock(store)
        assert store.index.get(kept.key).record.keep_until == until
        one = store.index.get(kept.key).record.nbytes
        removed, _ = store.evict_cold(store.cold_bytes() - one)
        assert removed == 1 and store.index.get(plain.key) is None and store.index.get(kept.key) is not None
        assert store.metrics().retention.kept == 1  # its value alone would have sent it first
        clock.now = until + 1
        removed, _ = store.evict_cold(0)
        assert removed == 1 and files(tmp_path) == []


def test_retention_read_from_disk_keeps_a_node_in_memory(tmp_path, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(40, seed=1)
    with PromptStore.open(tmp_path, durability="sync") as store:
        clock = with_clock(store)
        _, kept = stored(store, model, tokens, retention="24h")
        start = clock.now
    with PromptStore.open(tmp_path) as store:
        clock = with_clock(store)
        clock.now = start + 3600
        space = store.bind(model, model_id="m")
        assert space.fetch(tokens).length == 39  # read from disk, held in memory again
        r = store.retention_of(kept.key)
        assert (r.name, r.keep_until) == ("24h", start + 86400)


def test_generate_keeps_the_conversation_as_asked(tmp_path):
    model, tokenizer = chat_model("llama"), demo_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Any books on tides?"}], add_generation_prompt=True
    )
    with PromptStore.open(tmp_path) as store:
        with_clock(store)
        space = store.bind(model, model_id="m")
        with pytest.raises(SettingsError, match="retention must be one of"):
            promptstore.generate(model, tokenizer, prompt, space=space, max_tokens=4, retention="2h")
        promptstore.generate(model, tokenizer, prompt, space=space, max_tokens=4, retention="1h")
        path = store.index.lookup(space.namespace, prompt).path
        assert path and all(store.retention_of(n.key).name == "1h" for n in path)


def test_classes_are_the_apis_words():
    assert set(CLASSES) == {"none", "5m", "1h", "24h", "in_memory"}
    assert CLASSES["in_memory"].never_write and not CLASSES["24h"].never_write
    custom = Retention("10m", 600.0)
    assert custom.applied(5.0).keep_until == 605.0 and not custom.applied(5.0).kept(605.0)


def test_admit_never_writes_what_is_kept_in_memory(tmp_path, model_of):
    """admit writes a reused node, and a conversation's at close; never one kept in_memory."""
    model = model_of("llama")
    root = tmp_path / "store"
    private = prompt_tokens(40, seed=1)
    with PromptStore.open(root, durability="admit") as store:
        with_clock(store)
        space, node = stored(store, model, private, retention="in_memory")
        assert space.fetch([*private, 7]).length == len(private)  # reused: admit would write it
        store.write_due()
        store.flush()
        assert files(root) == [] and store.index.get(node.key).record.file is None
    assert files(root) == []
