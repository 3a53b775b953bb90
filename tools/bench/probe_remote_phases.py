"""Where a remote hit's time goes, stage by stage, and a check that a node's
bytes in memory land as they should on this host's device.

First the check: one node file (Llama-3.2-1B-shaped, 2 layers, bfloat16, 4,096
tokens) verified from its bytes in memory by `load_bytes` through the reading
threads and through MLX's own copy, both compared with what was stored; then
one byte flipped, which must be a checksum miss. Then, on one server and on a
cluster of three primaries (started here, as bench_remote.py starts them), 10
remote hits of a 67 MB node (after 2 that warm up), with timers around each
stage: the values read off the sockets (each shard's read), each piece opened,
and the verification that turns the bytes into arrays (and in it, each array's
placement). It asserts the check and times the rest; medians are printed.

    python3 tools/bench/probe_remote_phases.py
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_remote as br  # noqa: E402
from common import time_calls  # noqa: E402

from promptstore.caches import make_prompt_cache, snapshot_prompt_cache  # noqa: E402
from promptstore.identity import NodeId  # noqa: E402
from promptstore.snapshots import ColdTier, blob, cold, reader  # noqa: E402
from promptstore.snapshots.remote import cluster, seal, tier  # noqa: E402
from promptstore.snapshots.remote.keys import BLOB_PREFIX  # noqa: E402
from promptstore.testing.models import llama_1b_shape  # noqa: E402
from promptstore.testing.redis_cluster import Cluster, RedisServer, missing  # noqa: E402

STAGES = [  # (module or class, function, label)
    (tier.RemoteTier, "_stream", "values read off the sockets"),
    (cluster, "_read_values", "one shard's values read"),
    (seal.Assembly, "_open", "one piece opened"),
    (tier.RemoteTier, "_verified", "the blob verified into arrays"),
    (blob, "_placed_bytes", "placed by the reading threads"),
    (blob, "_array_of", "one array copied by mx.array"),
]


def check(tmp: Path) -> None:
    model = llama_1b_shape(2, dtype=mx.bfloat16, vocab_size=512)
    cache = make_prompt_cache(model)
    for i, c in enumerate(cache):
        k = mx.random.normal((1, 8, 4096, 64), key=mx.random.key(i)).astype(mx.bfloat16)
        c.update_and_fetch(k, k * 2)
    snaps = snapshot_prompt_cache(cache, 0)
    tier_ = ColdTier(tmp / "cold")
    node = NodeId(os.urandom(16), os.urandom(16), 0, 4096)
    raw = memoryview(tier_.absolute(tier_.write(node, snaps).path).read_bytes())
    before = cold.PARALLEL_READS
    try:
        cold.PARALLEL_READS = True
        placed = blob.load_bytes(raw, node, "check")
        cold.PARALLEL_READS = False
        copied = blob.load_bytes(raw, node, "check")
        cold.PARALLEL_READS = True
        bad = bytearray(raw)
        bad[len(bad) // 2] ^= 1
        try:
            blob.load_bytes(memoryview(bytes(bad)), node, "check")
            caught = None
        except cold.ColdFileError as e:
            caught = e.reason
    finally:
        cold.PARALLEL_READS = before
    same = all(
        mx.array_equal(a.arrays[k], s.arrays[k]).item() and mx.array_equal(b.arrays[k], s.arrays[k]).item()
        for a, b, s in zip(placed, copied, snaps)
        for k in s.arrays
    )
    print(f"device {mx.default_device()}: placed by the reading threads == copied by MLX == stored: {same}; "
          f"a flipped byte: {caught}; reader failed: {reader.failed}")  # fmt: skip
    assert same and caught == "checksum" and reader.failed is None


def main() -> int:
    if (why := missing()) is not None:
        raise SystemExit(why)
    times: dict[str, list[float]] = collections.defaultdict(list)
    for owner, name, label in STAGES:
        time_calls(owner, name, label, times)
    tmp = Path(tempfile.mkdtemp(prefix="promptstore-phases-"))
    try:
        check(tmp)
        model = llama_1b_shape(2, dtype=mx.float32, vocab_size=512)
        prompt = mx.random.randint(0, 512, (8192 + 64,), key=mx.random.key(8))
        (tmp / "redis").mkdir()
        (tmp / "cluster").mkdir()
        server = RedisServer(tmp / "redis").start()
        shards = Cluster(tmp / "cluster", primaries=3, replicas=0).start()
        try:
            servers = [
                br.Server("single", server.url, redis.Redis(port=server.port), [server]),
                br.Server(
                    "cluster",
                    shards.url,
                    redis.RedisCluster(host="127.0.0.1", port=shards.servers[0].port),
                    shards.primaries(),
                ),  # fmt: skip
            ]
            for s in servers:
                br.publish_node(model, prompt, [8192], s, tmp / f"a-{s.name}", None)
                spread = [sum(1 for _ in p.client().scan_iter(match=BLOB_PREFIX + "*")) for p in s.primaries]
                hits = []
                for i in range(12):
                    seconds, _, _ = br.timed_hit(model, prompt, s.url, tmp / f"b{i}")
                    shutil.rmtree(tmp / f"b{i}")
                    if i == 1:  # connections, kernels and buffers warmed by the first two
                        times.clear()
                    elif i > 1:
                        hits.append(seconds)
                print(f"{s.name} (pieces by shard {spread}): remote hit {np.median(hits) * 1e3:.1f} ms, medians:")
                for label, v in times.items():
                    per_hit = sum(v) / len(hits) * 1e3
                    print(f"  {label:<34} {np.median(v) * 1e3:7.2f} ms each, {len(v) / len(hits):4.1f} a hit, "
                          f"{per_hit:7.2f} ms a hit")  # fmt: skip
                times.clear()
        finally:
            server.kill()
            shards.kill()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
