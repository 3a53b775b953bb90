"""A Redis Cluster faulted under traffic: store A inserts (and publishes) a new
prompt and store B fetches it, in a loop, while a slot range is resharded, a
shard stops answering, or a shard is full under noeviction. Every hit equals a
full prefill; a fault costs misses or counted publish failures, never an
exception to the caller, and hits from the cluster resume once it is over."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx

import promptstore
from promptstore.snapshots.remote import CHUNK

from ..conftest import forward, fresh_cache, prompt_tokens
from .conftest import CLUSTER_SECONDS

HANG_GUARD = 30.0  # seconds: only a missing timeout makes one fetch or publish take this long
TRAFFIC_SECONDS = 20.0  # the longest the loop may run after a fault for hits to come back
PREFIX = CHUNK + 40  # what A inserts of each prompt: a blob and two records (grid point, end)
# Short waits where a shard answers nothing; where every node answers, long ones, so
# that a busy machine's slow reply is not taken for the fault under test.
PAUSED = {"remote_timeout": 0.2, "remote_close_seconds": 2.0}
ANSWERING = {"remote_timeout": 2.0, "remote_close_seconds": 10.0}


@dataclass
class Step:
    at: float  # when B's fetch started
    published: bool  # A's publish of the prompt failed on no call
    remote: bool  # B's fetch was a hit from the cluster
    length: int  # B's hit
    seconds: float  # B's fetch


@dataclass
class Traffic:
    """A publishes a new prompt and B fetches it; every hit is checked against a full prefill."""

    model: object
    a: promptstore.PromptStore
    b: promptstore.PromptStore
    steps: list[Step] = field(default_factory=list)
    prompts: list = field(default_factory=list)
    wrong: int = 0

    def __post_init__(self):
        self.a_space = self.a.bind(self.model, model_id="m")
        self.b_space = self.b.bind(self.model, model_id="m")

    def step(self) -> Step:
        tokens = prompt_tokens(PREFIX + 20, seed=900 + len(self.prompts))
        cache = fresh_cache(self.model)
        forward(self.model, cache, tokens[:PREFIX])
        failed = self.a.remote.counts["remote_publish_failed"]
        self.a_space.insert(tokens[:PREFIX], cache)
        self.a.flush()
        published = self.a.remote.counts["remote_publish_failed"] == failed
        at = time.monotonic()
        hit = self.b_space.fetch(tokens)
        step = Step(at, published, hit.remote_tokens > 0, hit.length, time.monotonic() - at)
        self.check(hit, tokens)
        self.prompts.append((tokens, published))
        self.steps.append(step)
        return step

    def check(self, hit, tokens) -> None:
        if hit.length:
            want = forward(self.model, fresh_cache(self.model), tokens)
            got = forward(self.model, hit.cache, tokens[hit.length :])
            self.wrong += not mx.allclose(got, want, atol=1e-4, rtol=0).item()

    def until_hits(self, since: float, hits: int = 3) -> float | None:
        """Steps until B has `hits` remote hits fetched after `since`; the first one's time."""
        deadline = time.monotonic() + TRAFFIC_SECONDS
        while time.monotonic() < deadline and self.remote_hits(since) < hits:
            self.step()
        return next((s.at for s in self.steps if s.at > since and s.remote), None)

    def remote_hits(self, since: float, until: float = float("inf")) -> int:
        return sum(s.remote for s in self.steps if since < s.at < until)

    def misses(self, since: float, until: float = float("inf")) -> int:
        return sum(not s.length for s in self.steps if since < s.at < until)


def _stores(tmp_path, cluster, settings):
    settings = {"remote_url": cluster.url, **settings}
    return (
        promptstore.PromptStore.open(tmp_path / "a", **settings),
        promptstore.PromptStore.open(tmp_path / "b", **settings),
    )


def _all_published_are_hits(tmp_path, cluster, model, prompts) -> None:
    """A fresh store C restores every prompt whose publish succeeded, faithfully."""
    with promptstore.PromptStore.open(tmp_path / "c", remote_url=cluster.url, **ANSWERING) as c:
        traffic = Traffic(model, c, c)
        for tokens, published in prompts:
            if published:
                hit = traffic.b_space.fetch(tokens)
                # (A prompt may share its first tokens with one fetched before: those hit locally.)
                assert hit.length == PREFIX and hit.remote_tokens > 0, f"a published prompt is lost: {hit}"
                traffic.check(hit, tokens)
        assert traffic.wrong == 0


def _keys_in(client, slots: range) -> int:
    return sum(int(client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)) for slot in slots)


def _table_reads(cluster) -> int:
    """CLUSTER SLOTS calls answered by every node: clients re-reading the slot table."""
    stats = [s.client().info("commandstats") for s in cluster.alive()]
    return sum(stat.get("cmdstat_cluster|slots", {}).get("calls", 0) for stat in stats)


