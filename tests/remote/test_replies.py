"""A fetch's GET replies are read off the socket straight into buffers: values,
nils and error replies keep the connection in step; anything else (a reply out
of step, a short read, a timeout) raises, the fetch is a reported miss, and the
connection it came on is closed, never used again."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import redis
from redis.exceptions import InvalidResponse

import promptstore
from promptstore.snapshots.remote import tier
from promptstore.snapshots.remote.cluster import read_values
from promptstore.snapshots.remote.keys import BLOB_PREFIX

from ..conftest import prompt_tokens
from .helpers import publish


class _Connection:
    """What read_values needs of a redis-py connection: its socket."""

    def __init__(self, sock):
        self._sock = sock


class _Server:
    """The far end of a socket pair: what it sends goes from a thread (a socket's
    buffer holds less than a long value)."""

    def __init__(self, sock):
        self.sock, self.threads = sock, []

    def sendall(self, data: bytes) -> None:
        thread = threading.Thread(target=self._send, args=(data,), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # the reader gave up

    def close_sending(self) -> None:
        for thread in self.threads:
            thread.join(5)
        self.sock.shutdown(socket.SHUT_WR)


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    ours.settimeout(2.0)
    theirs.settimeout(5.0)
    try:
        yield _Connection(ours), _Server(theirs)
    finally:
        ours.close()
        theirs.close()


def _read(connection, count, longest=1 << 20):
    got = {}

    def into(k, n):
        return memoryview(np.empty(n, np.uint8)) if n <= longest else None

    def each(k, value):
        got[k] = None if value is None else bytes(value)

    errors = read_values(connection, count, into, each)
    return got, errors


def test_values_nils_and_error_replies_keep_the_connection_in_step(pair):
    connection, server = pair
    big = bytes(range(256)) * 4000  # longer than one read-ahead
    server.sendall(b"$5\r\nhello\r\n$-1\r\n-WRONGTYPE not a string\r\n$%d\r\n%s\r\n$0\r\n\r\n" % (len(big), big))
    got, errors = _read(connection, 5)
    assert got == {0: b"hello", 1: None, 3: big, 4: b""}
    assert list(errors) == [2] and isinstance(errors[2], redis.ResponseError) and "not a string" in str(errors[2])


def test_a_value_longer_than_taken_is_read_past_and_handed_over_empty(pair):
    connection, server = pair
    server.sendall(b"$10\r\n0123456789\r\n$2\r\nok\r\n")
    got, errors = _read(connection, 2, longest=4)
    assert got == {0: b"", 1: b"ok"} and not errors


@pytest.mark.parametrize(
    "stream",
    [
        b":1\r\n$2\r\nok\r\n",  # an integer where a value belongs
        b"*1\r\n$2\r\nok\r\n",  # an array
        b"$2\r\nokk\r\n",  # a value longer than its length
        b"$x2\r\nok\r\n",  # no length
        b"$2\r\nok\r\n$2\r\nok\r\n+extra\r\n",  # bytes past the last reply
    ],
)
def test_a_reply_out_of_step_raises(pair, stream):
    connection, server = pair
    server.sendall(stream)
    with pytest.raises(InvalidResponse):
        _read(connection, 2)


def test_a_short_read_raises(pair):
    connection, server = pair
    server.sendall(b"$10\r\n01234")
    server.close_sending()
    with pytest.raises(redis.ConnectionError):
        _read(connection, 1)


def test_a_silent_server_is_a_timeout(pair):
    connection, server = pair
    connection._sock.settimeout(0.2)
    server.sendall(b"$10\r\n01234")
    with pytest.raises(redis.TimeoutError):
        _read(connection, 1)


# --- through a store --------------------------------------------------------------------


class _Mangled:
    """A connection's socket whose incoming bytes go through `mangle` (sends pass)."""

    def __init__(self, sock, mangle):
        self.sock, self.mangle, self.sent_back = sock, mangle, False

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def recv(self, n):
        return self.mangle(self, self.sock.recv(n))

    def recv_into(self, view, n=0):
        data = self.recv(len(view))
        view[: len(data)] = data
        return len(data)


def _out_of_step(mangled, data):
    if not mangled.sent_back:
        mangled.sent_back = True
        return b":1\r\n" + data
    return data


def _short(mangled, data):
    if mangled.sent_back:
        return b""  # the server closed the connection mid-stream
    mangled.sent_back = True
    return data[:100]


@pytest.mark.parametrize("fault", ["out of step", "short read", "error reply"])
def test_a_bad_reply_stream_is_a_reported_miss_and_its_connection_is_dropped(
    tmp_path, redis_server, model_of, monkeypatch, fault
):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=81)
    publish(tmp_path / "a", redis_server.url, model, tokens[:280])
    client = redis_server.client()
    pieces = sorted(client.scan_iter(match=BLOB_PREFIX + "*"))
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        space, remote = b.bind(model, model_id="m"), b.remote
        used = []

        def mangled(connection, *args, **kwargs):
            used.append(connection)
            connection._sock = _Mangled(connection._sock, _out_of_step if fault == "out of step" else _short)
            return read_values(connection, *args, **kwargs)

        saved = client.get(pieces[-1])
        if fault == "error reply":
            client.delete(pieces[-1])
            client.rpush(pieces[-1], b"not a string")  # GET answers WRONGTYPE
        else:
            monkeypatch.setattr(tier, "read_values", mangled)
        hit = space.fetch(tokens)
        monkeypatch.undo()
        assert (hit.length, hit.remote_tokens) == (0, 0)
        reason = {"out of step": "remote_garbage", "short read": "remote_down", "error reply": "remote_refused"}[fault]
        assert [r.reason for r in b.reports] == [reason]
        assert not list(b.index.iter_nodes(space.namespace)), "nothing of the miss was kept"
        if fault == "error reply":
            client.delete(pieces[-1])
            client.set(pieces[-1], saved)
        else:
            assert len(used) == 1 and used[0]._sock is None, "the connection out of step was closed"
        remote._down_until = 0.0  # a short read marks the server down for a moment
        again = space.fetch(tokens)  # every reply where it belongs: no connection left out of step
        assert (again.length, again.remote_tokens) == (280, 280)
        assert not [r for r in list(b.reports)[1:]]
