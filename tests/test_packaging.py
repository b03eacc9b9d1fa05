"""Packaging guards: the generic top-level names import from this repository, the console script is
declared, the broker and protocol core stay free of torch, and no code path can unpickle or eval: no
pickle/marshal/shelve/dill, no eval/exec, no zmq send_pyobj/recv_pyobj, torch.load only with
weights_only=True, yaml.load only with a safe Loader, np.load never with allow_pickle."""

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
        "import broker.server, april.protocol, broker.policy, cli.main; "
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


UNSAFE_MODULES = ("pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle")
UNSAFE_CALLS = ("eval", "exec")
UNSAFE_METHODS = ("send_pyobj", "recv_pyobj", "unsafe_load", "full_load")  # zmq's pickle, yaml's loaders
SAFE_YAML_LOADERS = ("SafeLoader", "CSafeLoader", "BaseLoader")


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _unsafe_call(call: ast.Call) -> str | None:
    """Why a call can run a peer's (or a file's) code, or None. `torch.load` must pass weights_only=True,
    `yaml.load` a safe Loader, `np.load` no allow_pickle=True."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in UNSAFE_CALLS:
        return f"{func.id}(...)"
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value.id if isinstance(func.value, ast.Name) else ""
    if func.attr in UNSAFE_METHODS:
        return f"{owner or '...'}.{func.attr}(...)"
    if (owner, func.attr) == ("torch", "load"):
        only = _keyword(call, "weights_only")
        return (
            None
            if isinstance(only, ast.Constant) and only.value is True
            else "torch.load without weights_only=True"
        )
    if (owner, func.attr) == ("yaml", "load"):
        loader = _keyword(call, "Loader")
        if loader is None and len(call.args) > 1:
            loader = call.args[1]
        name = loader.attr if isinstance(loader, ast.Attribute) else getattr(loader, "id", "")
        return None if name in SAFE_YAML_LOADERS else "yaml.load without a safe Loader"
    if (owner, func.attr) in (("np", "load"), ("numpy", "load")):
        allow = _keyword(call, "allow_pickle")
        return (
            "np.load(allow_pickle=...)"
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False)
            else None
        )
    return None


def _forbidden(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {a.name}")
                for a in node.names
                if a.name.split(".")[0] in UNSAFE_MODULES
            ]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in UNSAFE_MODULES:
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and (why := _unsafe_call(node)) is not None:
            found.append((node.lineno, why))
    return found


def test_checker_catches_what_it_looks_for() -> None:
    tree = ast.parse(
        "import pickle\nfrom pickle import loads\nimport os, pickle as p\neval('1')\nexec('x=1')\n"
        "import marshal\nfrom dill import loads\nsock.recv_pyobj()\ntorch.load(f)\n"
        "torch.load(f, weights_only=False)\nyaml.load(s)\nyaml.load(s, Loader=yaml.Loader)\n"
        "yaml.unsafe_load(s)\nnp.load(f, allow_pickle=True)\nimport cloudpickle\n"
    )
    assert sorted(line for line, _ in _forbidden(tree)) == list(range(1, 16))
    safe = (
        "import pickletools\nx.eval()\nmodel.exec()\ntorch.load(f, weights_only=True)\n"
        "yaml.load(s, Loader=yaml.SafeLoader)\nyaml.safe_load(s)\nnp.load(f)\n"
        "np.load(f, allow_pickle=False)\njson.load(f)\nsafetensors.torch.load_file(p)\n"
    )
    assert _forbidden(ast.parse(safe)) == []


def test_no_pickle_eval_or_exec_in_the_packages() -> None:
    hits = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in _sources()
        for line, what in _forbidden(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    ]
    assert not hits, "\n".join(hits)