# --- resharding --------------------------------------------------------------------------


def test_a_slot_range_resharded_under_traffic_loses_nothing(tmp_path, own_redis_cluster, model_of):
    """redis-cli moves most of a primary's slots (and their keys) to another while
    the loop runs: every hit is faithful, B follows MOVED to the new owner, and
    everything published before or during the move is still there after it."""
    cluster, model = own_redis_cluster, model_of("llama")
    source, target = cluster.primaries()[:2]
    moved, owned = cluster.slots_of(source) * 3 // 4, cluster.slots_of(target)
    a, b = _stores(tmp_path, cluster, ANSWERING)
    with a, b:
        traffic = Traffic(model, a, b)
        for _ in range(6):  # keys in the slots to move, for MIGRATE to carry
            traffic.step()
        reshard = threading.Thread(target=cluster.reshard, args=(source, target, moved))
        started = time.monotonic()
        reshard.start()
        while reshard.is_alive() and time.monotonic() - started < TRAFFIC_SECONDS:
            traffic.step()
        reshard.join(timeout=CLUSTER_SECONDS)
        done = time.monotonic()
        assert cluster.slots_of(target) == owned + moved, "the reshard did not finish"
        resumed = traffic.until_hits(done)
        during = [s for s in traffic.steps if started < s.at < done]
    assert traffic.wrong == 0, f"{traffic.wrong} hits differ from the prefill"
    assert during and all(s.remote for s in during), "a fetch missed while the slots moved"
    assert resumed is not None, f"no hit from the cluster within {TRAFFIC_SECONDS} s after the reshard"
    assert all(s.published for s in traffic.steps), "a publish failed while slots moved"
    _all_published_are_hits(tmp_path, cluster, model, traffic.prompts)


def _migrating(cluster, source, target, slots: range) -> None:
    """Mark `slots` IMPORTING on target and MIGRATING on source, as the first half of a move."""
    target_id, source_id = cluster.node_id(target), cluster.node_id(source)
    for node, state, other in ((target, "IMPORTING", source_id), (source, "MIGRATING", target_id)):
        pipe = node.client().pipeline(transaction=False)
        for slot in slots:
            pipe.execute_command("CLUSTER", "SETSLOT", slot, state, other)
        pipe.execute()


def _migrate_keys(source, target, slots: range) -> int:
    """MIGRATE every key of `slots` from source to target; returns how many."""
    client, moved = source.client(), 0
    for slot in slots:
        keys = client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if keys:
            client.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
    return moved


def _assign(cluster, target, slots: range) -> None:
    """SETSLOT NODE on the target, then on every other primary: the move's second half.
    (A primary left without slots turns replica of the target as soon as it hears
    of the move, and then refuses SETSLOT: the target's claim reaches it anyway.)"""
    target_id = cluster.node_id(target)
    for node in [target] + [p for p in cluster.primaries() if p is not target]:
        pipe = node.client().pipeline(transaction=False)
        for slot in slots:
            pipe.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        replies = pipe.execute(raise_on_error=node is target)
        refused = {str(r) for r in replies if isinstance(r, Exception)}
        assert refused <= {"Please use SETSLOT only with masters."}, refused


def test_slots_held_half_migrated_are_followed_by_ask(tmp_path, own_redis_cluster, model_of):
    """A primary's whole slot range held MIGRATING (its keys not yet moved): new
    keys go to the importing node after ASK, old ones are read where they are, a
    MIGRATE by hand under traffic moves them, then the slots change owner (MOVED)."""
    cluster, model = own_redis_cluster, model_of("llama")
    source, target = cluster.primaries()[:2]
    shards = source.client().execute_command("CLUSTER", "SLOTS")
    start, end = next((int(s), int(e)) for s, e, owner, *_ in shards if int(owner[1]) == source.port)
    slots, owned = range(start, end + 1), cluster.slots_of(target)
    a, b = _stores(tmp_path, cluster, ANSWERING)
    with a, b:
        traffic = Traffic(model, a, b)
        for _ in range(6):
            traffic.step()
        before = _keys_in(source.client(), slots)
        _migrating(cluster, source, target, slots)
        half = time.monotonic()
        for _ in range(8):
            traffic.step()
        asked = _keys_in(target.client(), slots)  # only ASK puts keys there before the MIGRATE
        migrated = []
        mover = threading.Thread(target=lambda: migrated.append(_migrate_keys(source, target, slots)))
        mover.start()
        while mover.is_alive() and time.monotonic() - half < TRAFFIC_SECONDS:
            traffic.step()
        mover.join(timeout=CLUSTER_SECONDS)
        _assign(cluster, target, slots)
        cluster.wait_agreed()
        assigned = time.monotonic()
        for _ in range(6):
            traffic.step()
        assert migrated and cluster.slots_of(target) == owned + len(slots)
    assert before > 0 and asked > 0, f"keys in the moving slots: {before} before, {asked} sent after ASK"
    assert traffic.wrong == 0, f"{traffic.wrong} hits differ from the prefill"
    assert all(s.published for s in traffic.steps), "a publish failed while slots moved"
    assert traffic.misses(half) == 0, "a fetch missed while its slots were half migrated or just moved"
    assert traffic.remote_hits(assigned) == 6
    _all_published_are_hits(tmp_path, cluster, model, traffic.prompts)


