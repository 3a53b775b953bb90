"""The cold tier: one safetensors file per stored node, shared by every process.

A file is named by its node key and a tag unique to the write that made it
(never by its span: a listing of the files tells no prompt's length), so no
file is ever overwritten in place (a split node gets new files, and two
processes spilling one node write two files, one of which the index names). It is written under a temporary name, fsynced, renamed and its
directory fsynced before anyone may point at it. Loading checks the
header, the node's identity and every array's xxh3-128 before a byte is used;
a file that fails is moved to quarantine for `tools/compact`. A node file's
bytes held in memory (a blob the remote tier fetched) pass the same checks
(`load_bytes`), no file written.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import xxhash
from pydantic import BaseModel, ConfigDict, ValidationError

from ..caches import FORMAT_VERSION, Snapshot, from_flat, to_flat
from ..caches.serialize import METADATA_KEY, READABLE_VERSIONS, parse_record
from ..errors import CacheError, ColdFileError, DiskWriteError
from ..identity import NodeId
from . import device, reader
from .pool import ProcessPool
from .safetensors_header import header_of_fd, open_regular
from .safetensors_writer import write_safetensors

log = logging.getLogger("promptstore.snapshots")

# What link(2) says where a filesystem has no hard links (or none across these names).
NO_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}

NODE_KEY = "promptstore.node"
SUFFIX = ".safetensors"
TEMP_MARK = ".tmp-"
TAG_BYTES = 4  # random bytes in a file's name, unique to the write that made it


class NodeFileMeta(BaseModel):
    """Who a file belongs to, and the checksum of each of its arrays."""

    model_config = ConfigDict(extra="forbid")
    format_version: int
    key: str
    namespace: str
    start: int
    end: int
    checksums: dict[str, str]
    record: str  # xxh3-128 of the snapshots' metadata record


@dataclass(frozen=True)
class FileRef:
    """A published cold file: its path relative to the tier root, size and digest."""

    path: str
    nbytes: int
    checksum: str


# Hashing runs on a few threads (xxhash releases the GIL): below this many bytes
# a file is hashed on the calling thread, where the hand-off would cost more.
PARALLEL_HASH_BYTES = 4 << 20
HASH_THREADS = min(8, os.cpu_count() or 1)
_hash_pool = ProcessPool(HASH_THREADS, "promptstore-hash")


def checksums(arrays: dict[str, mx.array], then: Callable[[list[mx.array]], object] | None = None) -> dict[str, str]:
    """checksum() of every array. Arrays MLX is still computing or loading
    (mx.async_eval) are waited for in turn, each hashed on the hashing threads
    as soon as it is there, while MLX goes on with the rest. `then` is called
    with each run of arrays once they are hashed (on a hashing thread)."""
    return start_checksums(arrays, then)()


def start_checksums(
    arrays: dict[str, mx.array], then: Callable[[list[mx.array]], object] | None = None
) -> Callable[[], dict[str, str]]:
    """checksums() begun on the hashing threads; the returned function waits for
    them. The caller may read the arrays meanwhile (the cold tier writes them)."""
    total = sum(a.nbytes for a in arrays.values())
    if len(arrays) < 2 or total < PARALLEL_HASH_BYTES:
        mx.eval(list(arrays.values()))
        sums = {name: checksum(a) for name, a in arrays.items()}
        if then is not None:
            then(list(arrays.values()))
        return lambda: sums
    pool = _hash_pool()
    # Work in runs of consecutive arrays, a few per thread, so that many small
    # arrays do not cost a wait and a hand-off each.
    share = max(total // (4 * HASH_THREADS), 1 << 20)
    pending, run, run_bytes = [], [], 0
    for i, (name, a) in enumerate(arrays.items()):
        run.append((name, a))
        run_bytes += a.nbytes
        if run_bytes >= share or i == len(arrays) - 1:
            mx.eval([x for _, x in run])
            views = [(n, _row_major_bytes(x)) for n, x in run]  # MLX work stays on this thread
            pending.append(pool.submit(_hash_run, views, [x for _, x in run], then))
            run, run_bytes = [], 0
    return lambda: {name: digest for f in pending for name, digest in f.result()}


def span_checksums(data: memoryview, spans: dict[str, tuple[int, int]]) -> dict[str, str]:
    """xxh3-128 of each span [lo, hi) of data, by name: on the hashing threads, a
    span each, when there is enough to share (as checksums() does for arrays)."""
    total = sum(hi - lo for lo, hi in spans.values())
    if len(spans) < 2 or total < PARALLEL_HASH_BYTES:
        return {name: xxhash.xxh3_128_hexdigest(data[lo:hi]) for name, (lo, hi) in spans.items()}
    pool = _hash_pool()
    pending = {name: pool.submit(xxhash.xxh3_128_hexdigest, data[lo:hi]) for name, (lo, hi) in spans.items()}
    return {name: done.result() for name, done in pending.items()}


def _hash_run(views: list[tuple[str, memoryview]], run: list[mx.array], then) -> list[tuple[str, str]]:
    digests = [(n, xxhash.xxh3_128_hexdigest(v)) for n, v in views]
    if then is not None:
        then(run)
    return digests


_staged_checked = False  # whether this process compared staged bytes with the arrays yet


def _hashed_as_written(
    arrays: dict[str, mx.array], staged: dict
) -> tuple[dict[str, Callable[[], Iterator[memoryview]]], Callable[[], dict[str, str]]]:
    """Each staged source hashing its chunks as the writer takes them (each
    chunk crosses from the device once), and a function giving checksum() of
    every array once all were taken. The first time in a process, the bytes at
    both ends of every array are then compared with the arrays' own: a
    difference stops staging and raises StagedElsewhere."""
    taken: dict[str, tuple] = {}

    def hashing(name: str, chunks: Callable[[], Iterator[memoryview]]) -> Callable[[], Iterator[memoryview]]:
        def each() -> Iterator[memoryview]:
            digest, end = xxhash.xxh3_128(), reader.Ends()
            for chunk in chunks():
                digest.update(chunk)
                end.add(chunk)
                yield chunk
            taken[name] = (digest.hexdigest(), end.value())

        return each

    checked: list[dict[str, str] | Exception] = []  # the outcome, once known

    def sums() -> dict[str, str]:
        global _staged_checked
        if taken.keys() != staged.keys():
            raise RuntimeError("checksums asked for before every staged array was written")
        if not checked:
            checked.append({n: digest for n, (digest, _) in taken.items()})
            if not _staged_checked:
                if reader.ends_match(arrays, {n: end for n, (_, end) in taken.items() if arrays[n].nbytes}):
                    _staged_checked = True
                else:
                    device.stop_staging("bytes staged from the device differ from the arrays'")
                    checked[0] = device.StagedElsewhere(device.staging_failed)
        if isinstance(checked[0], Exception):
            raise checked[0]
        return checked[0]

    return {name: hashing(name, chunks) for name, chunks in staged.items()}, sums


CHECKSUM_HEX = 32  # characters of an xxh3-128 digest in hex


def _wait_quietly(sums: Callable[[], dict[str, str]]) -> None:
    """Wait for checksums being computed, whatever they end in."""
    try:
        sums()
    except Exception:  # the write's own error is the one reported
        pass


def checksum(array: mx.array) -> str:
    """xxh3-128 of the array's bytes in row-major order."""
    return xxhash.xxh3_128_hexdigest(_row_major_bytes(array))


