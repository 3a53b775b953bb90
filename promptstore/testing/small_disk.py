"""A small filesystem of its own for a store that runs out of disk: a tmpfs
mounted on a folder (which takes root, or CAP_SYS_ADMIN), filled up with a
ballast file and given back on demand. For tests and the soak's disk_full
section: the disk says ENOSPC as a real one does, at whatever write meets it.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

CHUNK = 1 << 16


class SmallDiskUnavailable(RuntimeError):
    """This process may not mount a filesystem here (not root, or in a container without the right)."""


class SmallDisk:
    """A tmpfs of `size` bytes mounted on `path` (created) until close()."""

    def __init__(self, path: str | os.PathLike, size: int):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._mount(["-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(self.path)])
        self.ballast = self.path / "ballast"

    def _mount(self, args: list[str]) -> None:
        try:
            done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SmallDiskUnavailable(f"mount: {e}") from None
        if done.returncode != 0:
            raise SmallDiskUnavailable(f"mount {' '.join(args)}: {done.stderr.strip() or done.returncode}")

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 0) -> int:
        """Take all space but about `leave` bytes with the ballast; returns its size."""
        with open(self.ballast, "ab") as f:
            block = b"\0" * CHUNK
            while self.free_bytes() > leave + CHUNK:
                try:
                    f.write(block)
                    f.flush()
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
        return self.ballast.stat().st_size

    def free(self) -> None:
        """Give the ballast's space back."""
        self.ballast.unlink(missing_ok=True)

    def resize(self, size: int) -> None:
        """The filesystem's size, grown or shrunk (not below what it holds)."""
        self._mount(["-o", f"remount,size={size}", str(self.path)])

    def close(self) -> None:
        """Unmount (lazily, if a process still has files open there)."""
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30, check=False)

    def __enter__(self) -> SmallDisk:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
