"""page_cache.resident_bytes: the kernel's answer in one call where it has
cachestat, the same answer through mincore where it has not."""

from __future__ import annotations

import os
import sys

import pytest

from promptstore.snapshots import page_cache

PAGE = os.sysconf("SC_PAGE_SIZE")


def written(path, nbytes: int):
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    return path


def dropped(path) -> None:
    """Drop the file's pages where the kernel lets an unprivileged caller (not on tmpfs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def both(path) -> tuple[int | None, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return page_cache.cachestat_pages(fd), page_cache.mincore_pages(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_a_file_just_written_is_resident_and_both_ways_agree(tmp_path):
    path = written(tmp_path / "f", 5 * PAGE + 7)
    assert page_cache.resident_bytes(path) == 5 * PAGE + 7
    stat, mapped = both(path)
    assert mapped == 6
    assert stat in (None, mapped)  # None: a kernel without cachestat


def test_dropped_pages_are_counted_out_the_same_both_ways(tmp_path):
    path = written(tmp_path / "f", 64 * PAGE)
    dropped(path)
    with open(path, "rb") as f:
        f.seek(8 * PAGE)
        f.read(4 * PAGE)  # these pages come back (with whatever the kernel reads ahead)
    stat, mapped = both(path)
    assert 4 <= mapped <= 64
    assert stat in (None, mapped)
    assert page_cache.resident_bytes(path) == mapped * PAGE


def test_without_cachestat_mincore_answers(tmp_path, monkeypatch):
    path = written(tmp_path / "f", 3 * PAGE)
    monkeypatch.setattr(page_cache, "_cachestat", False)
    monkeypatch.setattr(page_cache, "cachestat_pages", lambda fd: pytest.fail("asked a kernel without it"))
    assert page_cache.resident_bytes(path) == 3 * PAGE


@pytest.mark.skipif(sys.platform != "linux", reason="cachestat is Linux's")
def test_a_kernel_without_cachestat_is_not_asked_again(tmp_path, monkeypatch):
    path = written(tmp_path / "f", PAGE)
    monkeypatch.setattr(page_cache, "_cachestat", True)
    monkeypatch.setattr(page_cache, "CACHESTAT", -1)  # no such call: ENOSYS, as an older kernel answers
    assert page_cache.resident_bytes(path) == PAGE  # through mincore
    assert page_cache._cachestat is False


def test_what_cannot_be_told(tmp_path):
    assert page_cache.resident_bytes(tmp_path / "missing") is None
    (tmp_path / "empty").touch()
    assert page_cache.resident_bytes(tmp_path / "empty") == 0
    os.symlink(written(tmp_path / "f", PAGE), tmp_path / "link")
    assert page_cache.resident_bytes(tmp_path / "link") is None  # a link is never followed