def _row_major_bytes(array: mx.array) -> memoryview:
    try:
        view = memoryview(array)  # MLX's buffer in place: no copy, bf16 included
        if view.c_contiguous:
            return view
    except BufferError:
        pass
    # A strided array (MLX may hand one over for a copy of a slice): the same
    # bytes, laid out row-major first.
    flat = mx.contiguous(array)
    mx.eval(flat)
    return memoryview(flat)


def checked_open(path: Path, rel: str) -> tuple[int, dict, dict, int]:
    """The file opened for reading, with its safetensors header, metadata and
    the offset its data starts at; or ColdFileError (nothing read past the
    header). The descriptor is the caller's to close."""
    try:
        kind = _kind(os.lstat(path).st_mode)
        if kind != "file":
            raise ColdFileError(f"{rel}: a {kind}, not a snapshot file", "not a file", rel)
        fd = open_regular(path)
    except FileNotFoundError:
        raise ColdFileError(f"{rel}: missing", "missing", rel) from None
    except OSError as e:
        raise ColdFileError(f"{rel}: unreadable: {e}", "unreadable", rel) from None
    except ValueError as e:
        raise ColdFileError(f"{rel}: bad header: {e}", "header", rel) from None
    try:
        return (fd, *header_of_fd(fd))
    except OSError as e:
        os.close(fd)
        raise ColdFileError(f"{rel}: unreadable: {e}", "unreadable", rel) from None
    except (ValueError, RecursionError) as e:
        os.close(fd)
        raise ColdFileError(f"{rel}: bad header: {e}", "header", rel) from None


