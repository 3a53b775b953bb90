"""Connections as `promptstore serve` takes them: on the socket bound at start
(startup.py), at most --max-connections at once (one more is answered 503 at
once, by no thread of its own), and each request's line and headers within
--header-timeout (a client that trickles them is answered 408 and closed).

mlx_lm.server serves with http.server's ThreadingHTTPServer: a thread for every
connection, for as long as the connection lasts. Without these bounds, clients
that open connections and send their headers a byte at a time hold a thread
each, for ever (door.py's time bound starts only once the headers are read).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import queue
import selectors
import socket
import threading
import time
from http.server import ThreadingHTTPServer

log = logging.getLogger("promptstore.serve")

# A request's line and headers come in one write from any real client, a few
# hundred bytes; 10 s leaves room for a slow link, and bounds how long a client
# that trickles them (or sends nothing) holds a connection and its thread.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Each open connection is a thread. mlx-lm decodes at most 32 requests at once
# by default (--decode-concurrency): 256 lets eight times that many wait their
# turn, and bounds the threads a flood of connections can take.
DEFAULT_MAX_CONNECTIONS = 256
# Connections that have arrived but are not yet taken: a burst beyond the
# standard library's 5 would have its connections dropped and retried a second later.
ACCEPT_BACKLOG = 128
# After an answer that ends a connection (408, 503), what the client still sends
# is read and dropped this long at most: closing a socket with unread bytes
# resets the connection, and the client could lose the answer before reading it.
LINGER_S = 1.0
# Refused connections waiting out LINGER_S at once; past it one is closed right
# after its answer (each holds a file descriptor).
LINGER_MAX = 128
REFUSED_LOG_EVERY_S = 10.0  # refusals are logged at most this often, with their count


def answer(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP response that closes its connection, with an error body in
    OpenAI's shape: sent where no handler (and no request) is there to send one."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = [f"HTTP/1.0 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class HeadTimeout(TimeoutError):
    """A request's line and headers did not arrive within --header-timeout.

    A TimeoutError: http.server's handler ends the connection on one."""


class _HeadReader(io.RawIOBase):
    """The connection as the handler's rfile reads it. While a request's line and
    headers are read, every read ends by one deadline: a socket timeout alone
    restarts with each byte, so a client trickling a byte a second would never
    meet it. Outside the head it reads as the plain socket (door.py sets the
    body's own timeout on the socket)."""

    def __init__(self, sock: socket.socket):
        super().__init__()
        self.sock = sock
        self.seconds = 0.0
        self.deadline: float | None = None
        self.previous: float | None = None  # the socket's timeout before the head
        self.received = 0  # bytes of this head so far
        self.expired = False

    def readable(self) -> bool:
        return True

    def arm(self, seconds: float) -> None:
        self.previous, self.seconds = self.sock.gettimeout(), seconds
        self.deadline = time.monotonic() + seconds
        self.received, self.expired = 0, False

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline = None
            self.sock.settimeout(self.previous)

    def readinto(self, buffer) -> int:
        if self.deadline is None:
            return self.sock.recv_into(buffer)
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            self.expired = True
            raise HeadTimeout(f"the request's headers did not arrive within {self.seconds:g} s") from None
        self.received += n
        return n


class HeadDeadline:
    """A mixin for an http.server request handler: each request's line and headers
    are read within the server's `header_timeout`; one that took longer is
    answered 408 (nothing, if no byte of it came: an idle connection is closed)."""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file, replaced: closed, so closing the socket frees it
        self._head = _HeadReader(self.connection)
        self.rfile = io.BufferedReader(self._head)

    def handle_one_request(self) -> None:
        seconds = getattr(self.server, "header_timeout", DEFAULT_HEADER_TIMEOUT_S)
        self._head.arm(seconds)
        try:
            super().handle_one_request()  # ends the connection on a HeadTimeout (a TimeoutError)
        finally:
            self._head.disarm()
        if self._head.expired:
            self.close_connection = True
            if self._head.received:
                message = f"the request's line and headers did not arrive within {seconds:g} s (--header-timeout)"
                _end(self.connection, answer(408, "Request Timeout", message, "request_timeout"))

    def parse_request(self) -> bool:
        try:
            return super().parse_request()  # reads the headers: the last of the head
        finally:
            self._head.disarm()


