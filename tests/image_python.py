"""The lent GPU machine's Python, as far as a CPU can imitate it, for a test's child processes.

`image_env(folder)` is this environment with every module the image lacks made unimportable
(`benchmarks/gpu/image.py` says which: this environment's distributions that are neither the image's, nor
required by those, nor carried there by `make gpu-wheels`). Its PYTHONPATH starts with a folder holding a
`sitecustomize` that wraps every import finder so that a blocked top-level name is not found, as on the
image: `import uvicorn` raises ModuleNotFoundError("No module named 'uvicorn'") and
`importlib.util.find_spec` returns None. A copy vendored inside a package the image has (setuptools'
`_vendor` folder, on sys.path once setuptools is imported) is still found there. pytest's plugin
autoload is off (the image's pytest has no plugins; the ones here would be found by their entry points and
then fail to import). Package metadata is not hidden, and Python and torch stay this machine's: only what
is importable is imitated.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SITE = '''
import sys

BLOCKED = frozenset({blocked!r})


class _OnImage:
    """One of the import system's finders, finding nothing the GPU image lacks."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in BLOCKED:
            return self._finder.find_spec(name, path, target)
        if path is None:  # a package's vendored copy (setuptools' _vendor) goes where the package goes
            vendored = [p for p in sys.path if p.rstrip("/").endswith("/_vendor")]
            if vendored and getattr(self._finder, "__name__", "") == "PathFinder":
                return self._finder.find_spec(name, vendored, target)
        return None

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self._finder, attr)


sys.meta_path[:] = [_OnImage(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''


def absent_modules() -> list[str]:
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    image = importlib.import_module("gpu.image")
    modules: list[str] = image.absent_modules()
    return modules


def image_env(folder: Path) -> dict[str, str]:
    """os.environ for a child process that imports as the GPU image's python3 would (this tree first)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITE.format(blocked=sorted(absent_modules())), encoding="utf-8")
    path = (str(folder), str(REPO), os.environ.get("PYTHONPATH"))
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, path)),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