def checked_identity(metadata, rel: str, node: NodeId) -> NodeFileMeta:
    """The file's node record, if it says the file holds `node`; else ColdFileError."""
    try:
        meta = NodeFileMeta.model_validate(json.loads(metadata.get(NODE_KEY, "")))
    except (ValidationError, ValueError, RecursionError):
        raise ColdFileError(f"{rel}: no valid node record", "header", rel) from None
    if meta.format_version not in READABLE_VERSIONS:
        raise ColdFileError(f"{rel}: format version {meta.format_version}", "version", rel)
    if (meta.key, meta.namespace, meta.start, meta.end) != (node.key.hex(), node.namespace.hex(), node.start, node.end):
        raise ColdFileError(
            f"{rel}: holds node {meta.key[:12]} [{meta.start}, {meta.end}) of namespace "
            f"{meta.namespace[:12]}, expected {node.key.hex()[:12]} [{node.start}, {node.end})",
            "identity",
            rel,
        )
    return meta


class PendingLoad:
    """A cold file being read; nothing of it is used before `result()` has
    checked its identity, record and every array's checksum. Several threads may
    wait on one load: the first verifies, the others get what it found.

    On CUDA promptstore's reading threads read the file (snapshots/reader.py):
    many arrays at once, each hashed as it is read and copied on to the GPU
    through pinned buffers. Elsewhere MLX's loader reads it on the CPU stream,
    into memory the model reads in place, and the arrays are hashed as MLX
    finishes them: there the reading threads would gain nothing, as MLX cannot
    make an array without filling it, and filling fresh memory costs what
    reading into it does.
    """

    def __init__(self, tier: ColdTier, rel: str, node: NodeId):
        self.rel, self.span = rel, (node.start, node.end)
        self.error: ColdFileError | None = None
        self.arrays: dict[str, mx.array] = {}
        self.read: reader.FileRead | None = None
        self._lock = threading.Lock()
        self._verified: list[Snapshot] | None = None
        try:
            self.path = tier.absolute(rel)
            fd, self.header, self.metadata, base = checked_open(self.path, rel)  # strict: a consistent layout only
        except ColdFileError as e:
            self.error = e
            return
        try:
            self.meta = checked_identity(self.metadata, rel, node)
            if parallel_reads():
                try:
                    self.read = reader.FileRead(fd, self.header, base)  # closes fd when its reads end
                    return
                except Exception as e:  # the device or MLX, not the file: MLX's loader reads it
                    return self._reader_failed(e)
            os.close(fd)
            self._mlx_load()
        except ColdFileError as e:
            if self.read is None:
                _close_quietly(fd)
            self.error = e

    def _reader_failed(self, e: Exception) -> None:
        """The reading threads failed for a reason not the file's: MLX's loader reads it."""
        self.read = None
        log.warning("%s: promptstore's reader failed (%s); MLX's loader reads it", self.rel, e)
        self._mlx_load()

    def _mlx_load(self) -> None:
        try:
            # On the CPU stream: MLX's I/O threads read the file into memory every
            # backend's device can use, in parallel, while the caller goes on.
            self.arrays = mx.load(str(self.path), stream=device.LOAD_STREAM)
            mx.async_eval(list(self.arrays.values()))
        except (RuntimeError, ValueError, OSError) as e:
            self.error = ColdFileError(f"{self.rel}: unreadable: {e}", "unreadable", self.rel)

    def result(self) -> list[Snapshot]:
        """The verified snapshots, or ColdFileError saying what is wrong."""
        with self._lock:
            if self._verified is None and self.error is None:
                try:
                    self._verified = self._verify()
                except ColdFileError as e:
                    self.error = e
                self.arrays, self.read = {}, None  # the snapshots hold what is needed
            if self.error is not None:
                raise self.error
            return self._verified

    def _verify(self) -> list[Snapshot]:
        rel, meta = self.rel, self.meta
        record = checked_record(rel, meta, self.header, self.metadata)
        sums = None
        if self.read is not None:
            try:
                self.arrays, sums = self.read.result()
            except OSError as e:  # the file, as the reading threads met it (ShortRead included)
                raise ColdFileError(f"{rel}: unreadable: {e}", "unreadable", rel) from None
            except Exception as e:  # the device or MLX, not the file
                self._reader_failed(e)
                if self.error is not None:
                    raise self.error from None
        if sums is None:
            try:
                # Each array hashed as soon as MLX has read it, then on its way to the GPU
                # (CUDA), before its first use; nothing reads it before the checks pass.
                sums = checksums(self.arrays, then=device.prefetch)
            except (RuntimeError, ValueError, OSError) as e:
                raise ColdFileError(f"{rel}: unreadable: {e}", "unreadable", rel) from None
        for name in self.arrays:
            if sums[name] != meta.checksums.get(name):
                raise ColdFileError(f"{rel}: array {name!r} fails its checksum", "checksum", rel)
        return checked_snapshots(rel, self.arrays, record, self.span)


