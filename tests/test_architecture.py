"""The module map in docs/architecture.md is true of the code, and imports point one way.

Every import counts: at module level, inside functions, and under TYPE_CHECKING
(a type named across a circle ties the two modules as surely as a call does).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "promptstore"
TOOLS = ROOT / "tools"
MAP = ROOT / "docs" / "architecture.md"

# What each part of the package may import from promptstore (besides itself), bottom-up:
# caches, index -> snapshots -> store -> generation, console -> serve/, demo,
# compact_cli -> cli. Leaf modules (errors, identity, config) import nothing above them.
# What sits on the store reaches the tiers and the index only through promptstore.store.
LAYERS = {
    "errors": set(),
    "identity": set(),
    "config": {"errors"},
    "caches": {"errors"},
    "index": {"errors", "identity"},
    "snapshots": {"caches", "errors", "identity"},
    "store": {"caches", "index", "snapshots", "errors", "identity", "config"},
    "generation": {"caches", "store", "errors", "config"},
    "vision": {"caches", "store", "errors", "config"},
    "console": {"store", "errors", "config"},
    "testing": {"caches", "errors", "identity", "config"},
    "serve": {"generation", "vision", "console", "store", "caches", "errors", "identity", "config"},
    "demo": {"generation", "console", "store", "caches", "testing", "errors", "config"},
    "compact_cli": {"console", "store", "errors", "config"},
    "cli": {"serve", "demo", "compact_cli", "generation", "console", "store", "caches", "errors", "identity", "config"},
    "__main__": {"cli"},
    "__init__": set(),  # the public names load lazily, by the name of their part
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
            base = None
            if node.level == 0:
                base = node.module or ""
            elif node.level > depth:  # relative, reaching the package root
                base = f"promptstore.{node.module}" if node.module else "promptstore"
            if base == "promptstore":  # `from .. import caches`: the names are the parts
                names = [f"promptstore.{a.name}" for a in node.names]
            elif base is not None:
                names = [base]
        for name in names:
            bits = name.split(".")
            if bits[0] == "promptstore" and len(bits) > 1:
                parts.add(bits[1])
    return parts


def test_imports_point_one_way():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part(path)
        assert part in LAYERS, f"{path.relative_to(ROOT)}: part {part!r} has no row in LAYERS"
        extra = _imported_parts(path) - LAYERS[part] - {part}
        if extra:
            wrong.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_what_sits_on_the_store_reaches_it_only_through_store():
    above = ("generation", "vision", "console", "serve", "demo", "compact_cli", "cli", "__main__")
    reaching = {part: sorted(LAYERS[part] & {"snapshots", "index"}) for part in above}
    assert not any(reaching.values()), f"parts above the store allowed its internals: {reaching}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports (a name
    imported from a package counts as its module where it is one)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    bits = package.split(".")
                    base = ".".join(bits[: len(bits) - node.level + 1] + ([node.module] if node.module else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    order, low, on_stack, stack, circles = {}, {}, set(), [], []
    for root in graph:
        if root in order:
            continue
        work = [(root, iter(sorted(graph[root])))]
        order[root] = low[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in order:
                    order[step] = low[step] = len(order)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], order[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circles():
    graph = _module_graph()
    assert graph["promptstore.store.space"], "the graph found no imports: the test reads nothing"
    circles = _circles(graph)
    assert not circles, "modules that import each other, directly or around a circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _tools_graph() -> dict[str, set[str]]:
    """Each module under tools/ (named by its path there) -> the modules under tools/ it imports.

    A script imports its neighbours as top-level modules (its folder is on sys.path when it
    runs: `from common import ...` in tools/bench, `from soaks.disk_full import ...` in
    tools/soak.py), and a module of a package (a folder with __init__.py) imports as its
    script does, or relatively. So an absolute name resolves against the folder above the
    module's outermost package, a relative one against its package; names that resolve to
    no file there (the standard library, promptstore, tests) are not tools' and are left out."""
    files = {p: str(p.relative_to(TOOLS).with_suffix("")) for p in TOOLS.rglob("*.py") if "__pycache__" not in p.parts}

    def resolve(base: Path, dotted: str) -> Path | None:
        target = base.joinpath(*dotted.split(".")) if dotted else base
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            if candidate in files:
                return candidate
        return None

    graph = {}
    for path, name in files.items():
        package = path.parent
        top = package
        while (top / "__init__.py").exists():
            top = top.parent
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {resolve(top, a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = top
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.parent
                module = node.module or ""
                for a in node.names:  # a name imported from a package counts as its module where it is one
                    found.add(resolve(base, f"{module}.{a.name}" if module else a.name) or resolve(base, module))
        graph[name] = {files[p] for p in found if p is not None and p != path}
    return graph


def test_no_import_circles_in_tools():
    graph = _tools_graph()
    # Each way a name resolves, seen once: a neighbour, a package's module from its script, a module
    # of the script's folder from inside a package, and a relative import.
    for module, imported in (
        ("bench/bench_anchors", "bench/common"),
        ("soak", "soaks/disk_full"),
        ("bench/anchors/ceilings", "bench/common"),
        ("bench/anchors/report", "bench/anchors/goals"),
    ):
        assert imported in graph[module], f"the graph misses {module} -> {imported}: the test reads too little"
    circles = _circles(graph)
    assert not circles, "modules under tools/ that import each other, directly or around a circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )
