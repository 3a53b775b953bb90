"""A compact that tools/soak.py (and test_compact_crash) SIGKILLs at a random instant.

Run as: python _compact_worker.py STORE_DIR MAX_BYTES
It imports everything, prints "imported", waits for "go" on stdin (so the kill
lands in compact's work, not in Python's imports), prints "started", runs
compact(verify=True, max_bytes=MAX_BYTES) and prints "done <status>".
"""

from __future__ import annotations

import sys


def main(store_dir: str, max_bytes: int) -> int:
    from promptstore.store.compact import compact

    print("imported", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    print("started", flush=True)
    report = compact(store_dir, verify=True, max_bytes=max_bytes)
    print(f"done {report.status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
