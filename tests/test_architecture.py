"""The module map in docs/architecture.md is true of the code, and imports point one way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "promptstore"
MAP = ROOT / "docs" / "architecture.md"

# What each part of the package may import from promptstore (besides itself).
# Leaf modules (errors, identity, config) import nothing above them.
LAYERS = {
    "errors": set(),
    "identity": set(),
    "config": {"errors"},
    "caches": {"errors"},
    "index": {"errors", "identity"},
    "snapshots": {"caches", "errors", "identity"},
    "store": {"caches", "index", "snapshots", "errors", "identity", "config"},
    "generation": {"caches", "store", "errors", "config"},
}


def _modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def _mapped() -> list[str]:
    return re.findall(r"^\| `(promptstore/[^`]+\.py)` \|", MAP.read_text(), flags=re.M)


def test_every_module_has_a_row_and_every_row_a_module():
    mapped = _mapped()
    assert len(mapped) == len(set(mapped)), "a module is listed twice"
    missing = sorted(_modules() - set(mapped))
    stale = sorted(set(mapped) - _modules())
    assert not missing, f"modules without a row in docs/architecture.md: {missing}"
    assert not stale, f"rows in docs/architecture.md for modules that do not exist: {stale}"


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_parts(path: Path) -> set[str]:
    """The parts of promptstore a module imports (absolute or relative)."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 for a top-level module
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            elif node.level > depth:  # relative, reaching the package root
                names = [f"promptstore.{node.module}" if node.module else "promptstore"]
        for name in names:
            bits = name.split(".")
            if bits[0] == "promptstore" and len(bits) > 1:
                parts.add(bits[1])
    return parts


def test_imports_point_one_way():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part(path)
        if part not in LAYERS:
            continue  # the CLI, demo, serve and testing may use anything
        extra = _imported_parts(path) - LAYERS[part] - {part}
        if extra:
            wrong.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)