# Whether cold files are read by promptstore's reading threads (None: on CUDA,
# when its runtime is reachable; True or False: always, never).
PARALLEL_READS: bool | None = None


def parallel_reads() -> bool:
    if PARALLEL_READS is not None:
        return PARALLEL_READS
    return reader.failed is None and device.runtime() is not None


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def checked_record(rel: str, meta: NodeFileMeta, header: dict, metadata: dict):
    """The snapshots record of a file whose node record names every array and
    the record's checksum; else ColdFileError."""
    if set(meta.checksums) != set(header):
        raise ColdFileError(f"{rel}: checksums do not name the file's arrays", "header", rel)
    if xxhash.xxh3_128_hexdigest(metadata.get(METADATA_KEY, "").encode()) != meta.record:
        raise ColdFileError(f"{rel}: the snapshot record fails its checksum", "checksum", rel)
    try:
        return parse_record(metadata)
    except CacheError as e:
        raise ColdFileError(f"{rel}: {e}", "format", rel) from None


def checked_snapshots(rel: str, arrays: dict[str, mx.array], record, span: tuple[int, int]) -> list[Snapshot]:
    """The snapshots of verified arrays, if they are what the record says and span `span`."""
    try:
        snapshots = from_flat(arrays, record)
    except CacheError as e:
        raise ColdFileError(f"{rel}: {e}", "format", rel) from None
    start, end = span
    if any(s is not None and (s.start, s.end) != (start, end) for s in snapshots):
        raise ColdFileError(f"{rel}: snapshots do not span [{start}, {end})", "identity", rel)
    return snapshots


