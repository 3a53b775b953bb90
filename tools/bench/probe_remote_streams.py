"""How fast Redis hands over a node's pieces on this host, read the way the
remote tier reads them (pipelined GETs, each value read off the socket into a
ready buffer by `read_values`), by how many sockets read side by side.

One node of `--mib` MiB in pieces of 8 MiB (the tier's piece size):
- one server, the pieces on one connection, then split over 2, 3 and 4
  connections read on a thread each; then with the server's I/O threads on
  (`--io-threads 4` over 1, 4 and 8 connections, `--io-threads 2` over 4), an
  operator's setting, which Redis uses only while at least twice as many
  clients as threads wait for replies;
- three separate servers (a cluster's three primaries, without the cluster's
  slot routing), a third of the pieces on each, read one server after the other
  (how the cluster client read its shards before) and side by side;
- beside them, the bytes sent over a bare loopback socket by another process
  (the kernel's ceiling for one stream, from the connection on) and a memory
  copy of the same bytes.

Sides alternate within each run; medians and GB/s are printed and written as JSON.

    python tools/bench/probe_remote_streams.py --out bench-results/probe-remote-streams.json
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import blas_info, summarize, write_results  # noqa: E402

from promptstore.snapshots.remote.cluster import read_values  # noqa: E402
from promptstore.testing.redis_cluster import RedisServer, missing  # noqa: E402

PIECE = 8 << 20


def read_pieces(client, names: list[str], buffers: dict[str, memoryview]) -> None:
    """GET every name on one connection of `client`, each value into its buffer."""
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_packed_command(connection.pack_commands([("GET", n) for n in names]))
        errors = read_values(connection, len(names), lambda k, n: buffers[names[k]][:n], lambda k, v: None)
        assert not errors, errors
    finally:
        pool.release(connection)


def side_by_side(pool: ThreadPoolExecutor, jobs: list) -> None:
    """Run (fn, args) jobs: the first on this thread, the rest on the pool."""
    futures = [pool.submit(fn, *args) for fn, args in jobs[1:]]
    jobs[0][0](*jobs[0][1])
    for f in futures:
        f.result()


SENDER = """
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2])
chunk = memoryview(bytearray(8 << 20))
with socket.create_connection(("127.0.0.1", port)) as s:
    sent = 0
    while sent < n:
        sent += s.send(chunk[: min(len(chunk), n - sent)])
"""


def socket_ceiling(nbytes: int, into: memoryview) -> float:
    """Seconds to read nbytes over one loopback TCP connection from another process
    (the kernel's ceiling for one stream, no server's work) with recv_into, from
    its connection on (the process's start not counted)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-c", SENDER, str(nbytes), str(port)])
        try:
            server.settimeout(30)
            conn, _ = server.accept()
            started = time.perf_counter()
            with conn:
                conn.settimeout(30)
                done = 0
                while done < nbytes:
                    got = conn.recv_into(into[done:])
                    if not got:
                        raise RuntimeError("the sender stopped early")
                    done += got
            return time.perf_counter() - started
        finally:
            sender.wait(timeout=30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="the node's size (MiB), in 8 MiB pieces")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--out", default="bench-results/probe-remote-streams.json")
    args = parser.parse_args(argv)
    if (why := missing()) is not None:
        raise SystemExit(why)
    count = max(1, args.mib * (1 << 20) // PIECE)
    nbytes = count * PIECE
    names = [f"piece:{i}" for i in range(count)]
    values = [os.urandom(PIECE) for _ in range(count)]
    buffers = {n: memoryview(np.empty(PIECE, np.uint8)) for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        for name, extra in (
            ("single", ()),
            ("io_threads", ("--io-threads", "4")),
            ("io_threads_2", ("--io-threads", "2")),
            ("shard0", ()),
            ("shard1", ()),
            ("shard2", ()),
        ):
            (Path(tmp) / name).mkdir()
            servers[name] = RedisServer(Path(tmp) / name, *extra).start()
        try:
            clients = {k: s.client() for k, s in servers.items()}
            for key in ("single", "io_threads", "io_threads_2"):
                clients[key].mset(dict(zip(names, values)))
            shards = [names[i::3] for i in range(3)]
            for i, part in enumerate(shards):
                clients[f"shard{i}"].mset({n: values[names.index(n)] for n in part})
            del values
            pool = ThreadPoolExecutor(8)

            def split(client, k):
                parts = [names[i::k] for i in range(k)]
                return lambda: side_by_side(pool, [(read_pieces, (client, p, buffers)) for p in parts])

            three = [(read_pieces, (clients[f"shard{i}"], shards[i], buffers)) for i in range(3)]
            src = np.frombuffer(os.urandom(nbytes), np.uint8)
            dst = np.empty_like(src)
            paths = {
                "one server, 1 connection": split(clients["single"], 1),
                "one server, 2 connections": split(clients["single"], 2),
                "one server, 3 connections": split(clients["single"], 3),
                "one server, 4 connections": split(clients["single"], 4),
                "io-threads 4, 1 connection": split(clients["io_threads"], 1),
                "io-threads 4, 4 connections": split(clients["io_threads"], 4),
                # Redis hands writes to its I/O threads only while at least twice as many
                # clients wait for replies as it has threads.
                "io-threads 4, 8 connections": split(clients["io_threads"], 8),
                "io-threads 2, 4 connections": split(clients["io_threads_2"], 4),
                "3 servers, one after another": lambda: [fn(*a) for fn, a in three],
                "3 servers, side by side": lambda: side_by_side(pool, three),
                "loopback socket (no server)": lambda: socket_ceiling(nbytes, memoryview(dst)),
                "memory copy": lambda: np.copyto(dst, src),
            }
            for fn in paths.values():
                fn()  # connections open, pages touched
            samples = {k: [] for k in paths}
            for _ in range(args.runs):
                for k, fn in paths.items():
                    t0 = time.perf_counter()
                    took = fn()  # a path that times itself returns its seconds
                    samples[k].append(took if isinstance(took, float) else time.perf_counter() - t0)
            pool.shutdown()
        finally:
            for s in servers.values():
                s.kill()
    rows = {}
    print(f"{count} pieces of 8 MiB ({nbytes / 1e6:.1f} MB), {os.cpu_count()} cores; medians of {args.runs}:")
    for k, v in samples.items():
        s = summarize(v)
        rows[k] = {**s, "gb_per_s": nbytes / s["median_s"] / 1e9}
        print(f"  {k:<32} {s['median_s'] * 1e3:8.1f} ms  {rows[k]['gb_per_s']:6.2f} GB/s")
    doc = {"benchmark": "remote-streams", "pieces": count, "bytes": nbytes, "cores": os.cpu_count(), "rows": rows}
    print(f"wrote {write_results(args.out, doc, blas_info())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
