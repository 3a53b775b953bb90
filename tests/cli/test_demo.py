"""The demo's table reads in an 80-column terminal, and says when its
no-store baseline is slow for want of OpenBLAS."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from promptstore.demo import DemoResult, blas_note, render

from .conftest import one_line_error


def result(blas: str = "MLX's bundled BLAS", device: str = "cpu") -> DemoResult:
    figures = [("no store", 0, 0, 0.876, 1.005, 1.0), ("fresh store", 11470, 0, 0.18, 0.836, 4.9)]
    figures.append(("restarted", 11389, 2200, 0.0012, 0.017, 730.0))
    rows = [
        {
            "run": run,
            "requests": 23,
            "prompt_tokens": 13612,
            "restored_hot": hot,
            "restored_cold": cold,
            "prefilled": 13612 - hot - cold,
            "ttft_mean_s": mean,
            "ttft_p95_s": p95,
            "speedup": speedup,
        }
        for run, hot, cold, mean, p95, speedup in figures
    ]
    return DemoResult(rows, [True, False], "a float32 random-weight llama (4 layers, hidden 256)", device, blas)


def rendered(r: DemoResult, width: int = 80) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    render(console, r)
    return console.export_text()


def test_the_table_fits_80_columns_whole():
    text = rendered(result())
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "…" not in text
    for cell in ("prompt", "tokens", "memory", "disk", "TTFT", "replies", "13,612", "11,389", "2,200", "730.0x", "NO"):
        assert cell in text
    header = next(line for line in text.splitlines() if line.startswith("run"))
    assert header.split() == ["run", "tokens", "memory", "disk", "filled", "mean", "p95", "-up", "replies"]


def test_without_openblas_on_cpu_the_demo_says_why_the_baseline_is_slow():
    text = " ".join(rendered(result()).split())
    assert "note: the no-store baseline ran on MLX's bundled reference BLAS" in text
    assert "For the fair baseline:" in text and "`make demo` preloads it" in text
    assert blas_note(result(blas="OpenBLAS")) is None
    assert blas_note(result(device="gpu")) is None


def test_save_model_refuses_a_directory_in_use(cli, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    line = one_line_error(cli("demo", "--save-model", str(tmp_path / "m")))
    assert line == (
        f"promptstore demo: error: {tmp_path / 'm'}: exists and is not an empty directory; expected a new one for the model"
    )
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_the_demo_end_to_end(cli, tmp_path):
    proc = cli("demo", "--json")
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    assert figures["replies_equal"] == [True, True]
    assert [r["run"] for r in figures["rows"]] == ["no store", "fresh store", "restarted"]
    assert figures["rows"][2]["prefilled"] < figures["rows"][1]["prefilled"] < figures["rows"][0]["prefilled"]
    assert "without a store: 23/23 requests in" in proc.stderr
