"""The remote tier: replica B's time to first token on a prompt whose long prefix
replica A stored, against B recomputing it; round trips per lookup against
prompt length; publish throughput.

A real redis-server runs on a free loopback port. Network latency is injected by
a small asyncio TCP proxy on loopback that holds every chunk the client sends
for `--latency-ms` before forwarding it (so each round trip costs that much more;
replies pass at once, at loopback bandwidth). Sides alternate within each run
(recompute, then the remote hit at each latency) on a shared, noisy machine:
medians and ratios are quoted. Recompute is float32; run it with OpenBLAS
preloaded on Linux (`make openblas`), as the script warns otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import blas_info, blas_warning, summarize, write_results  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.caches import make_prompt_cache  # noqa: E402
from promptstore.snapshots.remote import CHUNK  # noqa: E402
from promptstore.testing.models import llama_1b_shape, tiny_model  # noqa: E402

PREFILL_STEP = 512


# --- a real server and a delaying proxy ----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: Path) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if redis.Redis(port=port, socket_timeout=1).ping():
                return proc, port
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start within 10 s (`make redis` installs it)")


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
        trips = store.tiers.remote.last_round_trips
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
        remote = store.tiers.remote
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


def fetch_alone(args, tmp: Path, port: int) -> dict:
    """B's fetch of A's prefix (the remote hit, kept locally) at each latency,
    alternating with a local cold hit of the same prefix (a restarted store with
    no hot tier: verified file load), the ceiling a remote hit approaches."""
    direct = f"redis://127.0.0.1:{port}/0"
    model = llama_1b_shape(args.layers, dtype=mx.float32, vocab_size=512)
    prompt = mx.random.randint(0, 512, (args.prefix + args.suffix,), key=mx.random.key(8))
    with PromptStore.open(tmp / "fa", remote_url=direct) as store:
        store.bind(model, model_id="bench").insert(prompt[: args.prefix], filled_cache(model, args.prefix))
    proxies = {ms: (direct if ms == 0 else DelayProxy(port, ms / 1000).url) for ms in args.latency_ms}
    samples = {f"remote_{ms:g}ms": [] for ms in proxies} | {"local_cold": []}
    for i in range(args.fetch_runs):
        for ms, url in proxies.items():
            with PromptStore.open(tmp / f"fb{i}-{ms}", remote_url=url, remote_timeout=5.0) as store:
                space = store.bind(model, model_id="bench")
                t0 = time.perf_counter()
                hit = space.fetch(prompt)
                mx.eval([a for c in hit.cache for a in c.state])
                samples[f"remote_{ms:g}ms"].append(time.perf_counter() - t0)
                assert hit.remote_tokens == args.prefix, hit.remote_tokens
            shutil.rmtree(tmp / f"fb{i}-{ms}", ignore_errors=True)
        with PromptStore.open(tmp / "fa", hot_bytes=0) as store:
            space = store.bind(model, model_id="bench")
            t0 = time.perf_counter()
            hit = space.fetch(prompt)
            mx.eval([a for c in hit.cache for a in c.state])
            samples["local_cold"].append(time.perf_counter() - t0)
            assert hit.length == args.prefix and hit.cold_nodes == 1
    out = {name: summarize(v) for name, v in samples.items()}
    for name in out:
        out[name]["over_local_cold"] = out[name]["median_s"] / out["local_cold"]["median_s"]
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
                    "round_trips": store.tiers.remote.last_round_trips,
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
    parser.add_argument("--fetch-runs", type=int, default=7, help="alternating runs of the fetch alone")
    parser.add_argument("--skip-ttft", action="store_true", help="skip the TTFT runs (minutes of CPU prefill)")
    parser.add_argument("--out", default="bench-results/remote.json")
    args = parser.parse_args(argv)
    blas = blas_info()
    if warning := blas_warning(blas):
        print(warning)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "redis").mkdir()
        server, port = start_redis(tmp / "redis")
        try:
            result = run(args, tmp, port)
        finally:
            server.kill()
            server.wait(10)
    report(result)
    out = write_results(args.out, {"benchmark": "remote", "settings": vars(args), **result}, blas)
    print(f"wrote {out}")
    return 0


def run(args, tmp: Path, port: int) -> dict:
    direct = f"redis://127.0.0.1:{port}/0"
    model = llama_1b_shape(args.layers, dtype=mx.float32, vocab_size=512)
    prompt = mx.random.randint(0, 512, (args.prefix + args.suffix,), key=mx.random.key(7))
    fetch = fetch_alone(args, tmp, port)
    rest = {
        "fetch_alone": fetch,
        "round_trips_by_length": round_trips(direct, port, tmp, [256, 1024, 4096, 16384, 65536]),
        "publish_large": publish_throughput(model, direct, port, tmp / "pl", 2, 4096, 3),
        "publish_small": publish_throughput(tiny_model("llama", vocab_size=512), direct, port, tmp / "ps", 64, 64, 5),
    }
    if args.skip_ttft:
        return {"model": f"Llama-3.2-1B-shaped, {args.layers} layers, float32", **rest}
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
    return {
        "model": f"Llama-3.2-1B-shaped, {args.layers} layers, float32",
        "blob_bytes": published.get("remote_published_bytes", 0),
        "recompute": base,
        "remote_hit": ttft,
        **rest,
    }


def report(r: dict) -> None:
    print(f"model: {r['model']}")
    print("  fetch alone (alternating runs):")
    for name, row in r["fetch_alone"].items():
        print(
            f"    {name:>14}: median {row['median_s'] * 1e3:7.1f} ms = {row['over_local_cold']:.2f}x a local cold hit"
        )
    for name, row in r.get("remote_hit", {}).items():
        if name == next(iter(r["remote_hit"])):
            base = r["recompute"]["median_s"]
            print(f"  blob {r['blob_bytes'] / 1e6:.1f} MB; B recomputes the prompt: TTFT median {base:.3f} s")
        med = row["time"]["median_s"]
        print(
            f"  B hits A's prefix, {name:>5} added per round trip: TTFT median {med:.3f} s "
            f"({row['speedup_vs_recompute']:.1f}x faster, {row['round_trips']} round trips)"
        )
    print("  round trips per lookup:")
    for row in r["round_trips_by_length"]:
        print(
            f"    {row['prompt_tokens']:>6} tokens: {row['round_trips']} round trips "
            f"({row['server_commands']} server commands, {row['grid_keys_asked']} grid keys in one MGET)"
        )
    for name in ("publish_large", "publish_small"):
        p = r[name]
        print(
            f"  publish {p['nodes']} x {p['node_tokens']}-token nodes: {p['mb_per_s']:.0f} MB/s, "
            f"{p['nodes_per_s']:.0f} nodes/s"
        )


if __name__ == "__main__":
    sys.exit(main())
