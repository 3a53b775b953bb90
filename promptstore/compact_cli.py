"""`tools/compact` and `promptstore compact`: keep a store within budget, repair
what crashes left, verify it, and report what changed.

Exit codes, as fsck's: 0 clean (healthy: nothing to do, or routine upkeep only),
1 repaired (damage found and repaired; in a dry run, found and due), 2 failed (an
error stopped a step, or compact itself). The table is EPILOG, shown by --help.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .config import warn_unknown_variables
from .console import ArgumentParser, Progress, guarded, setup_logging

EXIT = {"clean": 0, "repaired": 1, "failed": 2}

SUMMARY = "keep a store within its disk budget, repair and verify it"
DESCRIPTION = """\
Brings the snapshot files under the disk budget (evicting leaves, least valuable
first), reclaims what crashes leave (temporary files of dead writers, files no
index entry names, drifted counters), drops entries whose file is gone, merges
runs of single-child nodes, quarantines bad files (--verify reads them all), and
compacts the LMDB index. It runs while other processes use the store; the steps
that need the store idle are skipped then, and reported."""
EPILOG = """\
exit status (--json's "status" names it):
  0  clean     the store is healthy: nothing to do, or routine upkeep only:
               chains merged, leaves evicted over the budget, leftovers of
               crashed or racing writers reclaimed (temporary files of dead
               writers, orphan files no index entry names), counters
               recounted, index space compacted
  1  repaired  damage found and repaired: bad files (failing their checks
               when --verify or a merge reads them) and strays where a
               snapshot file belongs (a directory, FIFO or symlink)
               quarantined; index entries whose file is missing or whose data
               is nowhere, and corrupt index records, dropped; broken children
               entries rebuilt; a damaged index set aside
  2  failed    no store there, a damaged index (without --reset-index), a
               usage error, or a step that failed
A dry run changes nothing and says "would"; its status means what a run's
would (1: damage found that a run would repair). --json lists every action:
its kind, target, reason, whether it is damage, and whether it was done.

examples:
  {prog} --store ~/.cache/promptstore --dry-run
  {prog} --verify --max-bytes 20000000000
  {prog} --json > report.json"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="store directory (default: $PROMPTSTORE_HOME, else the user cache)")
    p.add_argument(
        "--max-bytes",
        type=_bytes,
        help="disk budget for each tenant's snapshot files (default: the disk_bytes setting)",
    )
    p.add_argument("--verify", action="store_true", help="read every file and check its checksums")
    p.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    p.add_argument("--no-lmdb", action="store_true", help="skip the compacting copy of the index")
    p.add_argument(
        "--reset-index",
        action="store_true",
        help="set a damaged (truncated) index aside and start an empty one; its files are reclaimed",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout (progress stays on stderr)")


def parser(prog: str = "tools/compact") -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description=f"{SUMMARY[0].upper()}{SUMMARY[1:]}.\n\n{DESCRIPTION}",
        epilog=EPILOG.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def _bytes(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of bytes, 0 or more")
    return value


def run(argv=None, prog: str = "tools/compact") -> int:
    """The command: parse `argv`, compact, report; every failure ends in one line and status 2."""
    args = parser(prog).parse_args(argv)
    return command(args, prog)


def command(args: argparse.Namespace, prog: str) -> int:
    setup_logging(prog, args.debug)
    warn_unknown_variables()
    return guarded(lambda: execute(args), prog, args.debug, failed=EXIT["failed"])


def execute(args: argparse.Namespace) -> int:
    """Compact the store `args` name and print the report; returns the exit status."""
    from .store import default_path
    from .store.group import rank_stores

    path = Path(args.store or default_path())  # compact refuses a path where no store lives
    ranks = [] if (path / "index").exists() else rank_stores(path)
    if ranks:  # a distributed group's folder: each rank's store, in turn; the worst status
        return max(_compact_one(rank, args, len(ranks)) for rank in ranks)
    return _compact_one(path, args)


def _compact_one(path: Path, args: argparse.Namespace, of: int = 1) -> int:
    from .config import Settings
    from .store.compact import compact

    budget = args.max_bytes if args.max_bytes is not None else Settings.from_env().disk_bytes
    with Progress().task("compacting", unit="items") as task:

        def tick(step: str) -> None:
            task.update(advance=1, description=f"compacting: {step}")

        report = compact(
            path,
            max_bytes=budget,
            verify=args.verify,
            dry_run=args.dry_run,
            lmdb=not args.no_lmdb,
            reset_index=args.reset_index,
            tick=tick,
        )
    if args.json:
        print(
            json.dumps(
                {"status": report.status, **({"store": str(path)} if of > 1 else {}), **asdict(report)}, indent=2
            )
        )
    else:
        if of > 1:  # one of a group's ranks' stores
            Console().print(f"store {path}", highlight=False, soft_wrap=True)
        _print(Console(), report)
    return EXIT[report.status]


def _print(console: Console, report) -> None:
    title = "compact --dry-run (nothing changed)" if report.dry_run else "compact"
    table = Table(title=title)
    for col in ("", "", "nodes", "files", "bytes"):
        table.add_column(col, justify="right")
    table.add_row("before", "", *(str(report.before.get(k, 0)) for k in ("nodes", "files", "bytes")))
    damage = {a.reason for a in report.log if a.damage}
    for reason, row in report.actions.items():
        what = "damage" if reason in damage else "routine"
        table.add_row(reason, what, str(row["nodes"]), str(row["files"]), str(row["bytes"]))
    table.add_row("after", "", *(str(report.after.get(k, 0)) for k in ("nodes", "files", "bytes")))
    console.print(table)
    if report.remote is not None:
        r = report.remote
        console.print(
            f"remote tier: {r['published']} blobs published ({r['published_bytes']} bytes), "
            f"{r['on_server'] if r['on_server'] is not None else '?'} still on the server, "
            f"{r['local_gone']} no longer held here",
            highlight=False,
        )
    for a in report.log:  # each repair by name; routine upkeep is in the table (and --json)
        if a.damage:
            line = f"{'' if a.done else 'would '}{a.kind}: {a.target} ({a.reason})"
            console.print(line, highlight=False, soft_wrap=True)  # one line each, for grep
    for line in report.skipped:
        console.print(f"skipped: {line}")
    for line in report.errors:
        console.print(f"[red]error:[/] {line}")
    console.print(_verdict(report), highlight=False, soft_wrap=True)


def _verdict(report) -> str:
    """The last line: the status, and what it means for this run."""
    status, seconds = report.status, f"{report.seconds:.2f} s"
    if status == "failed":
        return f"failed in {seconds}: a step failed (see the errors above)"
    if status == "repaired":
        if report.dry_run:
            return f"would repair (dry run, nothing changed; status 1) in {seconds}: damage found"
        return f"repaired in {seconds}: damage found and repaired"
    upkeep = "nothing to do" if not report.changed else "routine upkeep " + ("would run" if report.dry_run else "only")
    return f"clean{' (dry run, nothing changed)' if report.dry_run else ''} in {seconds}: healthy, {upkeep}"


if __name__ == "__main__":
    sys.exit(run())
