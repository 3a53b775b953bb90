"""Help: every command listed with one line, each with a whole description and
examples; internal entry points never show; `python -m promptstore` works."""

from __future__ import annotations

import re
import subprocess
import sys

from promptstore.cli import COMMANDS

from .conftest import REPO, cli_env


def test_python_dash_m_promptstore_lists_every_command_on_one_line(cli):
    proc = cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    out = proc.stdout
    assert out.startswith("usage: promptstore ")
    assert "SUPPRESS" not in out and "demo-phase" not in out
    listed = dict(re.findall(r"^    (\S+)\s+(.+)$", out, flags=re.M))
    assert set(listed) == {"demo", "generate", "chat", "stats", "serve", "compact"}
    for name, line in listed.items():
        summary = next(c.summary for c in COMMANDS if c.name == name)
        assert line == summary, f"{name}'s help line is wrapped or cut: {line!r}"
    assert "examples:" in out


def test_each_command_has_a_description_and_examples(cli):
    for command in COMMANDS:
        proc = cli(command.name, "--help")
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert out.startswith(f"usage: promptstore {command.name} ")
        description = out.split("\n\n")[1]
        assert description.endswith("."), f"{command.name}: description cut: {description!r}"
        assert "\nexamples:\n  promptstore " + command.name in out
        assert "--debug" in out


def test_compact_help_names_the_command_it_was_called_as(cli):
    via_cli = cli("compact", "--help").stdout
    assert via_cli.startswith("usage: promptstore compact [-h] [--store STORE]")
    tool = subprocess.run(
        [str(REPO / "tools" / "compact"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert tool.returncode == 0, tool.stderr
    assert tool.stdout.startswith("usage: tools/compact [-h] [--store STORE]")
    for out, prog in ((via_cli, "promptstore compact"), (tool.stdout, "tools/compact")):
        # The whole description, to its last sentence, and the exit codes.
        assert "compacts the LMDB index. It runs while other processes use the store" in out
        assert "that need the store idle are skipped then, and reported.\n" in out
        # One table of exit statuses: routine upkeep is clean, damage is repaired.
        assert "\n  0  clean     the store is healthy: nothing to do, or routine upkeep" in out
        assert "\n  1  repaired  damage found and repaired" in out and "\n  2  failed  " in out
        assert 'A dry run changes nothing and says "would"' in out
        assert f"\n  {prog} --verify" in out


def test_help_fits_eighty_columns(tmp_path):
    for args in (["--help"], *([c.name, "--help"] for c in COMMANDS)):
        proc = subprocess.run(
            [sys.executable, "-m", "promptstore", *args],
            capture_output=True,
            text=True,
            env=cli_env(tmp_path),
            timeout=60,
        )
        assert max(len(line) for line in proc.stdout.splitlines()) <= 80, args
