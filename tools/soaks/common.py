"""What every section of the soak shares: the repository's root, the budget of
cases or minutes, and how failures are named and tallied."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the test helpers are imported from it

TOL = 1e-4


def now() -> float:
    return time.monotonic()


class Budget:
    """A count of cases, or a time limit when minutes are given."""

    def __init__(self, count: int, minutes: float | None):
        self.count, self.deadline = count, (now() + 60 * minutes) if minutes else None
        self.done = 0

    def more(self) -> bool:
        if self.deadline is not None:
            return now() < self.deadline
        return self.done < self.count


def print_tallies(result: dict) -> None:
    """A damage section's escapes, compact's errors (where it ran compact alone) and cases by damage."""
    for k, v in result["escapes"].items():
        print(f"    escaped ({v} times): {k}")
    for k, v in result.get("compact_errors", {}).items():
        print(f"    compact ({v} times): {k}")
    for k, v in result["by_damage"].items():
        print(f"    {k:32s} {v}")


def signature(e: BaseException) -> str:
    """Exception type plus the innermost promptstore frame: groups equal failures."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "promptstore" in f.filename]
    where = f" at {'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}{where}"
