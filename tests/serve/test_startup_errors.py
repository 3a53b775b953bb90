"""`promptstore serve` refused at start: one error line (no traceback) and a
non-zero exit for a store path that is a file, a store that cannot be written
(on a read-only filesystem, or without write permission), and a port in use;
each found before the model loads (and the port before the store opens).

A read-only filesystem is a tmpfs mounted read-only. The permission case, as
root (whom mode bits do not stop), runs the server without the capabilities
that let root write anywhere, else as the unprivileged uid 65534; as another
user a folder of mode 0555 is enough. A case none of these can make is skipped,
saying why."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from promptstore.errors import StoreNotWritableError
from promptstore.store import PromptStore

from .conftest import free_port

EXIT_S = 60.0  # the longest a refused start may take before the test fails (it takes the imports' ~2 s)
COMMAND_S = 30.0  # mount, umount, setpriv probes
NOBODY = 65534
# Root without these may write only where the mode bits let its uid (0) write.
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
PROBE = "import os, sys, promptstore.serve.server; sys.exit(os.access(sys.argv[1], os.W_OK))"


def serve(model: Path, store: Path, port: int, prefix: Sequence[str] = ()) -> tuple[int, str, float]:
    """(exit code, stdout and stderr together, seconds) of a `promptstore serve` start."""
    cmd = [*prefix, sys.executable, "-m", "promptstore", "serve", "--model", str(model)]
    cmd += ["--store", str(store), "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    started = time.monotonic()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=EXIT_S)
    return done.returncode, done.stdout, time.monotonic() - started


def refused(code: int, out: str) -> str:
    """The one error line of a refused start (the model not loaded: nothing else was said)."""
    assert code != 0, out
    assert "Traceback" not in out, out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert lines[0].startswith("promptstore serve: error: "), out
    return lines[0]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_S)


def make_store(root: Path) -> None:
    PromptStore.open(root, warm_start=False).close()


# --- a file ------------------------------------------------------------------------------------


@pytest.mark.parametrize("under", [False, True], ids=["the path", "a folder above it"])
def test_a_store_path_that_is_a_file_is_refused_in_one_line(model_dir, tmp_path, under):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a store")
    store = blocker / "store" if under else blocker
    line = refused(*serve(model_dir(), store, free_port())[:2])
    assert line.endswith(f"{blocker} is a file, not a folder")
    assert blocker.read_text() == "not a store"


# --- a store that cannot be written --------------------------------------------------------------


@contextmanager
def read_only_filesystem(where: Path, with_store: bool) -> Iterator[Path]:
    """A tmpfs mounted at `where`, read-only (after a store was made in it, with_store)."""
    where.mkdir()
    mounted = run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(where)])
    if mounted.returncode != 0:
        raise PermissionError(mounted.stderr.strip() or "mount failed")
    try:
        if with_store:
            make_store(where)
        remounted = run(["mount", "-o", "remount,ro", str(where)])
        assert remounted.returncode == 0, remounted.stderr
        yield where
    finally:
        if run(["umount", str(where)]).returncode != 0:
            run(["umount", "-l", str(where)])  # still busy: detached now, freed when let go


@contextmanager
def without_write_permission(model: Path, with_store: bool) -> Iterator[tuple[Path, Path, list[str]]]:
    """(a store folder of mode 0555, the model, the command prefix of a server that
    may not write it). Skips when this process can make no such server."""
    base = Path(tempfile.mkdtemp(prefix="promptstore-unwritable-"))
    try:
        folder = base / "store"
        folder.mkdir(mode=0o700)
        if with_store:
            make_store(folder)
        if os.geteuid() != 0:
            folder.chmod(0o555)
            yield folder, model, []
            return
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: no server can be kept from writing a folder")
        # The probe exits 0 where the server runs and may not write the folder
        # (setpriv without CAP_SETPCAP keeps root's capabilities, and says nothing).
        probe = [sys.executable, "-c", PROBE, str(folder)]
        folder.chmod(0o555)
        if run([*NO_OVERRIDE, *probe]).returncode == 0:
            yield folder, model, NO_OVERRIDE
            return
        # uid 65534 needs its own store folder and a model it can read.
        base.chmod(0o755)
        readable = shutil.copytree(model, base / "model")
        for path in (folder, *folder.rglob("*")):
            os.chown(path, NOBODY, NOBODY)
        tried = run([*AS_NOBODY, *probe])
        if tried.returncode != 0:
            pytest.skip(
                "no mount, no dropping root's capabilities, and uid 65534 cannot run this Python "
                f"({(tried.stderr.strip().splitlines() or ['it could write the folder'])[-1]})"
            )
        yield folder, readable, AS_NOBODY
    finally:
        for path in (base, *base.rglob("*")):
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o700)
        shutil.rmtree(base, ignore_errors=True)


READ_ONLY = "a read-only filesystem"
NO_PERMISSION = "no write permission"


@pytest.mark.parametrize("with_store", [False, True], ids=["an empty folder", "an existing store"])
@pytest.mark.parametrize("how", [READ_ONLY, NO_PERMISSION])
def test_a_store_that_cannot_be_written_is_refused_in_one_line(model_dir, tmp_path, how, with_store):
    model = model_dir()
    if how == READ_ONLY:
        try:
            with read_only_filesystem(tmp_path / "mnt", with_store) as folder:
                line = refused(*serve(model, folder, free_port())[:2])
            assert line.endswith(
                f"{folder} is on a read-only filesystem; a store writes its lock, index and files there"
            )
            return
        except PermissionError as e:
            # Not allowed to mount here: the same refusal, met through permissions instead.
            reason = f"cannot mount a tmpfs ({e})"
    else:
        reason = None
    with without_write_permission(model, with_store) as (folder, readable, prefix):
        before = sorted(p.name for p in folder.iterdir())
        line = refused(*serve(readable, folder, free_port(), prefix)[:2])
        assert f"{folder} is not writable by this user" in line, reason
        assert sorted(p.name for p in folder.iterdir()) == before  # nothing written


def test_the_library_raises_a_typed_error_for_a_read_only_store(tmp_path):
    try:
        with read_only_filesystem(tmp_path / "mnt", with_store=True) as folder:
            with pytest.raises(StoreNotWritableError, match="read-only filesystem"):
                PromptStore.open(folder)
            with pytest.raises(StoreNotWritableError, match="Read-only file system"):
                PromptStore.open(folder / "new")
    except PermissionError as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the permission case covers the typed error")


# --- a port in use ---------------------------------------------------------------------------------


def test_a_port_in_use_is_refused_before_the_store_opens(model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, _ = serve(model_dir(), tmp_path / "store", port)
    line = refused(code, out)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line
    assert "--port" in line
    assert not (tmp_path / "store").exists()  # refused before the store opened, and so before the model loaded


# --- a sharded start -----------------------------------------------------------------------------


def test_a_sharded_start_with_a_remote_tier_is_refused_before_the_store_opens(model_dir, tmp_path):
    """Under mlx.launch (two ranks of the ring backend, on this machine) a store of
    the group's shards has no remote tier yet: each rank says so in one line and
    exits 2, before its store opens."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        pytest.skip("mlx.launch is not installed beside this Python")
    cmd = [str(launcher), "--backend", "ring", "-n", "2", "--starting-port", str(free_port()), "--"]
    cmd += [sys.executable, "-m", "promptstore", "serve", "--model", str(model_dir()), "--store", str(tmp_path / "s")]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port()), "--remote-url", "redis://127.0.0.1:1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=EXIT_S)
    # mlx.launch exits 0 whatever its ranks did: it says how each ended (the first to
    # exit with 2, the other stopped by the launcher then).
    assert "exited with code 2" in done.stdout, done.stdout
    said = [line for line in done.stdout.splitlines() if "promptstore serve: error: " in line]
    assert said and all("no remote tier yet" in line for line in said), done.stdout
    assert "Traceback" not in done.stdout
    assert not (tmp_path / "s" / "ranks").exists()
