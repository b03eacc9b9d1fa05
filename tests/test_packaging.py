"""Packaging guards: the generic top-level names import from this repository, the console script is
declared, the broker and protocol core stay free of torch, and no code path can unpickle or eval."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("april", "broker", "actors", "learner", "cli")


def pyproject() -> dict[str, Any]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize("name", PACKAGES)
def test_package_imports_from_this_repository(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None, f"{name} is a namespace package, not this repository's"
    assert Path(module.__file__).resolve().parent.parent == REPO, module.__file__


def test_setuptools_finds_the_five_and_every_subpackage() -> None:
    from setuptools import find_packages

    include = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(str(REPO), include=include))
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts)
        for root in PACKAGES
        for init in (REPO / root).rglob("__init__.py")
    }
    assert {p.split(".")[0] for p in found} == set(PACKAGES)
    assert found == on_disk  # subpackages (actors.engines) included, nothing else picked up


def test_console_script_april() -> None:
    scripts = pyproject()["project"]["scripts"]
    assert scripts["april"] == "cli.main:main"
    module_name, _, attr = scripts["april"].partition(":")
    target = getattr(importlib.import_module(module_name), attr)
    assert callable(target)


def test_broker_and_core_never_import_torch() -> None:
    code = (
        "import broker.server, april.protocol, april.policy, cli.main; "
        "import sys; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def _sources() -> list[Path]:
    files = sorted(p for name in PACKAGES for p in (REPO / name).rglob("*.py"))
    assert files
    return files


def _forbidden(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "pickle"
            ]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] == "pickle":
                found.append((node.lineno, f"from {node.module} import ..."))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("eval", "exec")
        ):
            found.append((node.lineno, f"{node.func.id}(...)"))
    return found


def test_checker_catches_what_it_looks_for() -> None:
    tree = ast.parse(
        "import pickle\nfrom pickle import loads\nimport os, pickle as p\neval('1')\nexec('x=1')\n"
    )
    assert [line for line, _ in _forbidden(tree)] == [1, 2, 3, 4, 5]
    assert _forbidden(ast.parse("import pickletools\nx.eval()\nmodel.exec()\n")) == []


def test_no_pickle_eval_or_exec_in_the_packages() -> None:
    hits = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in _sources()
        for line, what in _forbidden(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    ]
    assert not hits, "\n".join(hits)
