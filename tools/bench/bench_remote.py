"""The remote tier: a hit from the shared server against its ceilings (a raw
redis-py GET of the same bytes, an MGET of its pieces, the local cold hit of the
same node), on one server and on a Redis Cluster of three primaries; replica B's
time to first token on a prompt whose long prefix replica A stored, against B
recomputing it; round trips per lookup against prompt length; publish throughput.

Real redis-server processes run on free loopback ports (a cluster is formed by
redis-cli, as the tests form one). Network latency is injected by a small asyncio
TCP proxy on loopback that holds every chunk the client sends for `--latency-ms`
before forwarding it (so each round trip costs that much more; replies pass at
once, at loopback bandwidth). Sides alternate within each run on a shared, noisy
machine: medians and ratios are quoted. Recompute is float32; run it with OpenBLAS
preloaded on Linux (`make openblas`), as the script warns otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import blas_info, blas_warning, print_goals, summarize, write_results  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.caches import make_prompt_cache  # noqa: E402
from promptstore.snapshots.remote import CHUNK  # noqa: E402
from promptstore.snapshots.remote.keys import BLOB_PREFIX  # noqa: E402
from promptstore.testing.models import llama_1b_shape, tiny_model  # noqa: E402
from promptstore.testing.redis_cluster import Cluster, RedisServer, client_tls, free_port, missing  # noqa: E402
from promptstore.testing.tls import make_certificates  # noqa: E402

PREFILL_STEP = 512


# --- a delaying proxy ------------------------------------------------------------------


class DelayProxy:
    """127.0.0.1:port -> the server, each client-to-server chunk held `delay` seconds."""

    def __init__(self, upstream: int, delay: float):
        self.upstream, self.delay, self.port = upstream, delay, free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        if not ready.wait(10):
            raise SystemExit("the delay proxy did not start")

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    async def _client(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        await asyncio.gather(self._pump(reader, up_writer, self.delay), self._pump(up_reader, writer, 0.0))

    @staticmethod
    async def _pump(reader, writer, delay: float) -> None:
        try:
            while data := await reader.read(1 << 20):
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


# --- TTFT ------------------------------------------------------------------------------


def prefill(model, cache, tokens: mx.array) -> mx.array:
    """Last-position logits after feeding `tokens` in prefill steps."""
    logits = None
    for i in range(0, len(tokens), PREFILL_STEP):
        logits = model(tokens[None, i : i + PREFILL_STEP], cache=cache)[:, -1, :]
        mx.eval(logits)
    return logits


def ttft_recompute(model, prompt: mx.array) -> float:
    t0 = time.perf_counter()
    prefill(model, make_prompt_cache(model), prompt)
    return time.perf_counter() - t0


def ttft_remote(model, prompt: mx.array, url: str, path: Path, prefix: int) -> tuple[float, int, int]:
    """A fresh replica B: fetch (the remote hit, kept locally) then prefill the rest."""
    with PromptStore.open(path, remote_url=url, remote_timeout=5.0) as store:
        space = store.bind(model, model_id="bench")
        t0 = time.perf_counter()
        hit = space.fetch(prompt)
        prefill(model, hit.cache, prompt[hit.length :])
        dt = time.perf_counter() - t0
        trips = store.remote.last_round_trips
    shutil.rmtree(path, ignore_errors=True)
    if hit.remote_tokens != prefix:
        raise SystemExit(f"replica B restored {hit.remote_tokens} remote tokens, expected {prefix}")
    return dt, trips, hit.length


def store_on_a(model, prompt: mx.array, prefix: int, url: str, path: Path) -> dict:
    """Replica A prefills and inserts the prefix; close waits for the publish."""
    with PromptStore.open(path, remote_url=url) as store:
        space = store.bind(model, model_id="bench")
        cache = make_prompt_cache(model)
        prefill(model, cache, prompt[:prefix])
        space.insert(prompt[:prefix], cache)
        remote = store.remote
    return dict(remote.counts)


# --- the fetch alone, against a local cold hit ------------------------------------------


def filled_cache(model, tokens: int) -> list:
    """A cache holding `tokens` positions of random KV of the model's shapes (what a
    fetch moves does not depend on the values; prefilling 8k tokens on CPU takes minutes)."""
    cache = make_prompt_cache(model)
    args = model.args
    shape = (1, args.num_key_value_heads, tokens, args.head_dim)
    for i, c in enumerate(cache):
        k1, k2 = mx.random.split(mx.random.key(i))
        c.update_and_fetch(mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2))
    mx.eval([a for c in cache for a in c.state])
    return cache


GOALS = {  # from the issue: what a remote hit should cost against its ceilings
    "remote_over_local_cold": 1.5,  # at most
    "throughput_over_raw_get": 0.7,  # at least
    "cluster_over_single": 1.2,  # at most
}


class Server:
    """Where the blobs live (one server or a cluster), as the store and plain redis-py reach it."""

    def __init__(self, name: str, url: str, client, primaries: list):
        self.name, self.url, self.client, self.primaries = name, url, client, primaries

    def blob_keys(self) -> list[bytes]:
        """Every blob piece on the server (the bench publishes one node at a time)."""
        return sorted(k for p in self.primaries for k in p.client().scan_iter(match=BLOB_PREFIX + "*", count=1000))

    def flushall(self) -> None:
        for p in self.primaries:
            p.client().flushall()


def single_server(tmp: Path, tls=None) -> tuple[RedisServer, Server]:
    (tmp / "redis").mkdir(parents=True)
    server = RedisServer(tmp / "redis", tls=tls).start()
    return server, Server(
        "single", server.url, redis.Redis(host="127.0.0.1", port=server.port, **client_tls(tls)), [server]
    )


def cluster_server(tmp: Path, tls=None) -> tuple[Cluster, Server]:
    """Three primaries, no replicas (a replica doubles every write on a small machine)."""
    (tmp / "cluster").mkdir(parents=True)
    cluster = Cluster(tmp / "cluster", primaries=3, replicas=0, tls=tls).start()
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.servers[0].port, **client_tls(tls))
    return cluster, Server("cluster", cluster.url, client, cluster.primaries())


def publish_node(model, prompt: mx.array, ends: list[int], server: Server, path: Path, piece_bytes) -> None:
    """Replica A stores prompt[:end] for each end (a node each, KV filled directly) and
    publishes them; close waits for the publish."""
    with PromptStore.open(path, remote_url=server.url) as store:
        if piece_bytes:
            store.remote.piece_bytes = piece_bytes
        space = store.bind(model, model_id="bench")
        for end in ends:
            space.insert(prompt[:end], filled_cache(model, end))


def timed_hit(model, prompt: mx.array, url: str | None, path: Path, **settings):
    """(seconds, hit, what the remote tier fetched) of one fetch by a store at `path`,
    the restored cache evaluated. Fetched: values and bytes (its counters), and the
    seconds its blobs took to arrive and be verified (the fetch inside the hit).
    The store has spoken to the server before (a PING: connections open, a cluster's
    slot table read), as a serving process has."""
    with PromptStore.open(path, remote_url=url, remote_timeout=5.0, **settings) as store:
        space = store.bind(model, model_id="bench")
        if url:
            store.remote.client.ping()
        before = dict(store.remote.counts) if url else {}
        t0 = time.perf_counter()
        hit = space.fetch(prompt)
        mx.eval([a for c in hit.cache for a in c.state])
        dt = time.perf_counter() - t0
        after = dict(store.remote.counts) if url else {}
        fetch = {k: after[k] - before.get(k, 0) for k in after if k.startswith("remote_fetched")}
        if url:
            fetch["seconds"] = store.remote.last_fetch[1]
    return dt, hit, fetch


def fetch_ceilings(args, model, servers: list[Server], tmp: Path) -> dict:
    """B's remote hit of A's node from each server, alternating with its ceilings: a
    raw redis-py GET of the same bytes as one value, an MGET of its pieces (a
    pipeline of GETs on a cluster, where one MGET cannot span slots), and a local
    cold hit of the node (a restarted store with no hot tier: verified file load).
    remote_hit is the whole fetch() (lookup, blobs, verification, restore, keeping
    the node), remote_fetch the part of it from asking for the blobs to their
    verified arrays. Every server's runs interleave, so load on a shared machine
    falls on all of them alike."""
    prompt = mx.random.randint(0, 512, (args.prefix + args.suffix,), key=mx.random.key(8))
    blobs, spread = {}, {}
    for server in servers:
        server.flushall()
        publish_node(model, prompt, [args.prefix], server, tmp / f"a-{server.name}", args.piece_bytes)
        names = server.blob_keys()
        # A cluster reads its shards side by side: the shard holding the most pieces sets the pace.
        spread[server.name] = [sum(1 for _ in p.client().scan_iter(match=BLOB_PREFIX + "*")) for p in server.primaries]
        values = [server.client.get(n) for n in names]
        server.client.set("bench:whole", b"".join(values))
        blobs[server.name] = (names, sum(len(v) for v in values))
        del values
    kinds = ("remote_hit", "remote_fetch", "raw_get", "raw_mget_pieces")
    samples = {server.name: {kind: [] for kind in kinds} for server in servers}
    cold = []
    for i in range(args.fetch_runs):
        for server in servers:
            names, blob = blobs[server.name]
            row = samples[server.name]
            dt, hit, fetched = timed_hit(model, prompt, server.url, tmp / f"b{i}-{server.name}")
            assert hit.remote_tokens == args.prefix and fetched["remote_fetched_values"] == len(names), (hit, fetched)
            row["remote_hit"].append(dt)
            row["remote_fetch"].append(fetched["seconds"])
            shutil.rmtree(tmp / f"b{i}-{server.name}", ignore_errors=True)
            t0 = time.perf_counter()
            whole = server.client.get("bench:whole")
            row["raw_get"].append(time.perf_counter() - t0)
            assert len(whole) == blob
            del whole
            t0 = time.perf_counter()
            got = _mget(server, names)
            row["raw_mget_pieces"].append(time.perf_counter() - t0)
            assert sum(len(v) for v in got) == blob
            del got
        dt, hit, _ = timed_hit(model, prompt, None, tmp / f"a-{servers[0].name}", hot_bytes=0)
        assert hit.length == args.prefix and hit.cold_nodes == 1
        cold.append(dt)
    local = summarize(cold)
    out = {"local_cold": local}
    for server in servers:
        names, blob = blobs[server.name]
        times = {kind: summarize(v) for kind, v in samples[server.name].items()}
        med = {kind: row["median_s"] for kind, row in times.items()} | {"local_cold": local["median_s"]}
        out[server.name] = {
            "blob_bytes": blob,
            "pieces": len(names),
            "pieces_by_shard": spread[server.name],
            "times": times,
            "throughput_gb_s": {kind: blob / m / 1e9 for kind, m in med.items()},
            "remote_over_local_cold": med["remote_hit"] / med["local_cold"],
            "throughput_over_raw_get": med["raw_get"] / med["remote_hit"],
            "throughput_over_raw_mget": med["raw_mget_pieces"] / med["remote_hit"],
            "fetch_throughput_over_raw_get": med["raw_get"] / med["remote_fetch"],
            "fetch_throughput_over_raw_mget": med["raw_mget_pieces"] / med["remote_fetch"],
        }
    return out


def _mget(server: Server, names: list[bytes]) -> list:
    if server.name == "single":
        return server.client.mget(names)
    pipe = server.client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    return pipe.execute()


def partial_chain(args, model, server: Server, tmp: Path) -> dict:
    """A chain of two nodes whose first B holds already (fetched by an earlier,
    shorter prompt): B fetches only the second, against a B that holds neither.
    time: the whole hit; fetch_time: its blobs fetched and verified."""
    prompt = mx.random.randint(0, 512, (args.prefix + args.suffix,), key=mx.random.key(9))
    half = args.prefix // 2
    server.flushall()
    publish_node(model, prompt, [half, args.prefix], server, tmp / "pa", args.piece_bytes)
    samples = {"holds_first": ([], []), "holds_none": ([], [])}
    fetched = {}
    for i in range(max(3, args.fetch_runs // 2)):
        dt, hit, fetched["holds_none"] = timed_hit(model, prompt, server.url, tmp / f"pn{i}")
        assert hit.remote_tokens == args.prefix
        samples["holds_none"][0].append(dt)
        samples["holds_none"][1].append(fetched["holds_none"].pop("seconds"))
        _, hit, _ = timed_hit(model, prompt[: half + 32], server.url, tmp / f"ph{i}")
        assert hit.remote_tokens == half
        dt, hit, fetched["holds_first"] = timed_hit(model, prompt, server.url, tmp / f"ph{i}")
        assert (hit.length, hit.remote_tokens) == (args.prefix, args.prefix - half), hit
        samples["holds_first"][0].append(dt)
        samples["holds_first"][1].append(fetched["holds_first"].pop("seconds"))
        for path in (tmp / f"pn{i}", tmp / f"ph{i}"):
            shutil.rmtree(path, ignore_errors=True)
    return {
        name: {"time": summarize(hits), "fetch_time": summarize(fetches), **fetched[name]}
        for name, (hits, fetches) in samples.items()
    }


def fetch_against_ceilings(args, tmp: Path) -> dict:
    """fetch_ceilings on one server and on a cluster of three primaries (both started
    here, their runs interleaved), and the partial chain on the one server; with
    the issue's goals, met or not."""
    model = llama_1b_shape(args.layers, dtype=mx.float32, vocab_size=512)
    running, servers = [], []
    tls = make_certificates(_made(tmp / "tls")) if args.tls else None
    try:
        process, server = single_server(tmp, tls)
        running.append(process)
        servers.append(server)
        if not (args.skip_cluster or missing()):
            process, server = cluster_server(tmp, tls)
            running.append(process)
            servers.append(server)
        out = fetch_ceilings(args, model, servers, tmp)
        out.setdefault("cluster", None)
        out["partial_chain"] = partial_chain(args, model, servers[0], tmp / "partial")
    finally:
        for process in running:
            process.kill()
    out["goals"] = goals(out)
    return out


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def goals(r: dict) -> dict:
    single, cluster = r["single"], r["cluster"]
    values = {
        "remote_over_local_cold": single["remote_over_local_cold"],
        "throughput_over_raw_get": single["throughput_over_raw_get"],
        "cluster_over_single": None
        if cluster is None
        else cluster["times"]["remote_hit"]["median_s"] / single["times"]["remote_hit"]["median_s"],
    }
    out = {}
    for name, value in values.items():
        goal = GOALS[name]
        met = None if value is None else (value >= goal if name.startswith("throughput") else value <= goal)
        out[name] = {"value": value, "goal": goal, "met": met}
    return out


