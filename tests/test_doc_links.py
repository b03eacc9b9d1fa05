"""The documentation points only at things that exist in the repository.

Checked in README.md, benchmarks/README.md and docs/*.md: every relative Markdown link resolves to a
tracked file (and its `#anchor` to a heading of that file), every backticked repository path
(`learner/loop.py`, `docs/bench.md`, ...) exists, and every named function or test
(`tests/x.py::test_y`) is defined.
Nothing in the repository may point at the first plan, which lives outside it (`DESIGN.md`, `shared/`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
TOP_DIRS = (
    "april",
    "broker",
    "actors",
    "learner",
    "cli",
    "tests",
    "benchmarks",
    "docs",
    "workloads",
    "compose",
    "models",
)
REPO_PATH = re.compile(
    r"`((?:" + "|".join(TOP_DIRS) + r")/[A-Za-z0-9_./-]+\.(?:py|md|toml|txt|json|yml|yaml|jsonl|png|svg))"
    r"(?:::(\w+))?"
)


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    ).stdout  # new files of a change not yet committed count too
    return set(out.split()) | set(untracked.split())


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return {slug(line.lstrip("#")) for line in lines if re.match(r"#{1,6} ", line)}


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    files = tracked()
    broken = []
    for match in LINK.finditer(doc.read_text(encoding="utf-8")):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if path_part and (not dest.is_relative_to(ROOT) or rel(dest).rstrip("/") not in files | dirs(files)):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, f"{rel(doc)}:\n" + "\n".join(broken)


def dirs(files: set[str]) -> set[str]:
    return {str(Path(f).parent) for f in files}


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_named_path_and_test_exists(doc: Path) -> None:
    files = tracked()
    broken = []
    for match in REPO_PATH.finditer(doc.read_text(encoding="utf-8")):
        path, test = match.group(1), match.group(2)
        if path not in files:
            broken.append(f"{path}: not in the repository")
        elif test and not re.search(rf"^\s*def {test}\b", (ROOT / path).read_text(encoding="utf-8"), re.M):
            broken.append(f"{path}::{test}: no such function")
    assert not broken, f"{rel(doc)}:\n" + "\n".join(broken)


def test_nothing_points_outside_the_repository() -> None:
    offenders = []
    for name in sorted(tracked()):
        path = ROOT / name
        if name == "tests/test_doc_links.py" or path.suffix not in {".py", ".md", ".toml", ".yml", ""}:
            continue
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if "DESIGN.md" in line or "shared/reference" in line:
                offenders.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not offenders, "references to files outside the repository:\n" + "\n".join(offenders)


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The link and anchor rules themselves, on a made-up page."""
    assert slug("10. Modes and aborts, seen from the wire") == "10-modes-and-aborts-seen-from-the-wire"
    assert slug("`april up`") == "april-up"
    page = "see [x](missing.md) and [y](#nope) and `learner/nothing_here.py`"
    targets = [m.group(1) for m in LINK.finditer(page)]
    assert targets == ["missing.md", "#nope"]
    assert [m.group(1) for m in REPO_PATH.finditer(page)] == ["learner/nothing_here.py"]