class ColdTier:
    """Snapshot files under `root` (created private), in a two-level fan-out."""

    def __init__(self, root: str | os.PathLike, *, file_mode: int = 0o600, dir_mode: int = 0o700, fsync: bool = True):
        self.root = Path(root)
        self.file_mode, self.dir_mode, self.fsync = file_mode, dir_mode, fsync
        self.files = self.root / "files"
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.root, self.files, self.quarantine_dir):
            d.mkdir(mode=dir_mode, parents=True, exist_ok=True)
        self.resolved = self.root.resolve()
        device.prepare_staging()  # CUDA: what spills and reads use is built before the first one
        if parallel_reads():
            reader.prepare()

    # --- naming ----------------------------------------------------------------

    def _mkdirs(self, path: Path) -> None:
        # One level at a time: mkdir(parents=True) gives the parents the umask's mode.
        missing = []
        while not path.exists() and path != self.root:
            missing.append(path)
            path = path.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=self.dir_mode)
            except FileExistsError:
                pass

    def relative_path(self, node: NodeId, tag: str = "") -> str:
        """Where a file of `node` lives. `write` adds a tag of its own, so two writers
        of one node (two processes spilling it, two compacts joining it) never write,
        replace or delete each other's file."""
        h = node.key.hex()
        return f"files/{h[:2]}/{h[2:4]}/{h}{'-' + tag if tag else ''}{SUFFIX}"

    def owns(self, rel: str, node: NodeId) -> bool:
        """Whether `rel` is a name `write` gives to a file of this node (so the file
        may be quarantined for it; a record could name any file). Names written
        before spans left file names ("<key>-<start>-<end>[-<tag>]") count too."""
        stem = self.relative_path(node)[: -len(SUFFIX)]
        if not (rel.startswith(stem) and rel.endswith(SUFFIX)):
            return False
        rest = rel[len(stem) : -len(SUFFIX)]
        rest = rest.removeprefix(f"-{node.start}-{node.end}")
        return rest == "" or (rest[0] == "-" and _is_tag(rest[1:]))

    def absolute(self, rel: str) -> Path:
        """The file for a path from the index; never one outside the tier."""
        parts = Path(rel).parts
        if not parts or parts[0] != "files" or ".." in parts or Path(rel).is_absolute():
            raise ColdFileError(f"path {rel!r} is outside the store", "path", rel)
        return self.resolved / rel

    # --- writing ---------------------------------------------------------------

    def write(self, node: NodeId, snapshots: Sequence[Snapshot]) -> FileRef:
        """Write a node's snapshots durably; returns the ref to publish in the index."""
        arrays, metadata = to_flat(snapshots)
        mx.eval(list(arrays.values()))
        staged = device.staged_sources(arrays)  # CUDA: copied to the host by the copy engine
        if staged is not None:
            try:
                sources, sums = _hashed_as_written(arrays, staged)
                return self._write(node, arrays, metadata, sums, sources)
            except device.CudaError as e:  # the runtime, not the disk: host reads from now on
                device.stop_staging(str(e))
            except device.StagedElsewhere:
                pass  # staging is off for this process
        arrays = device.host_readable(arrays)  # on CUDA, the hot arrays stay on the device
        try:
            # Hashed on the hashing threads while they are written: the header,
            # which holds the checksums, goes in last.
            return self._write(node, arrays, metadata, start_checksums(arrays))
        finally:
            device.release_host_copies(arrays)

    def _write(
        self,
        node: NodeId,
        arrays: dict[str, mx.array],
        metadata: dict[str, str],
        sums: Callable[[], dict[str, str]],
        staged: dict | None = None,
    ) -> FileRef:
        """Write the file; `sums` waits for the arrays' checksums, which may be
        computed while the arrays are written (the header goes in after them)."""
        record = xxhash.xxh3_128_hexdigest(metadata[METADATA_KEY].encode())

        def with_record(checksums: dict[str, str]) -> dict[str, str]:
            meta = NodeFileMeta(
                format_version=FORMAT_VERSION,
                key=node.key.hex(),
                namespace=node.namespace.hex(),
                start=node.start,
                end=node.end,
                checksums=checksums,
                record=record,
            )
            return {**metadata, NODE_KEY: meta.model_dump_json()}

        # Every checksum is an xxh3-128 in hex: the header has its final length already.
        placeholder = with_record({name: "0" * CHECKSUM_HEX for name in arrays})
        named = [(name, a, staged[name] if staged else _row_major_bytes(a)) for name, a in arrays.items()]
        rel = self.relative_path(node, secrets.token_hex(TAG_BYTES))
        final = self.root / rel
        try:
            self._mkdirs(final.parent)
            temp = final.with_name(f"{final.stem}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.file_mode)  # private from the start
            try:
                size = write_safetensors(
                    fd, named, placeholder, durable=self.fsync, final_metadata=lambda: with_record(sums())
                )
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, final)
            self._sync_dir(final.parent)
        except OSError as e:
            self._discard(locals().get("temp"))
            _wait_quietly(sums)  # the hashing threads are done with the arrays before they go
            raise DiskWriteError(f"could not write {rel}: {e.strerror or e}") from e
        except BaseException:  # a source failed (device.CudaError): no half-written file stays
            self._discard(locals().get("temp"))
            _wait_quietly(sums)
            raise
        digest = xxhash.xxh3_128_hexdigest(json.dumps(sums(), sort_keys=True).encode())
        return FileRef(rel, size, digest)

    def link(self, rel: str, node: NodeId) -> str | None:
        """A second name for the file `rel` holding `node` (the node it was written
        for), in its folder: two records may then name one file's bytes, and each
        removes only its own name. Costs no data blocks. None where the filesystem
        has no hard links (FAT, exFAT) or `rel` is no name of `node`'s; the disk
        refusing even a folder entry is a DiskWriteError."""
        try:
            src = self.absolute(rel)
        except ColdFileError:
            return None
        new = self.relative_path(node, secrets.token_hex(TAG_BYTES))
        if Path(new).parent != Path(rel).parent:
            return None  # not a name this tier gave to a file of `node`
        try:
            os.link(src, self.root / new)
            self._sync_dir((self.root / new).parent)
        except OSError as e:
            self._discard(self.root / new)
            if e.errno in NO_LINKS:
                log.debug("no second name for %s: %s", rel, e)
                return None
            raise DiskWriteError(f"could not link {new}: {e.strerror or e}") from e
        return new

    def _sync_dir(self, path: Path) -> None:
        if self.fsync:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @staticmethod
    def _discard(path) -> None:
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    # --- reading ---------------------------------------------------------------

    def load(self, rel: str, node: NodeId) -> list[Snapshot]:
        """The node's verified snapshots, or ColdFileError saying what is wrong."""
        return self.start_load(rel, node).result()

    def start_load(self, rel: str, node: NodeId) -> PendingLoad:
        """Check the file's header and let MLX start reading it; `.result()` then
        verifies it. Starting the loads of several nodes before taking any
        result reads the files back to back while earlier ones are hashed."""
        return PendingLoad(self, rel, node)

    # --- housekeeping ----------------------------------------------------------

    def quarantine(self, rel: str, stray: bool = False) -> Path | None:
        """Move a bad snapshot file aside (never deleted silently), or whatever stands
        where one belongs (a directory, a FIFO, a symlink: the link itself); None if
        nothing is there or `rel` is no snapshot name of this tier (any name of
        iter_strays() when `stray`)."""
        try:
            src = self.absolute(rel)
        except ColdFileError:
            return None
        if not (stray or src.name.endswith(SUFFIX)) or not os.path.lexists(src):
            return None
        dst = self.quarantine_dir / f"{src.name}.{secrets.token_hex(3)}"
        try:
            os.replace(src, dst)
        except OSError:
            return None
        return dst

    def delete(self, rel: str) -> None:
        """Remove a file no record names; anything but a file there is quarantined."""
        try:
            os.unlink(self.root / rel)
        except FileNotFoundError:
            pass
        except (IsADirectoryError, PermissionError):  # unlink(2) of a directory: EISDIR, or EPERM
            self.quarantine(rel)

    def iter_files(self) -> Iterator[tuple[str, int]]:
        """(relative path, bytes) of every published file."""
        for rel, info in self._entries():
            if _kind(info.st_mode) == "file" and rel.endswith(SUFFIX) and TEMP_MARK not in rel:
                yield rel, info.st_size

    def iter_temp_files(self) -> Iterator[Path]:
        for rel, info in self._entries():
            if _kind(info.st_mode) == "file" and TEMP_MARK in rel:
                yield self.root / rel

    def iter_strays(self) -> Iterator[tuple[str, str]]:
        """(relative path, what it is) of what stands where a file or a fan-out
        directory belongs and is not one: never read, never deleted, only moved aside."""
        for rel, info in self._entries():
            kind = _kind(info.st_mode)
            depth = rel.count("/")
            if (depth < 3 and kind != "directory") or (depth == 3 and kind != "file" and rel.endswith(SUFFIX)):
                yield rel, kind

    def _entries(self) -> Iterator[tuple[str, os.stat_result]]:
        """(path relative to the tier, lstat) of every entry of the fan-out
        (files/xx/yy/name), never following a link; ones removed meanwhile are skipped."""
        stack = [(self.files, 1)]
        while stack:
            folder, depth = stack.pop()
            try:
                listing = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in listing:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield os.path.relpath(entry.path, self.root), info
                if depth < 3 and stat.S_ISDIR(info.st_mode):
                    stack.append((Path(entry.path), depth + 1))

    def disk_bytes(self) -> int:
        """Bytes of the published files, a file with two names (link) counted once."""
        seen: dict[tuple[int, int], int] = {}
        for rel, info in self._entries():
            if _kind(info.st_mode) == "file" and rel.endswith(SUFFIX) and TEMP_MARK not in rel:
                seen[(info.st_dev, info.st_ino)] = info.st_size
        return sum(seen.values())


def _is_tag(text: str) -> bool:
    return len(text) == 2 * TAG_BYTES and all(c in "0123456789abcdef" for c in text)


def _kind(mode: int) -> str:
    """What a directory entry is, in words."""
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "FIFO" if stat.S_ISFIFO(mode) else "special file"
