"""The index imports no MLX and nothing of promptstore beyond its leaf modules (errors, identity)."""

from __future__ import annotations

import ast
from pathlib import Path

import promptstore.index

PACKAGE = Path(promptstore.index.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_index_imports_no_mlx_and_no_sibling_package():
    for path in PACKAGE.glob("*.py"):
        for name in _imports(path):
            assert not name.startswith(("mlx", "mlx_lm")), (path.name, name)
            if name.startswith("promptstore"):
                assert name in ("promptstore.errors", "promptstore.identity"), (path.name, name)
