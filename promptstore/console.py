"""How the command line talks to a person: progress of long work on stderr
(live bars on a terminal, a few plain lines otherwise) and one line per error
instead of a traceback. Library code only logs; this module renders."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich import progress as rp
from rich.console import Console

from .errors import ModelPathError, StoreDirectoryError

# Off a terminal (a log file, a pipe), a running task prints a line at most this often.
PLAIN_EVERY_S = 10.0
# A task that ends sooner says nothing when it ends (unless it said something before).
QUIET_UNDER_S = 1.0
# A status for every failure of a command that is not a usage error.
FAILED = 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (and where to get help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def describe(error: BaseException) -> str:
    """An exception as one line: what was wrong (promptstore's errors also say what was expected)."""
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    elif type(error).__module__.startswith("promptstore"):
        text = str(error)
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def guarded(command: Callable[[], int], prog: str, debug: bool, failed: int = FAILED) -> int:
    """Run `command`; any exception becomes one line on stderr and the `failed` status."""
    try:
        return command()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every failure, not only ours: a person gets one line, --debug the traceback
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {describe(e)}", file=sys.stderr)
        return failed


def setup_logging(prog: str, debug: bool = False) -> None:
    """promptstore's log records as `prog: warning: ...` lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Lines(prog))
    logger = logging.getLogger("promptstore")
    logger.handlers = [handler]
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
    logger.propagate = False


class _Lines(logging.Formatter):
    def __init__(self, prog: str):
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.prog}: {record.levelname.lower()}: {' '.join(record.getMessage().split())}"


def existing_store(path: str | Path) -> Path:
    """`path` if a store lives there; commands that only read or repair never create one."""
    from .store.compact import existing_store as check  # the library's rule (imported late: MLX)

    return check(path)


def store_path(path: str | None) -> Path:
    """The store directory a command opens: `path`, else the default. A file there is refused
    up front (opening would fail later with a less clear message)."""
    from .store import default_path

    root = Path(path) if path else default_path()
    if root.exists() and not root.is_dir():
        raise StoreDirectoryError(f"{root} is a file; expected a store directory (or a path to create one at)")
    return root


class Task:
    """One piece of long work: `update` it as it advances."""

    def __init__(self, progress: Progress, description: str, total: int | None, unit: str):
        self.progress, self.total, self.unit = progress, total, unit
        self.label = self.description = description
        self.completed = 0
        self.started = self.said = time.monotonic()
        self.spoke = False
        self.id = None

    def update(
        self,
        completed: int | None = None,
        *,
        total: int | None = None,
        advance: int = 0,
        description: str | None = None,
    ) -> None:
        self.total = self.total if total is None else total
        self.description = description or self.description
        self.completed = (self.completed if completed is None else completed) + advance
        self.progress._show(self)

    def counts(self) -> str:
        done = _amount(self.completed, self.unit)
        if self.total is None:
            return f"{done} {self.unit}".rstrip() if self.completed else ""
        return f"{done}/{_amount(self.total, self.unit)} {self.unit}".rstrip()


class Progress:
    """Progress of long work on stderr: live bars on a terminal; elsewhere a line
    now and then while a task runs. A task that took a second or more says so
    when it ends."""

    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self.live = enabled and self.console.is_terminal and not self.console.is_dumb_terminal
        self._bars: rp.Progress | None = None
        self._open = 0
        self._lock = threading.Lock()

    @contextmanager
    def task(self, description: str, total: int | None = None, unit: str = "") -> Iterator[Task]:
        task = Task(self, description, total, unit)
        self._start(task)
        try:
            yield task
        except BaseException:
            self._finish(task, failed=True)  # the error line says the rest
            raise
        self._finish(task)

    def _start(self, task: Task) -> None:
        if not self.live:
            return
        with self._lock:
            if self._bars is None:
                self._bars = rp.Progress(
                    rp.SpinnerColumn(),
                    rp.TextColumn("{task.description}"),
                    rp.BarColumn(bar_width=24),
                    rp.TextColumn("{task.fields[counts]}"),
                    rp.TimeElapsedColumn(),
                    console=self.console,
                    transient=True,
                    # Results go to stdout: never pass them through the stderr display.
                    redirect_stdout=False,
                    redirect_stderr=False,
                )
                self._bars.start()
            self._open += 1
            task.id = self._bars.add_task(task.description, total=task.total, counts=task.counts())
            self._bars.refresh()

    def _show(self, task: Task) -> None:
        if not self.enabled:
            return
        if task.id is not None:
            self._bars.update(
                task.id, completed=task.completed, total=task.total, description=task.description, counts=task.counts()
            )
        elif not self.live and time.monotonic() - task.said >= PLAIN_EVERY_S:
            task.said, task.spoke = time.monotonic(), True
            self._line(f"{task.description}: {task.counts()}")

    def _finish(self, task: Task, failed: bool = False) -> None:
        if not self.enabled:
            return
        seconds = time.monotonic() - task.started
        if task.id is not None:
            with self._lock:
                self._bars.remove_task(task.id)
                self._open -= 1
                if self._open == 0:
                    self._bars.stop()
                    self._bars = None
        if failed or (seconds < QUIET_UNDER_S and not task.spoke):
            return
        line = f"{task.label}: {task.counts() or 'done'} in {seconds:.1f} s"
        if task.id is None:
            self._line(line)
        else:
            self.console.print(f"[dim]{line}[/]", highlight=False)

    def _line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def _amount(value: int | None, unit: str) -> str:
    # A task counted in bytes is shown in MiB.
    if value is None:
        return "?"
    return f"{value / 2**20:.1f}" if unit == "MiB" else f"{value:,}"


def prefill_callback(task: Task) -> Callable[[int, int], None]:
    """A `prompt_progress_callback` (mlx-lm's name) that advances `task`."""
    return lambda processed, total: task.update(processed, total=total)


def close_store(store, progress: Progress) -> None:
    """Close `store`, showing the spill of what only memory holds (close writes it all)."""
    dirty = store.only_in_memory()
    total = sum(dirty.values())
    if not dirty:
        store.close()
        return
    with progress.task(
        f"writing {len(dirty)} snapshot{'s' * (len(dirty) != 1)} to disk", total=total, unit="MiB"
    ) as task:
        keys, done = set(dirty), threading.Event()

        def poll() -> None:
            while not done.wait(0.2):
                task.update(total - sum(n for key, n in store.only_in_memory().items() if key in keys))

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        try:
            store.close()
        finally:
            done.set()
            watcher.join(timeout=1.0)
        task.update(total)


def model_dir(path: str) -> Path:
    """A local MLX model directory, or a typed error: nothing is ever downloaded."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ModelPathError(f"--model {path}: no such directory; expected a local MLX model directory")
    if not (root / "config.json").is_file():
        raise ModelPathError(f"--model {path}: no config.json there; expected a local MLX model directory")
    return root.resolve()