# --- round trips per lookup and publish throughput --------------------------------------


def round_trips(url: str, port: int, tmp: Path, lengths: list[int]) -> list[dict]:
    """A tiny model (round trips do not depend on it): A stores all but 16 tokens of
    a prompt of each length, B looks it up; the server counts the commands."""
    model = tiny_model("llama", vocab_size=512)
    client = redis.Redis(port=port)
    rows = []
    for n in lengths:
        prompt = mx.random.randint(0, 512, (n,), key=mx.random.key(n))
        store_on_a(model, prompt, n - 16, url, tmp / f"rt-a{n}")
        with PromptStore.open(tmp / f"rt-b{n}", remote_url=url) as store:
            space = store.bind(model, model_id="bench")
            before = int(client.info("stats")["total_commands_processed"])
            hit = space.fetch(prompt)
            commands = int(client.info("stats")["total_commands_processed"]) - before - 1
            rows.append(
                {
                    "prompt_tokens": n,
                    "hit_tokens": hit.length,
                    "round_trips": store.remote.last_round_trips,
                    "server_commands": commands,
                    "grid_keys_asked": (n - 1) // CHUNK,
                }
            )
    return rows


def publish_throughput(model, url: str, port: int, tmp: Path, nodes: int, node_tokens: int, runs: int) -> dict:
    """Publishes of `nodes` filed nodes (each a separate prompt of `node_tokens`, KV
    filled directly), timed on the publishing thread's own code path (read the file,
    seal, SET blob and records), the server emptied between runs."""
    client = redis.Redis(port=port)
    with PromptStore.open(tmp / "pub", durability="sync") as store:  # no remote: files only
        space = store.bind(model, model_id="bench")
        keys = []
        for i in range(nodes):
            prompt = mx.random.randint(0, 512, (node_tokens,), key=mx.random.key(1000 + i))
            space.insert(prompt, filled_cache(model, node_tokens))
            keys.append(store.index.lookup(space.namespace, np.array(prompt)).path[-1].key)
    with PromptStore.open(tmp / "pub", remote_url=url) as store:
        tiers = store.tiers
        items = [tiers._describe(k) for k in keys]
        samples, nbytes = [], 0
        for _ in range(runs):
            client.flushall()
            tiers.remote._sent.clear()
            before = tiers.remote.counts["remote_published_bytes"]
            t0 = time.perf_counter()
            for item in items:
                tiers.remote.publish(item)
            samples.append(time.perf_counter() - t0)
            nbytes = tiers.remote.counts["remote_published_bytes"] - before
    s = summarize(samples)
    return {
        "nodes": nodes,
        "node_tokens": node_tokens,
        "bytes_per_run": nbytes,
        "time": s,
        "mb_per_s": nbytes / s["median_s"] / 1e6,
        "nodes_per_s": nodes / s["median_s"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=8192, help="tokens replica A stores")
    parser.add_argument("--suffix", type=int, default=64, help="new tokens after the prefix")
    parser.add_argument("--layers", type=int, default=2, help="layers of the Llama-3.2-1B-shaped model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, nargs="*", default=[0.0, 1.0, 10.0])
    parser.add_argument("--fetch-runs", type=int, default=9, help="alternating runs of a hit and its ceilings")
    parser.add_argument(
        "--piece-mb", type=float, default=None, help="piece size A publishes with (default: the tier's)"
    )
    parser.add_argument("--skip-cluster", action="store_true", help="no Redis Cluster run")
    parser.add_argument("--skip-ttft", action="store_true", help="skip the TTFT runs (minutes of CPU prefill)")
    parser.add_argument("--fetch-only", action="store_true", help="only the hit against its ceilings")
    parser.add_argument(
        "--tls", action="store_true", help="the servers speak only TLS (certificates made here) in the fetch runs"
    )
    parser.add_argument("--out", default="bench-results/remote.json")
    args = parser.parse_args(argv)
    args.piece_bytes = int(args.piece_mb * (1 << 20)) if args.piece_mb else None
    blas = blas_info()
    if warning := blas_warning(blas):
        print(warning)
    with tempfile.TemporaryDirectory() as tmp_name:
        result = run(args, Path(tmp_name))
    report(result)
    settings = {k: v for k, v in vars(args).items() if k != "piece_bytes"}
    out = write_results(args.out, {"benchmark": "remote", "settings": settings, **result}, blas)
    print(f"wrote {out}")
    return 0


def run(args, tmp: Path) -> dict:
    name = f"Llama-3.2-1B-shaped, {args.layers} layers, float32"
    fetch = fetch_against_ceilings(args, tmp / "fetch")
    if args.fetch_only:
        return {"model": name, "fetch": fetch}
    (tmp / "redis").mkdir()
    server = RedisServer(tmp / "redis").start()
    try:
        return {"model": name, "fetch": fetch, **rest(args, tmp, server)}
    finally:
        server.kill()


def rest(args, tmp: Path, server: RedisServer) -> dict:
    direct, port = server.url, server.port
    model = llama_1b_shape(args.layers, dtype=mx.float32, vocab_size=512)
    prompt = mx.random.randint(0, 512, (args.prefix + args.suffix,), key=mx.random.key(7))
    out = {
        "round_trips_by_length": round_trips(direct, port, tmp, [256, 1024, 4096, 16384, 65536]),
        "publish_large": publish_throughput(model, direct, port, tmp / "pl", 2, 4096, 3),
        "publish_small": publish_throughput(tiny_model("llama", vocab_size=512), direct, port, tmp / "ps", 64, 64, 5),
    }
    if args.skip_ttft:
        return out
    published = store_on_a(model, prompt, args.prefix, direct, tmp / "a")
    proxies = {ms: (direct if ms == 0 else DelayProxy(port, ms / 1000).url) for ms in args.latency_ms}
    recompute, remote, trips = [], {ms: [] for ms in proxies}, {}
    for run_i in range(args.runs):
        recompute.append(ttft_recompute(model, prompt))
        for ms, url in proxies.items():
            dt, trips[ms], _ = ttft_remote(model, prompt, url, tmp / f"b{run_i}-{ms}", args.prefix)
            remote[ms].append(dt)
    base = summarize(recompute)
    ttft = {
        f"{ms:g}ms": {
            "time": summarize(samples),
            "round_trips": trips[ms],
            "speedup_vs_recompute": base["median_s"] / float(np.median(samples)),
        }
        for ms, samples in remote.items()
    }
    return {"blob_bytes": published.get("remote_published_bytes", 0), "recompute": base, "remote_hit": ttft, **out}


def report(r: dict) -> None:
    print(f"model: {r['model']}")
    report_fetch(r["fetch"])
    for name, row in r.get("remote_hit", {}).items():
        if name == next(iter(r["remote_hit"])):
            base = r["recompute"]["median_s"]
            print(f"  blob {r['blob_bytes'] / 1e6:.1f} MB; B recomputes the prompt: TTFT median {base:.3f} s")
        med = row["time"]["median_s"]
        print(
            f"  B hits A's prefix, {name:>5} added per round trip: TTFT median {med:.3f} s "
            f"({row['speedup_vs_recompute']:.1f}x faster, {row['round_trips']} round trips)"
        )
    if "round_trips_by_length" in r:
        print("  round trips per lookup:")
    for row in r.get("round_trips_by_length", []):
        print(
            f"    {row['prompt_tokens']:>6} tokens: {row['round_trips']} round trips "
            f"({row['server_commands']} server commands, {row['grid_keys_asked']} grid keys in one MGET)"
        )
    for name in ("publish_large", "publish_small"):
        if name in r:
            p = r[name]
            print(
                f"  publish {p['nodes']} x {p['node_tokens']}-token nodes: {p['mb_per_s']:.0f} MB/s, "
                f"{p['nodes_per_s']:.0f} nodes/s"
            )


def report_fetch(f: dict) -> None:
    single = f["single"]
    print(f"  a hit of one {single['blob_bytes'] / 1e6:.1f} MB node ({single['pieces']} pieces), medians:")
    columns = {"remote_hit": "remote hit", "remote_fetch": "its fetch", "raw_get": "raw GET"}
    columns |= {"raw_mget_pieces": "raw MGET", "local_cold": "local cold"}
    print(f"    {'':>8}" + "".join(f"{c:>12}" for c in columns.values()) + f"{'hit/cold':>10}{'GET/hit':>9}")
    for name in ("single", "cluster"):
        row = f[name]
        if row is None:
            continue
        t, g = row["times"] | {"local_cold": f["local_cold"]}, row["throughput_gb_s"]
        cells = "".join(f"{t[k]['median_s'] * 1e3:9.1f} ms" for k in columns)
        print(f"    {name:>8}{cells}{row['remote_over_local_cold']:9.2f}x{row['throughput_over_raw_get']:8.2f}x")
        print(f"    {'GB/s':>8}" + "".join(f"{g[k]:12.2f}" for k in columns))
    if f.get("cluster") is not None:
        print(f"    the cluster's pieces by shard: {f['cluster'].get('pieces_by_shard')}")
    for name, row in f["partial_chain"].items():
        print(
            f"    chain of 2, B {name.replace('_', ' ')}: hit {row['time']['median_s'] * 1e3:.1f} ms, its fetch "
            f"{row['fetch_time']['median_s'] * 1e3:.1f} ms, {row.get('remote_fetched_values', 0)} values / "
            f"{row.get('remote_fetched_bytes', 0) / 1e6:.1f} MB fetched"
        )
    print_goals(
        [
            (name, g["value"], f"{'>=' if name.startswith('throughput') else '<='} {g['goal']}")
            for name, g in f["goals"].items()
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