def _end(sock: socket.socket, response: bytes) -> None:
    """Send `response` (at most LINGER_S for a client that does not read), then
    drop what the client still sends for at most LINGER_S: the thread is back
    within twice that."""
    deadline = time.monotonic() + LINGER_S
    try:
        sock.settimeout(LINGER_S)
        sock.sendall(response)
        sock.shutdown(socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass  # gone, or still sending at the deadline: the socket closes all the same


class _Refusals:
    """Connections past the cap: answered 503 in the accepting thread (a fresh
    connection's send buffer is empty, so the write does not wait), then kept by
    one thread for all of them while what their clients send is dropped, for at
    most LINGER_S each."""

    POLL_S = 0.05  # how soon a newly refused connection starts being read

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._lingering = 0
        self._thread: threading.Thread | None = None
        self._count, self._logged = 0, 0.0

    def refuse(self, sock: socket.socket, response: bytes, open_now: int) -> None:
        self._say(open_now)
        try:
            sock.setblocking(False)
            sock.send(response)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        with self._lock:
            if self._lingering >= LINGER_MAX:
                sock.close()
                return
            self._lingering += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="refused connections", daemon=True)
                self._thread.start()
        self._queue.put((sock, time.monotonic() + LINGER_S))

    def _say(self, open_now: int) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._logged >= REFUSED_LOG_EVERY_S:
            log.warning(
                "%d connection(s) refused with 503: %d open, the most --max-connections allows", self._count, open_now
            )
            self._count, self._logged = 0, now

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        deadlines: dict[socket.socket, float] = {}
        while True:
            try:
                # None lingering: sleep until a refusal; else pick up new ones between reads.
                block = not deadlines
                while True:
                    sock, deadline = self._queue.get(block=block)
                    block = False
                    deadlines[sock] = deadline
                    try:
                        selector.register(sock, selectors.EVENT_READ)
                    except (OSError, ValueError):  # this thread must not end: the others wait on it
                        deadlines[sock] = 0.0  # dropped below, without reading
            except queue.Empty:
                pass
            for key, _ in selector.select(timeout=self.POLL_S):
                try:
                    more = key.fileobj.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    more = b""
                if not more:  # the client read the answer and closed
                    self._drop(selector, deadlines, key.fileobj)
            now = time.monotonic()
            for sock in [s for s, d in deadlines.items() if d <= now]:
                self._drop(selector, deadlines, sock)

    def _drop(self, selector, deadlines: dict, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):  # one never registered
            selector.unregister(sock)
        del deadlines[sock]
        sock.close()
        with self._lock:
            self._lingering -= 1


class CappedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer on a socket bound before it (`bound`), with at most
    `max_connections` connections open; one more is answered 503 at once."""

    bound: socket.socket
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    request_queue_size = ACCEPT_BACKLOG

    def __init__(self, server_address, handler_class):
        # The socket mlx_lm.server's address would give is replaced by the one
        # bound at start: a port in use was refused before the model loaded.
        super().__init__(server_address, handler_class, bind_and_activate=False)
        self.socket.close()
        self.socket = self.bound
        self.server_address = self.socket.getsockname()
        host, port = self.server_address[:2]
        self.server_name, self.server_port = socket.getfqdn(host), port  # as HTTPServer.server_bind
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._held: dict[int, _Slot] = {}  # a connection's slot, by its socket's id, until its thread takes it
        self._held_lock = threading.Lock()
        self._refusals = _Refusals()
        message = (
            f"the server has {self.max_connections} connections open, the most it takes (--max-connections): "
            "try again shortly"
        )
        self._refusal = answer(503, "Service Unavailable", message, "too_many_connections", retry_after=1)
        try:
            self.server_activate()  # listens: clients are taken from now on
        except BaseException:
            self.server_close()
            raise

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refusals.refuse(request, self._refusal, self.max_connections)
            return
        slot = _Slot(self._slots)
        with self._held_lock:
            self._held[id(request)] = slot
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            # A signal's KeyboardInterrupt can come while the thread starts: the
            # thread may run all the same, and the slot is given back once, by
            # whichever gets there first (given back twice, the semaphore raised
            # a ValueError that hid the interrupt, and the server went on).
            with self._held_lock:
                self._held.pop(id(request), None)
            slot.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        with self._held_lock:
            slot = self._held.pop(id(request), None)
        try:
            super().process_request_thread(request, client_address)
        finally:
            if slot is not None:
                slot.release()


class _Slot:
    """One connection's place under --max-connections, given back once."""

    def __init__(self, slots: threading.BoundedSemaphore):
        self._slots, self._lock, self._held = slots, threading.Lock(), True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._slots.release()


def capped_server(bound: socket.socket, max_connections: int, header_timeout: float) -> type[CappedServer]:
    """The server class to hand mlx_lm.server's _run_http_server (it takes a class
    and builds the server from host and port itself): a CappedServer on `bound`."""
    settings = {"bound": bound, "max_connections": max_connections, "header_timeout": header_timeout}
    return type("StoreServer", (CappedServer,), settings)
