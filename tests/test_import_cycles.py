"""No import in `april/` goes round a cycle, not even a lazy one inside a function.

The graph is read with `ast`, never by importing: every `import` and `from ... import` of an `april`
module, at any depth of a module (imports under `if TYPE_CHECKING:` only are left out: they never run).
`from P import N` is an edge to the module P.N when N is one, else to P. The finder is first shown a
cycle it must report, on a tree written to tmp_path.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root/package."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under an `if TYPE_CHECKING:` block."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skipped.update(id(n) for n in ast.walk(stmt))
    return skipped


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports."""
    mods = modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` above this module's
                    parent = here[: len(here) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in mods:
                        graph[name].add(target)
                    elif base in mods:
                        graph[name].add(base)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle found by a depth-first search, as the path that closes it (first module repeated)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_finder_reports_a_lazy_cycle_and_ignores_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("def f():\n    from pkg.env import E\n")
    (pkg / "env.py").write_text("from .data import records\n")
    (pkg / "data" / "records.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import env\nfrom pkg import data\n"
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.env"] == {"pkg.data.records"}
    assert graph["pkg.data.records"] == {"pkg.data"}  # the TYPE_CHECKING import is left out
    assert cycles(graph) == [["pkg.data", "pkg.env", "pkg.data.records", "pkg.data"]]


def test_april_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, "april")
    assert len(graph) > 30  # the tree was read
    found = cycles(graph)
    assert not found, "import cycles in april/: " + "; ".join(" -> ".join(c) for c in found)
