"""Slow and greedy clients against a real server (--header-timeout 2, --max-connections 4):
a request whose line and headers trickle in is answered 408 once the header
timeout passes, one that sends nothing is closed, connections past the cap are
answered 503 at once, and the official client is served during and after.
Raw sockets on 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import openai
import pytest

from .conftest import Server

HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 4
SLACK_S = 3.0  # a busy machine's delay on top of a deadline the server keeps
TRICKLE_EVERY_S = 0.1  # a slow client's pace: a byte of its headers this often
FLOOD = 100  # trickling connections at once, as in the report
HELLO = [{"role": "user", "content": "Hello"}]
# A request whose headers never end: a byte of it is sent at a time, never the blank line.
ENDLESS_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trickle: " + b"a" * 4096


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("slow-clients")
    extra = ("--header-timeout", str(HEADER_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS))
    started = Server(model_dir(), root / "store", root / "server.log", *extra)
    try:
        yield started.start()
    finally:
        started.kill()


@pytest.fixture
def idle(server):
    """The server with every connection slot free (the previous test's clients gone)."""
    deadline = time.monotonic() + HEADER_TIMEOUT_S + SLACK_S
    while sorted(statuses(server, [b"GET /health HTTP/1.0\r\n\r\n"] * MAX_CONNECTIONS)) != [200] * MAX_CONNECTIONS:
        assert time.monotonic() < deadline, f"connections still held:\n{server.log()[-3000:]}"
        time.sleep(0.2)
    return server


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def status_of(reply: bytes) -> int | None:
    """The status of a raw HTTP reply, None for none."""
    line = reply.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[1].isdigit() else None


def statuses(server: Server, requests: list[bytes]) -> list[int | None]:
    """Each request on a connection of its own, all opened before any is sent."""
    socks = [connect(server) for _ in requests]
    try:
        for sock, request in zip(socks, requests, strict=True):
            sock.sendall(request)
        return [status_of(read_all(sock)) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def read_all(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """What the server sends until it closes (or `timeout` passes, or it resets)."""
    deadline, out = time.monotonic() + timeout, b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    return out


def trickle(socks: list[socket.socket], within: float) -> dict[socket.socket, tuple[bytes, float]]:
    """Send every socket a byte of ENDLESS_HEAD each TRICKLE_EVERY_S, until the server
    ends each one or `within` seconds pass: what each got, and when it ended (its
    seconds since the start; inf for one still open). One thread for all of them."""
    started = time.monotonic()
    selector = selectors.DefaultSelector()
    got = {sock: b"" for sock in socks}
    ended = {sock: float("inf") for sock in socks}
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    sent, next_byte = 0, started
    try:
        while selector.get_map() and (now := time.monotonic()) < started + within:
            if now >= next_byte:
                for key in list(selector.get_map().values()):
                    try:
                        key.fileobj.send(ENDLESS_HEAD[sent : sent + 1])
                    except OSError:
                        pass  # the server closed it: its answer is still to read
                sent, next_byte = sent + 1, next_byte + TRICKLE_EVERY_S
            for key, _ in selector.select(timeout=0.02):
                sock = key.fileobj
                try:
                    chunk = sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""  # reset: the server is done with it
                got[sock] += chunk
                if not chunk:
                    ended[sock] = time.monotonic() - started
                    selector.unregister(sock)
    finally:
        selector.close()
    return {sock: (got[sock], ended[sock]) for sock in socks}


def ask(server: Server) -> str:
    """One chat completion through the official client."""
    with server.client() as client:
        reply = client.chat.completions.create(model="default_model", messages=HELLO, max_tokens=4, temperature=0)
    return reply.choices[0].finish_reason


def test_a_head_that_trickles_in_is_answered_408_at_the_header_timeout(idle):
    sock = connect(idle)
    try:
        (reply, ended) = trickle([sock], within=HEADER_TIMEOUT_S + SLACK_S)[sock]
    finally:
        sock.close()
    assert status_of(reply) == 408, reply[:300]
    assert b"--header-timeout" in reply
    assert HEADER_TIMEOUT_S - 0.2 <= ended <= HEADER_TIMEOUT_S + SLACK_S
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(idle):
    sock = connect(idle)
    try:
        started = time.monotonic()
        reply = read_all(sock, timeout=HEADER_TIMEOUT_S + SLACK_S)
        waited = time.monotonic() - started
    finally:
        sock.close()
    assert reply == b""  # nothing was asked: closed without an answer
    assert HEADER_TIMEOUT_S - 0.2 <= waited < HEADER_TIMEOUT_S + SLACK_S


def test_connections_past_the_cap_are_answered_503_at_once(idle):
    holders = [connect(idle) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in holders:
            sock.sendall(ENDLESS_HEAD[:20])  # a head begun, never finished: each holds its slot
        time.sleep(0.2)  # taken in order: the holders first
        extra = connect(idle)
        try:
            started = time.monotonic()
            extra.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            reply = read_all(extra, timeout=SLACK_S)
            answered = time.monotonic() - started
        finally:
            extra.close()
        assert status_of(reply) == 503, reply[:300]
        assert answered < 1.0  # not after the header timeout, nor after a slot frees
        assert b"Retry-After: 1" in reply and b"--max-connections" in reply
        with pytest.raises(openai.APIStatusError) as refused:  # the official client reads it as an error
            ask(idle)
        assert refused.value.status_code == 503
        assert "--max-connections" in refused.value.message
        # The holders were held all along, and are ended at their header timeout.
        for sock in holders:
            assert status_of(read_all(sock, timeout=HEADER_TIMEOUT_S + SLACK_S)) == 408
    finally:
        for sock in holders:
            sock.close()
    assert ask(idle) in ("length", "stop")  # a slot is free again


def test_a_flood_of_trickling_connections_is_all_answered_in_time(idle):
    """The issue's case: a hundred connections trickling their headers. The cap's
    worth get 408 at the header timeout, the rest 503 at once; none is held longer."""
    socks = [connect(idle) for _ in range(FLOOD)]
    try:
        results = trickle(socks, within=HEADER_TIMEOUT_S + 2 * SLACK_S)
    finally:
        for sock in socks:
            sock.close()
    by_status: dict[int | None, list[float]] = {}
    for reply, ended in results.values():
        by_status.setdefault(status_of(reply), []).append(ended)
    assert sorted(by_status) == [408, 503], {k: len(v) for k, v in by_status.items()}
    assert len(by_status[408]) == MAX_CONNECTIONS
    assert max(by_status[408]) <= HEADER_TIMEOUT_S + SLACK_S
    assert max(by_status[503]) < HEADER_TIMEOUT_S  # answered before any slot freed
    assert ask(idle) in ("length", "stop")


def test_the_official_client_is_served_while_slow_clients_hold_connections(idle):
    holders = [connect(idle) for _ in range(MAX_CONNECTIONS - 1)]
    answers: list = []
    try:
        for sock in holders:
            sock.sendall(ENDLESS_HEAD[:20])
        time.sleep(0.2)
        finished = threading.Thread(target=lambda: answers.append(ask(idle)), daemon=True)
        finished.start()
        finished.join(timeout=60)
        assert answers and answers[0] in ("length", "stop")
        for sock in holders:
            assert status_of(read_all(sock, timeout=HEADER_TIMEOUT_S + SLACK_S)) == 408
    finally:
        for sock in holders:
            sock.close()


def test_a_body_sent_after_the_header_timeout_is_still_read(idle):
    """The header timeout ends with the headers: the body keeps its own time bound."""
    body = json.dumps({"model": "default_model", "messages": HELLO, "max_tokens": 2}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = connect(idle)
    try:
        sock.sendall(head)
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        sock.sendall(body)
        reply = read_all(sock, timeout=60)
    finally:
        sock.close()
    assert status_of(reply) == 200, reply[:300]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_signal_while_a_connection_thread_starts_stops_the_server(monkeypatch):
    """SIGTERM's KeyboardInterrupt can land while a connection's thread starts:
    the interrupt reaches the serving loop (the server stops), and the slot is
    given back once, whether the thread ran or not (given back twice, the
    semaphore raised a ValueError that hid the interrupt: the server went on)."""
    from http.server import BaseHTTPRequestHandler

    from promptstore.serve.connections import capped_server

    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    server = capped_server(bound, max_connections=2, header_timeout=1.0)(("127.0.0.1", 0), BaseHTTPRequestHandler)
    start = threading.Thread.start

    def start_then_interrupted(thread):
        start(thread)  # the thread runs all the same, and here ends first
        thread.join(timeout=10)
        assert not thread.is_alive()
        raise KeyboardInterrupt

    try:
        a, b = socket.socketpair()
        b.close()  # the connection's thread reads nothing and ends
        monkeypatch.setattr(threading.Thread, "start", start_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            server.process_request(a, ("127.0.0.1", 1))
        monkeypatch.undo()
        assert server._slots.acquire(blocking=False) and server._slots.acquire(blocking=False)  # both slots free
        assert not server._slots.acquire(blocking=False)
    finally:
        server.server_close()
