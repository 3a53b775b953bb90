"""docs/benchmarks.md from the result files under bench-results/: the side-by-side
runs (anchors/report.py), the servers side by side (serve_docs.py) and the GPU
runs of the cold tier and of a server restart (gpu_docs.py), one page.

    python tools/bench/benchmarks_doc.py

prints the tables of bench-results/serve-cpu.json and serve-cuda.json and
rewrites docs/benchmarks.md (every section of it); `bench_anchors.py
--docs-only` rewrites the page alone. The three renderers import nothing of
each other: this module is the one that puts their sections together."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors.report import markdown_doc  # noqa: E402
from gpu_docs import HistoryUnreadable  # noqa: E402
from gpu_docs import sections as gpu_sections  # noqa: E402
from serve_docs import RESULTS, print_report  # noqa: E402
from serve_docs import sections as serve_sections  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_docs() -> int:
    """Rewrite docs/benchmarks.md from every result file; 1 (the page left as it is) when there is none,
    or when a file the page renders from git history cannot be read."""
    results = REPO_ROOT / "bench-results"
    docs = {}
    for label, fname in (
        ("CPU (MLX CPU backend)", "anchors-cpu.json"),
        ("NVIDIA GPU (MLX CUDA backend)", "anchors-cuda.json"),
    ):
        p = results / fname
        if p.exists():
            docs[f"{label}: `bench-results/{fname}`"] = json.loads(p.read_text())
    if not docs:
        print("no result files to document", file=sys.stderr)
        return 1
    try:
        gpu = gpu_sections(results)
    except HistoryUnreadable as e:
        print(f"docs/benchmarks.md not rewritten: {e}", file=sys.stderr)
        return 1
    target = REPO_ROOT / "docs" / "benchmarks.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    later = "\n\n".join(part for part in (serve_sections(results), gpu) if part)
    target.write_text(markdown_doc(docs, later))
    print(f"wrote {target.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    for name, _ in RESULTS:
        path = REPO_ROOT / "bench-results" / name
        if path.exists():
            print(f"== {name}")
            print_report(json.loads(path.read_text()))
    sys.exit(write_docs())
