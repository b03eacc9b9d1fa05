"""`make gpu-wheels`: the wheels the lent GPU machine lacks for april, made here, checked complete.

The machine's image (Python 3.12, torch with CUDA, transformers, numpy, ...; no network) lacks what
`gpu.image.CARRIED` names. Each is pinned to the version this interpreter's environment (.venv) runs and
downloaded as a cp312 manylinux (or pure) wheel with `--no-deps`; DeepSpeed, an sdist, is built into a
py3-none-any wheel against this environment's torch (its ops compile at first use on the GPU machine).
pyarrow is not carried: its wheel alone is more than a device call carries with the tree, so a Parquet
or Arrow dataset there fails in one line. The folder is then checked: at most `MAX_BYTES`, one wheel a
package, every wheel's requirements met by the folder or the image (`IMAGE_HAS`), and the pure wheels
installed with pip into a scratch folder and imported from it, with april's modules, under this
interpreter (the binary ones are cp312 builds: only their tags are checked). `source.json` records the
commit the check will run from (the device receives a copy of the working tree without git). A folder
that already holds the pinned set is reused. Does not install anything into this environment and never
runs on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from gpu.image import BUILT, CARRIED, IMAGE_HAS, IMAGE_MARKERS  # noqa: E402

MAX_BYTES = 60 * 2**20
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
# (module, its wheel's distribution): imported from the scratch install to prove the wheel is whole
PURE_IMPORTS = (
    ("deepspeed", "deepspeed"),
    ("deepspeed.ops.adam", "deepspeed"),
    ("hjson", "hjson"),
    ("pydantic", "pydantic"),
    ("annotated_types", "annotated-types"),
    ("typing_inspection", "typing-inspection"),
    ("typing_extensions", "typing-extensions"),
    ("math_verify", "math-verify"),
    ("latex2sympy2_extended", "latex2sympy2-extended"),
    ("antlr4", "antlr4-python3-runtime"),
)
APRIL_MODULES = (
    "cli.main",
    "broker.server",
    "actors.worker",
    "actors.rewards",
    "learner.loop",
    "learner.engine",
)
IMPORT_CHECK = """
import importlib, json, sys
site, pure, april = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
outside = []
for module, _ in pure:
    m = importlib.import_module(module)
    if not str(m.__file__).startswith(site):
        outside.append(f"{module} from {m.__file__}")
for module in april:
    importlib.import_module(module)
import math_verify
assert math_verify.verify(math_verify.parse("$\\\\frac{1}{2}$"), math_verify.parse("$0.5$")), "math_verify"
print(json.dumps(outside))
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """Each carried package at the version this environment runs."""
    return {canonical(name): version(name) for name in (*CARRIED, BUILT)}


def wheel_name(path: Path) -> tuple[str, str, str]:
    """(canonical distribution name, version, tags) from a wheel's file name."""
    dist, ver, *rest = path.name[: -len(".whl")].split("-")
    return canonical(dist), ver, "-".join(rest)


def held(folder: Path) -> dict[str, str]:
    return {name: ver for name, ver, _ in map(wheel_name, sorted(folder.glob("*.whl")))}


def fetch(folder: Path, wanted: dict[str, str]) -> None:
    """Download the binary/pure wheels and build DeepSpeed's, into `folder`."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    specs = [f"{name}=={ver}" for name, ver in wanted.items() if name != BUILT]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [
            *pip,
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "--dest",
            str(folder),
            *specs,
        ],
        check=True,
    )
    subprocess.run(
        [
            *pip,
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(folder),
            f"{BUILT}=={wanted[BUILT]}",
        ],
        check=True,
    )


def requirement_gaps(folder: Path) -> list[str]:
    """Every requirement of a wheel (for CPython 3.12 on x86-64 Linux, no extras) that neither the folder
    nor the image provides."""
    from packaging.requirements import Requirement

    env = dict(IMAGE_MARKERS)
    have = set(held(folder)) | IMAGE_HAS
    gaps = []
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if (req.marker is None or req.marker.evaluate(env)) and canonical(req.name) not in have:
                gaps.append(f"{wheel.name} needs {req}")
    return gaps


def check(folder: Path, wanted: dict[str, str]) -> list[str]:
    """What is wrong with `folder` (empty: it is complete and fits)."""
    wheels = sorted(folder.glob("*.whl"))
    problems = []
    names = [wheel_name(w)[0] for w in wheels]
    problems += [f"two wheels of {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    have = held(folder)
    problems += [f"no wheel of {n}=={v}" for n, v in wanted.items() if have.get(n) != v]
    problems += [f"a wheel of {n}=={v} not asked for" for n, v in have.items() if wanted.get(n) != v]
    size = sum(w.stat().st_size for w in wheels)
    if size > MAX_BYTES:
        problems.append(f"{size / 2**20:.1f} MiB of wheels, expected at most {MAX_BYTES / 2**20:.0f} MiB")
    for w in wheels:
        tags = wheel_name(w)[2]
        if not (tags.endswith("none-any") or ("cp312" in tags and "x86_64" in tags and "manylinux" in tags)):
            problems.append(f"{w.name}: not a cp312 manylinux x86-64 or pure wheel")
    problems += requirement_gaps(folder)
    return problems or import_check(folder)


def import_check(folder: Path) -> list[str]:
    """Install the pure wheels with pip into a scratch folder; import them from it, and april's modules."""
    pure = [w for w in sorted(folder.glob("*.whl")) if wheel_name(w)[2].endswith("none-any")]
    with tempfile.TemporaryDirectory(prefix="april-gpu-wheels-") as site:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--target",
                site,
                *map(str, pure),
            ],
            check=True,
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((site, str(REPO)))}
        done = subprocess.run(
            [sys.executable, "-c", IMPORT_CHECK, site, json.dumps(PURE_IMPORTS), json.dumps(APRIL_MODULES)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        return [f"importing from the installed wheels failed: {done.stderr.strip()[-1500:]}"]
    outside = json.loads(done.stdout.strip().splitlines()[-1])
    return [f"{x}, not from the wheels" for x in outside]


def stamp(folder: Path) -> dict[str, object]:
    """source.json: the commit (and whether the tree differs from it) the GPU check will run from."""
    from april.provenance import commit

    head, dirty = commit()
    record = {"commit": head, "dirty": dirty}
    (folder / "source.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    folder: Path = args.folder
    wanted = pins()
    if not folder.is_dir() or check(folder, wanted):
        fresh = folder.with_name(folder.name + ".tmp")
        subprocess.run(["rm", "-rf", str(fresh)], check=True)
        fresh.mkdir(parents=True)
        fetch(fresh, wanted)
        problems = check(fresh, wanted)
        if problems:
            print("gpu-wheels: error: " + "; ".join(problems), file=sys.stderr)
            return 1
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        fresh.rename(folder)
    record = stamp(folder)
    wheels = sorted(folder.glob("*.whl"))
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{total:7.2f} MiB  in {len(wheels)} wheels, {folder}; source commit {record['commit']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
