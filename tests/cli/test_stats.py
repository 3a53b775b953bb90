"""`promptstore stats`: totals for an operator, one namespace for the holder of
its salt, nothing of other tenants; never creates a store."""

from __future__ import annotations

import json

from .conftest import error_after_progress, one_line_error


def stats(cli, *args) -> dict:
    proc = cli("stats", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_stats_never_creates_a_store(cli, tmp_path):
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    for path in (missing, empty):
        line = one_line_error(cli("stats", "--store", str(path)))
        assert (
            line
            == f"promptstore stats: error: no store at {path} (expected a directory a store was opened in); nothing was created"
        )
    assert not missing.exists() and list(empty.iterdir()) == []
    # The default store (the user cache, under this test's HOME) is not created either.
    assert "no store at" in one_line_error(cli("stats"))
    assert not (tmp_path / ".cache" / "promptstore").exists()


def test_operator_view_and_tenant_views(cli, tmp_path, model_dir):
    store = str(tmp_path / "s")
    (tmp_path / "a.salt").write_text("tenant-a-secret\n")
    (tmp_path / "b.salt").write_text("tenant-b-secret\n")
    system = tmp_path / "system.txt"
    system.write_text("The shop opens at nine. " * 20)
    ask = ["generate", "--model", str(model_dir), "--store", store, "--system-file", str(system), "-m", "3"]
    assert cli(*ask, "--prompt", "Hi", "--salt-file", str(tmp_path / "a.salt")).returncode == 0
    assert cli(*ask, "--prompt", "Hi again", "--salt-file", str(tmp_path / "a.salt")).returncode == 0
    assert cli(*ask, "--prompt", "Hello", "--salt-file", str(tmp_path / "b.salt")).returncode == 0

    totals = stats(cli, "--store", store)
    assert totals["view"] == "totals over every namespace"
    assert set(totals) == {
        "store",
        "view",
        "nodes",
        "tokens_stored",
        "nbytes",
        "hits",
        "misses",
        "tokens_served",
        "disk_written_bytes",
        "compact_written_bytes",
        "disk_read_bytes",
        "write_amplification",
        "index_bytes",
    }
    assert totals["hits"] == 1 and totals["misses"] == 2
    # Each generate closed its store, writing its nodes; the hit was served from a file.
    assert totals["disk_written_bytes"] >= totals["nbytes"] > 0 and totals["disk_read_bytes"] > 0
    assert totals["write_amplification"] == round(totals["disk_written_bytes"] / totals["disk_read_bytes"], 3)
    table = cli("stats", "--store", store).stdout
    assert (
        "namespace" not in table.replace("every namespace", "") and "span" not in table and str(model_dir) not in table
    )

    a = stats(cli, "--store", store, "--model", str(model_dir), "--salt-file", str(tmp_path / "a.salt"))
    b = stats(cli, "--store", store, "--model", str(model_dir), "--salt-file", str(tmp_path / "b.salt"))
    assert (a["hits"], a["misses"], b["hits"], b["misses"]) == (1, 1, 0, 1)
    assert a["namespace"] != b["namespace"]
    assert a["tokens_stored"] + b["tokens_stored"] == totals["tokens_stored"]
    assert b["namespace"] not in json.dumps(a) and a["namespace"] not in json.dumps(b)

    # By fingerprint: only with the salt that made it.
    by_hex = stats(cli, "--store", store, "--namespace", a["namespace"], "--salt-file", str(tmp_path / "a.salt"))
    assert by_hex == a
    wrong = one_line_error(
        cli("stats", "--store", store, "--namespace", a["namespace"], "--salt-file", str(tmp_path / "b.salt"))
    )
    no_salt = one_line_error(cli("stats", "--store", store, "--namespace", a["namespace"]))
    unsalted = error_after_progress(cli("stats", "--store", store, "--model", str(model_dir)))
    assert wrong == f"promptstore stats: error: no namespace of this model and salt in the store at {store}"
    assert no_salt == unsalted == f"promptstore stats: error: no namespace of this model in the store at {store}"