# --- a shard that answers nothing ---------------------------------------------------------


def test_a_shard_paused_costs_bounded_misses_and_local_hits_go_on(tmp_path, own_redis_cluster, model_of):
    """A shard's primary and replica stopped (SIGSTOP) past the node timeout, so the
    cluster also says CLUSTERDOWN: B misses, each fetch bounded; A still hits its
    own prompts and B those it already pulled, locally; after SIGCONT hits come
    back from the cluster."""
    cluster, model = own_redis_cluster, model_of("llama")
    primary = cluster.primaries()[0]
    shard = [primary, cluster.replica_of(primary)]
    a, b = _stores(tmp_path, cluster, PAUSED)
    with a, b:
        traffic = Traffic(model, a, b)
        for _ in range(3):
            assert traffic.step().remote
        pulled = traffic.prompts[0][0]
        local = []  # (A's own prompt, B's earlier remote hit) as local hits while paused
        for s in shard:
            s.proc.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        try:
            while time.monotonic() - paused < 3.0:  # past the 2 s node timeout
                traffic.step()
                own = traffic.prompts[-1][0]
                hits = (traffic.a_space.fetch(own), traffic.b_space.fetch(pulled))
                for hit, tokens in zip(hits, (own, pulled)):
                    traffic.check(hit, tokens)
                local.append(tuple(h.length for h in hits))
        finally:
            for s in shard:
                s.proc.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        during = [s for s in traffic.steps if paused < s.at < resumed_at]
        resumed = traffic.until_hits(resumed_at)
        b_counts = dict(b.remote.counts)
    assert traffic.wrong == 0, f"{traffic.wrong} hits differ from the prefill"
    assert local and all(lengths == (PREFIX, PREFIX) for lengths in local), f"local hits while paused: {local}"
    assert traffic.misses(paused, resumed_at) > 0, "the pause cost no miss: the shard served nothing?"
    assert max(s.seconds for s in during) < HANG_GUARD
    assert b_counts.get("remote_down", 0) > 0
    assert resumed is not None, f"no hit from the cluster within {TRAFFIC_SECONDS} s after SIGCONT"


# --- a shard that refuses writes ----------------------------------------------------------


def test_a_full_shard_under_noeviction_refuses_publishes_and_the_rest_works(tmp_path, own_redis_cluster, model_of):
    """One primary past its maxmemory under noeviction: a publish with a key on it
    fails (counted, reported as refused; its blob may have landed with some of its
    records, a shorter hit), one whose keys all fall elsewhere is a hit; what the
    full shard already holds is still served; nothing is wrong, nothing pauses."""
    cluster, model = own_redis_cluster, model_of("llama")
    full = cluster.primaries()[0]
    a, b = _stores(tmp_path, cluster, ANSWERING)
    with a, b:
        traffic = Traffic(model, a, b)
        for _ in range(4):
            assert traffic.step().remote
        before = list(traffic.prompts)
        client = full.client()
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", client.info("memory")["used_memory"] + (64 << 10))
        filled, reads = time.monotonic(), _table_reads(cluster)
        for _ in range(20):
            traffic.step()
        reads = _table_reads(cluster) - reads
        after = [s for s in traffic.steps if s.at > filled]
        a_counts, a_reasons = dict(a.remote.counts), {r.reason for r in a.reports}
        b_down = b.remote.counts.get("remote_down", 0)
    refused = int(client.info("errorstats").get("errorstat_OOM", {}).get("count", 0))
    assert traffic.wrong == 0, f"{traffic.wrong} hits differ from the prefill"
    assert refused > 0, "the shard never refused a write"
    failed = sum(not s.published for s in after)
    assert failed > 0 and a_counts["remote_publish_failed"] >= failed and a_reasons == {"remote_refused"}
    assert a_counts["remote_refused"] == a_counts["remote_publish_failed"], "each failed publish is counted"
    assert a_counts.get("remote_down", 0) == 0 and b_down == 0, "a refusal is not an outage"
    assert reads == 0, f"a refusal made the clients re-read the slot table {reads} times"
    assert any(s.published and s.remote for s in after), "no prompt published to the other shards was a hit"
    assert all(s.remote for s in after if s.published), "a prompt published in full was missed"
    _all_published_are_hits(tmp_path, cluster, model, before)
