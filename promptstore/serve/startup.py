"""What `promptstore serve` makes sure of before the store opens and the model
loads, so that a start that cannot succeed ends at once in one line. The store's
own checks (a file, a read-only or unwritable folder) are PromptStore.open's,
which serve calls before the model loads too."""

from __future__ import annotations

import errno
import logging
import os
import socket

import mlx.core as mx

from ..errors import ServeConfigError
from ..store.group import Group

log = logging.getLogger("promptstore.serve")

# What to do about the errors bind() meets most.
HINTS = {
    errno.EADDRINUSE: "; another process listens there: stop it or choose another --port",
    errno.EACCES: "; ports below 1024 need privileges: choose another --port",
    errno.EADDRNOTAVAIL: "; --host is not an address of this machine",
}


def serve_group(pipeline: bool) -> Group | None:
    """This process's rank of a distributed group (mlx.launch starts one process
    per rank; mlx-lm's provider loads each its shard of the model, tensor parallel
    unless `pipeline`), or None alone. Each rank keeps its own store under --store
    (store/group.py); rank 0 answers HTTP, and every rank runs each request."""
    group = Group.of(mx.distributed.init(), "pipeline" if pipeline else "tensor")
    if group is not None:
        for handler in logging.getLogger().handlers:  # every rank's lines go to one launcher's output
            handler.setFormatter(logging.Formatter(f"%(asctime)s - rank {group.rank} - %(levelname)s - %(message)s"))
        log.info("group: rank %d of %d (%s parallel), process %d", group.rank, group.size, group.kind, os.getpid())
    return group


def listening_socket(host: str, port: int) -> socket.socket | None:
    """The HTTP server's socket, bound to host:port now (connections.CappedServer
    listens on it once the model is loaded: until then a client is refused, as
    before), or ServeConfigError when the address cannot be had. None on the
    ranks of a distributed run other than the first, which serve no HTTP."""
    if not 0 <= port <= 65535:  # getaddrinfo would take 99999 and bind another port
        raise ServeConfigError(f"--port {port}: give 0 to 65535")
    if mx.distributed.init().rank() != 0:
        return None
    try:
        # As mlx_lm.server's _run_http_server resolves it: the first address found.
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ServeConfigError(f"--host {host!r}: not an address to listen on ({why})") from None
    sock = socket.socket(family, kind, proto)
    try:
        # As http.server's HTTPServer does: a port whose last connections are
        # still closing (TIME_WAIT, a restart) can be bound at once. A port
        # another process listens on is refused all the same.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = HINTS.get(e.errno, "")
        raise ServeConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock
