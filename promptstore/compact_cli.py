"""`tools/compact` and `promptstore compact`: keep a store within budget, repair
what crashes left, verify it, and report.

Exit codes: 0 clean (nothing to do), 1 repaired (changes made, or due in a dry
run), 2 failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn
from rich.table import Table

EXIT = {"clean": 0, "repaired": 1, "failed": 2}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compact", description=__doc__.splitlines()[0])
    p.add_argument("--store", help="store directory (default: $PROMPTSTORE_HOME or the user cache)")
    p.add_argument("--max-bytes", type=int, help="disk budget for snapshot files (default: the store's setting)")
    p.add_argument("--verify", action="store_true", help="read every file and check its checksums")
    p.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    p.add_argument("--no-lmdb", action="store_true", help="skip the compacting copy of the index")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def run(argv=None) -> int:
    from .config import Settings
    from .store import default_path
    from .store.compact import compact

    args = parser().parse_args(argv)
    path = args.store or str(default_path())
    budget = args.max_bytes if args.max_bytes is not None else Settings.from_env().disk_bytes
    console = Console(stderr=args.json)
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), console=console, transient=True, disable=args.json
    ) as progress:
        task = progress.add_task("compacting")
        report = compact(
            path,
            max_bytes=budget,
            verify=args.verify,
            dry_run=args.dry_run,
            lmdb=not args.no_lmdb,
            tick=lambda step: progress.update(task, description=step),
        )
    if args.json:
        print(json.dumps({**asdict(report), "status": report.status}, indent=2))
    else:
        _print(console, report)
    return EXIT[report.status]


def _print(console: Console, report) -> None:
    title = "compact (dry run: nothing changed)" if report.dry_run else "compact"
    table = Table(title=title)
    for col in ("", "nodes", "files", "bytes"):
        table.add_column(col, justify="right")
    table.add_row("before", *(str(report.before.get(k, 0)) for k in ("nodes", "files", "bytes")))
    for reason, row in report.actions.items():
        table.add_row(reason, str(row["nodes"]), str(row["files"]), str(row["bytes"]))
    table.add_row("after", *(str(report.after.get(k, 0)) for k in ("nodes", "files", "bytes")))
    console.print(table)
    for line in report.skipped:
        console.print(f"skipped: {line}")
    for line in report.errors:
        console.print(f"[red]error:[/] {line}")
    console.print(f"{report.status} in {report.seconds:.2f} s")


if __name__ == "__main__":
    sys.exit(run())
