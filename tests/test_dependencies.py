"""The dependency rule (docs/design.md, "Packages and the dependency rule"), checked on the code itself.

`april` <- `broker`, `actors`, `learner` <- `cli`: the shared core imports no role, and roles never import
each other, not even inside a function (a lazy import is still a dependency). Heavy frameworks stay out of
import time: importing any module of `april/` or `broker/` loads neither torch nor transformers.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("april", "broker", "actors", "learner", "cli")
ALLOWED = {  # package -> the project packages it may import (itself included)
    "april": {"april"},
    "broker": {"april", "broker"},
    "actors": {"april", "actors"},
    "learner": {"april", "learner"},
    "cli": set(PACKAGES),
}


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import of a project package in `path`, anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in PACKAGES]
    return found


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_role_imports_another_role(package: str) -> None:
    broken = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in modules(package)
        for line, target in project_imports(path)
        if target not in ALLOWED[package]
    ]
    assert not broken, "the dependency rule is broken:\n" + "\n".join(broken)


def test_the_rule_sees_a_lazy_import_inside_a_function(tmp_path: Path) -> None:
    """The scanner itself: an import inside a function body counts as much as one at the top."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from actors.worker import Worker\n    import broker.server\n")
    assert project_imports(source) == [(2, "actors"), (3, "broker")]


def test_the_shared_core_and_the_broker_import_no_torch() -> None:
    names = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for package in ("april", "broker")
        for path in modules(package)
    ]
    script = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stdout
