"""Two processes, two stores, one Redis Cluster: what one publishes, the other
restores, in both directions, with the logits of a full prefill; the prompts'
keys land on more than one shard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
import redis

import promptstore
from promptstore.snapshots.remote import CHUNK

from ..conftest import prompt_tokens
from .helpers import assert_faithful, publish

PROCESS_SECONDS = 120.0  # a stuck child fails the test instead of hanging it

# Store B in a process of its own: fetch the prompt, compare with a full prefill
# of the same model (weights fixed by the seed), publish a longer prompt; print
# what it saw as one line of JSON.
CHILD = """
import json, sys
import mlx.core as mx
import pytest
import redis
import promptstore
from promptstore.testing.models import tiny_model

path, url, prefix, n, chunk = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
tokens = mx.random.randint(0, 256, (n,), key=mx.random.key(3))
model = tiny_model("llama")
with promptstore.PromptStore.open(path, remote_url=url) as store:
    space = store.bind(model, model_id="m")
    hit = space.fetch(tokens)
    got = model(tokens[hit.length :][None], cache=hit.cache)[:, -1, :]
    want = model(tokens[None], cache=space.new_cache())[:, -1, :]
    error = float(mx.abs(got - want).max())
    length, remote = hit.length, hit.remote_tokens
    longer = mx.random.randint(0, 256, (n + 2 * chunk,), key=mx.random.key(4))
    cache = space.new_cache()
    model(longer[None], cache=cache)
    space.insert(longer, cache)
print(json.dumps({"length": length, "remote": remote, "error": error, "published": dict(store.remote.counts)}))
"""


def test_two_processes_share_prefixes_across_the_shards(tmp_path, redis_cluster, model_of):
    model = model_of("llama")
    n, prefix = 3 * CHUNK + 60, 3 * CHUNK + 40
    tokens = prompt_tokens(n, seed=3)
    assert publish(tmp_path / "a", redis_cluster.url, model, tokens[:prefix])["remote_published"] == 1

    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "b"), redis_cluster.url, str(prefix), str(n), str(CHUNK)],
        capture_output=True,
        text=True,
        timeout=PROCESS_SECONDS,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.returncode == 0, child.stderr[-3000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert (seen["length"], seen["remote"]) == (prefix, prefix)
    assert seen["error"] <= 1e-4
    assert seen["published"].get("remote_published", 0) >= 1

    # Back in this process, a third store restores what the other process published.
    longer = mx.random.randint(0, 256, (n + 2 * CHUNK,), key=mx.random.key(4))
    with promptstore.PromptStore.open(tmp_path / "c", remote_url=redis_cluster.url) as c:
        hit = c.bind(model, model_id="m").fetch(longer)
        assert hit.length >= n and hit.remote_tokens == hit.length
        assert_faithful(model, hit, longer)

    shards = [node for node in redis_cluster.primaries() if node.client().dbsize() > 0]
    assert len(shards) > 1, "every key of both stores landed on one shard"


def test_the_cluster_of_make_redis_cluster_starts_answers_and_goes(tmp_path):
    from promptstore.testing.redis_cluster import missing

    if missing() is not None:
        pytest.skip(missing())
    run = subprocess.run(
        [sys.executable, "-m", "promptstore.testing.redis_cluster", "--seconds", "0.5"],
        capture_output=True,
        text=True,
        timeout=PROCESS_SECONDS,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    url = run.stdout.split("remote_url=")[1].split()[0]
    assert url.startswith("redis+cluster://127.0.0.1:") and len(url.split(",")) == 6
    assert run.stdout.strip().endswith("replicas: stopped")
    port = int(url.split(",")[0].rsplit(":", 1)[1])
    with pytest.raises(redis.ConnectionError):  # torn down: nothing answers there any more
        redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1).ping()
