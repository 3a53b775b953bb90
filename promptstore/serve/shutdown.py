"""How `promptstore serve` stops: SIGTERM and SIGINT (delivered where they
cannot leave a lock of logging's taken), the deadline after which it exits
anyway, the closing line that says what the close kept, and the exit itself."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("promptstore.serve")

RESIGNAL_SECONDS = 0.01  # a signal that lands inside logging is delivered again this much later,
RESIGNAL_TIMES = 100  # at most this many times in a row (a write to a full pipe can keep logging busy for ever)


installed: Shutdown | None = None  # the process's, once main() installed it


class Shutdown:
    """SIGTERM and SIGINT stop serving (as Ctrl-C does in mlx_lm.server); a
    second signal, or `timeout` seconds without finishing, exits at once.

    The signal raises KeyboardInterrupt in the main thread wherever it is, except
    inside logging: there it could leave a handler's lock taken (logging takes it
    before the `try` that gives it back, and a thread blocked waiting for it runs
    the handler as soon as it has it), and the next line another thread logs
    would wait forever (the warm start's last one did, with the store's close
    waiting for it). Such a signal is delivered again RESIGNAL_SECONDS later, at
    most RESIGNAL_TIMES times in a row; then it stops serving wherever it lands.

    While the store opens (`signals_postponed()`), a signal is acted on once it
    is open: the open starts the warm start's thread, and a KeyboardInterrupt
    between that and the store being in the caller's hands left nothing to close
    it (the process ended with the warm start cut off and the store never closed)."""

    def __init__(self, timeout: float):
        self.timeout, self.started, self.redelivered = timeout, False, 0
        self.postponing = self.pending = False
        self.own = False  # the server stops on its own (stop_serving): the next signal is not a second

    def stop_serving(self) -> None:
        """Stop serving from within (generation failed for good), as a signal does.
        A signal that comes meanwhile, as mlx.launch sends the other ranks of a
        group one of whose processes exited non-zero, is taken as the first."""
        self.own = True
        os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.contextmanager
    def signals_postponed(self):
        """A signal while the block runs stops serving when the block ends (its
        deadline starts at once); an exception of the block's own goes first."""
        self.postponing = True
        try:
            yield
        finally:
            self.postponing = False
        if self.pending:
            raise KeyboardInterrupt

    def install(self) -> None:
        global installed
        installed = self
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        if self.started and self.own:
            self.own = False
            log.warning("a signal while the server stops on its own: closing the store goes on")
            return
        if self.started:
            log.warning("second signal: exiting without closing the store")
            os._exit(1)
        if self.postponing:
            self.pending = True
            self.begin()
            return
        if _in_logging(frame) and self.redelivered < RESIGNAL_TIMES:
            self.redelivered += 1
            again = threading.Timer(RESIGNAL_SECONDS, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        self.begin()
        raise KeyboardInterrupt

    def begin(self) -> None:
        if not self.started:
            self.started = True
            timer = threading.Timer(self.timeout, self._expired)
            timer.daemon = True
            timer.start()

    def _expired(self) -> None:
        log.error("shutdown took over %.0f s: exiting without closing the store", self.timeout)
        os._exit(1)


def _in_logging(frame) -> bool:
    """Whether the code `frame` runs (or any code calling it) is the logging module's."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "logging":
            return True
        frame = frame.f_back
    return False


def closing_line(closed_inserts: tuple[int, list[str]] | None, store) -> str:
    """What the close kept: the inserts that waited at the signal (stored on the
    generation thread, or not, and which: `closed_inserts`), what the disk
    refused; "everything is on disk" only when nothing was lost."""
    stored, lost = closed_inserts or (0, [])
    said = []
    if stored or lost:
        said.append(
            f"{stored} waiting inserts stored" + (f", {len(lost)} not stored: {', '.join(lost)}" if lost else "")
        )
    nodes, nbytes = store.unwritten
    if nodes:
        said.append(f"{nodes} nodes ({nbytes / 1e6:.1f} MB) not written: the disk refused them, they are lost")
    declined, declined_bytes = store.declined
    if not lost and not nodes:
        said.append("everything is on disk" if not declined else "everything admitted is on disk")
    if declined:
        said.append(f"{declined} nodes ({declined_bytes / 1e6:.1f} MB) of one-off prompts not written (admit)")
    return "store closed: " + "; ".join(said)


def exit_now(code: int) -> None:
    """Exit without finalizing the interpreter. MLX keeps a compile cache per
    thread whose destructor calls into Python: the generation thread, joined
    but still tearing down, aborts the process if the interpreter finalizes
    meanwhile. Everything is closed by now."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
