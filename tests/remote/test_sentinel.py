"""Stores sharing prefixes through a primary that real Redis Sentinels watch (a
replica beside it, three Sentinels): restored with fidelity; the primary killed,
or failed over alive, under traffic costs misses, never a wrong state, and hits
resume on the promoted replica; no Sentinel at all is a bounded miss."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

import promptstore
from promptstore.config import Settings
from promptstore.errors import SettingsError
from promptstore.snapshots.remote import CHUNK
from promptstore.snapshots.remote.sentinel import SentinelURL
from promptstore.testing.models import FAMILIES
from promptstore.testing.redis_sentinel import FAILOVER_SECONDS, missing

from ..conftest import prompt_tokens
from .conftest import free_port
from .helpers import assert_faithful, publish
from .test_cluster_faults import PREFIX, Traffic

HANG_GUARD = 30.0  # seconds: only a missing timeout makes one fetch take this long
TRAFFIC_SECONDS = 20.0  # the longest the loop may run after a failover for hits to come back
SETTINGS = {"remote_timeout": 0.2, "remote_close_seconds": 2.0}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_inserted_by_a_is_restored_by_b(tmp_path, redis_sentinels, model_of, family):
    model = model_of(family)
    tokens = prompt_tokens(2 * CHUNK + 60, seed=3)
    prefix = 2 * CHUNK + 40
    assert publish(tmp_path / "a", redis_sentinels.url, model, tokens[:prefix])["remote_published"] == 1
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_sentinels.url) as b:
        space = b.bind(model, model_id="m")
        hit = space.fetch(tokens)
        assert (hit.length, hit.remote_tokens) == (prefix, prefix)
        assert_faithful(model, hit, tokens)
    # What the store wrote is on the primary the Sentinels name, and on its replica.
    redis_sentinels.wait_synced()
    primary = redis_sentinels.primary()
    replica = next(s for s in redis_sentinels.alive() if s is not primary)
    assert primary.client().dbsize() > 0 and replica.client().dbsize() == primary.client().dbsize()


def _stores(tmp_path, group):
    settings = {"remote_url": group.url, **SETTINGS}
    return (
        promptstore.PromptStore.open(tmp_path / "a", **settings),
        promptstore.PromptStore.open(tmp_path / "b", **settings),
    )


def _hits_of_a_fresh_store(tmp_path, group, model, prompts) -> list[bool]:
    """A fresh store C fetches every prompt A published: each is a faithful hit or a
    miss (a write the old primary took and the promotion lost); whether each hit."""
    with promptstore.PromptStore.open(tmp_path / "c", remote_url=group.url, **SETTINGS) as c:
        traffic = Traffic(model, c, c)
        hits = []
        for tokens, _ in prompts:
            hit = traffic.b_space.fetch(tokens)
            traffic.check(hit, tokens)
            hits.append(hit.length == PREFIX and hit.remote_tokens > 0)
        assert traffic.wrong == 0
    return hits


def _promoted(group, lost) -> bool:
    """Whether the Sentinels agree on a primary other than `lost` (False mid-failover)."""
    try:
        return group.primary() is not lost
    except (LookupError, redis.RedisError):
        return False


def test_the_primary_killed_mid_traffic_fails_over_and_costs_misses_never_a_wrong_state(
    tmp_path, own_sentinels, model_of
):
    """A publishes a new prompt and B fetches it, in a loop; the primary is SIGKILLed
    under it. Every hit equals the prefill, the Sentinels promote the replica, both
    stores follow it (B's hits resume) without being reopened."""
    group, model = own_sentinels, model_of("llama")
    victim = group.primary()
    a, b = _stores(tmp_path, group)
    with a, b:
        traffic = Traffic(model, a, b)
        for _ in range(3):
            assert traffic.step().remote
        group.wait_synced()
        killer = threading.Timer(0.3, victim.kill)
        killed = time.monotonic()
        killer.start()
        promoted = None
        while promoted is None and time.monotonic() - killed < FAILOVER_SECONDS:
            traffic.step()
            if victim.proc.poll() is not None and _promoted(group, victim):
                promoted = time.monotonic()
        killer.join()
        assert promoted is not None, f"the replica was not promoted within {FAILOVER_SECONDS} s"
        during = [s for s in traffic.steps if killed < s.at < promoted]
        resumed = traffic.until_hits(promoted)
        b_counts = dict(b.remote.counts)
    assert traffic.wrong == 0, f"{traffic.wrong} hits differ from the prefill"
    assert traffic.misses(killed, promoted) > 0, "the kill cost no miss: the victim served nothing?"
    assert max(s.seconds for s in during) < HANG_GUARD
    assert b_counts.get("remote_down", 0) > 0
    assert resumed is not None, f"no hit from the promoted replica within {TRAFFIC_SECONDS} s"
    # Everything published before the kill had reached the replica (waited for above).
    assert all(_hits_of_a_fresh_store(tmp_path, group, model, traffic.prompts)[:3])


def test_a_failover_with_the_primary_alive_moves_every_write_to_the_new_one(tmp_path, own_sentinels, model_of):
    """SENTINEL FAILOVER promotes the replica while the old primary still answers
    (the Sentinels demote it about ten seconds later): the stores leave it within a
    second, so what A publishes after that lands on the new primary, where B and a
    fresh store C find it; nothing is wrong."""
    group, model = own_sentinels, model_of("llama")
    a, b = _stores(tmp_path, group)
    with a, b:
        traffic = Traffic(model, a, b)
        for _ in range(2):
            assert traffic.step().remote
        group.failover()
        switched = time.monotonic()
        time.sleep(1.2)  # past the stores' next question to the Sentinels
        after = len(traffic.prompts)
        resumed = traffic.until_hits(time.monotonic())
    assert traffic.wrong == 0, f"{traffic.wrong} hits differ from the prefill"
    assert resumed is not None, f"no hit after the failover within {TRAFFIC_SECONDS} s"
    assert len(traffic.prompts) > after and all(published for _, published in traffic.prompts[after:])
    assert time.monotonic() - switched < TRAFFIC_SECONDS + HANG_GUARD
    # C asks the Sentinels afresh: it reads the new primary, which holds every write after the switch.
    assert all(_hits_of_a_fresh_store(tmp_path, group, model, traffic.prompts)[after:])


def test_sentinels_that_answer_nothing_slow_no_call_while_the_primary_serves(tmp_path, own_sentinels, model_of):
    """Every Sentinel stopped (SIGSTOP: connections open, nothing answers) while the
    primary serves: A publishes and B hits as before, no call waiting for the
    Sentinels (only the stores' following threads do, a timeout per Sentinel)."""
    group, model = own_sentinels, model_of("llama")
    settings = {"remote_url": group.url, "remote_timeout": 1.0, "remote_close_seconds": 5.0}
    with (
        promptstore.PromptStore.open(tmp_path / "a", **settings) as a,
        promptstore.PromptStore.open(tmp_path / "b", **settings) as b,
    ):
        traffic = Traffic(model, a, b)
        assert traffic.step().remote
        for sentinel in group.sentinels:
            sentinel.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            while time.monotonic() - stopped < 4.0:  # past the followers' asking (3 Sentinels x 1 s)
                traffic.step()
        finally:
            for sentinel in group.sentinels:
                sentinel.proc.send_signal(signal.SIGCONT)
    during = [s for s in traffic.steps if s.at > stopped]
    assert traffic.wrong == 0
    assert during and all(s.remote for s in during), "a hit was lost while the Sentinels were stopped"
    # A call that waited for one Sentinel would take a whole remote_timeout (1 s).
    assert max(s.seconds for s in during) < 0.9, max(s.seconds for s in during)
    assert all(published for _, published in traffic.prompts)


def test_no_sentinel_answering_costs_a_bounded_miss_and_local_tiers_work(tmp_path, model_of):
    """Sentinel ports nobody listens on: the store opens, inserts and serves locally;
    every remote call is a reported miss after a bounded wait."""
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=8)
    url = "redis+sentinel://" + ",".join(f"127.0.0.1:{free_port()}" for _ in range(3)) + "/promptstore"
    counts = publish(tmp_path / "a", url, model, tokens[:280], **SETTINGS)
    assert counts["remote_publish_failed"] == 1
    with promptstore.PromptStore.open(tmp_path / "a", remote_url=url, **SETTINGS) as a:
        hit = a.bind(model, model_id="m").fetch(tokens)
        assert hit.length == 280
        assert_faithful(model, hit, tokens)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=url, **SETTINGS) as b:
        started = time.monotonic()
        assert b.bind(model, model_id="m").fetch(tokens).length == 0
        assert b.remote.counts.get("remote_down", 0) > 0
        assert time.monotonic() - started < HANG_GUARD


# --- the URL ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, problem",
    [
        ("redis+sentinel://127.0.0.1:26379", "name the service"),
        ("redis+sentinel://127.0.0.1:26379/", "name the service"),
        ("redis+sentinel://127.0.0.1:26379/my service", "is not a service name"),
        ("redis+sentinel://127.0.0.1:26379/mymaster/x", "is not a database number"),
        ("redis+sentinel://127.0.0.1:26379,,127.0.0.1:26380/m", "is not host:port"),
        ("redis+sentinel://127.0.0.1:70000/m", "is not a port"),
        ("redis+sentinel://127.0.0.1:26379/m#x", "no #fragment"),
        ("redis+sentinel://127.0.0.1:26379/m?ssl_ca_certs=ca.pem", "unknown option 'ssl_ca_certs'"),
        ("rediss+sentinel://127.0.0.1:26379/m?timeout=3", "unknown option 'timeout'"),
        ("redis+sentinal://127.0.0.1:26379/m", "redis+sentinel://"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_and_changes_nothing(tmp_path, url, problem):
    with pytest.raises(SettingsError, match="remote_url") as e:
        promptstore.PromptStore.open(tmp_path / "s", remote_url=url)
    assert problem in str(e.value)
    assert not (tmp_path / "s").exists()


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_credentials():
    url = "rediss+sentinel://user:p%40ss@10.0.0.1:26379,[::1]:26380/cache/2?sentinel_password=s3&ssl_cert_reqs=none"
    assert Settings.from_env(remote_url=url).remote_url == url
    want = SentinelURL(
        (("10.0.0.1", 26379), ("::1", 26380)),
        "cache",
        2,
        True,
        "user",
        "p@ss",
        None,
        "s3",
        (("ssl_cert_reqs", "none"),),
    )
    assert SentinelURL.parse(url) == want
    assert SentinelURL.parse("redis+sentinel://h:1/m") == SentinelURL((("h", 1),), "m")


@pytest.mark.parametrize(
    "url", ["redis+sentinel://user:hunter2@host:port/m", "redis+sentinel://host:1/m?sentinel_password=hunter2&x=1"]
)
def test_the_passwords_of_a_malformed_url_are_not_repeated(tmp_path, url):
    with pytest.raises(SettingsError) as e:
        promptstore.PromptStore.open(tmp_path / "s", remote_url=url)
    assert "hunter2" not in str(e.value) and "***" in str(e.value)


def test_the_group_of_make_redis_sentinel_starts_answers_and_goes(tmp_path):
    if missing() is not None:
        pytest.skip(missing())
    run = subprocess.run(
        [sys.executable, "-m", "promptstore.testing.redis_sentinel", "--seconds", "0.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    url = run.stdout.split("remote_url=")[1].split()[0]
    assert url.startswith("redis+sentinel://127.0.0.1:") and url.endswith("/promptstore")
    assert len(SentinelURL.parse(url).sentinels) == 3
    assert run.stdout.strip().endswith("Sentinels: stopped")
    port = SentinelURL.parse(url).sentinels[0][1]
    with pytest.raises(redis.ConnectionError):  # torn down: nothing answers there any more
        redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1).ping()
