"""`make gpu-check`: april's GPU path measured in one command on a lent GPU machine, into one artifact.

Phases, each in a child process with its own time budget (a timeout), run in this order while the
check's whole budget (`--budget-s`, 6 minutes) lasts; a phase that fails or times out records its error
and the next one runs (`benchmarks/gpu/`, one module a phase):
- `device`: the GPU's identity, its dense bf16 peak from the vendor's table, a large bf16 matmul timed;
- `learner-IMPL`: `learner.step.train_step` with DeepSpeed on a Qwen3-1.7B-shaped model (random weights,
  bf16) at 16 x 8k and 64 x 8k response tokens: step time, tokens/s, model-FLOPs utilisation with and
  without attention against both peaks, peak CUDA memory; one phase per `--adam-impls` entry, the
  second last, "if time allows";
- `up`: `april up --headless` for 3 steps on CUDA (torch engine, DeepSpeed learner): time to the first
  trained step, samples/s;
- `engine`: the torch engine's decode step at 1..64 rows (128-token prompts) on the shipped tiny model
  and a Qwen3-0.6B shape, and continuous batching against HF `generate` on long-tailed lengths;
- `gpu-tests`: `pytest -m gpu`, each outcome recorded as it comes;
- `up-placed`, on a machine of 2 GPUs or more, if time allows: `april up` placing the run on them itself
  (learner ranks on half, one torch engine per GPU of the rest), its `--plan` recorded with the run.
Before any phase runs, a `packages` preflight (`gpu.image`) prints one line per phase: what this Python
lacks for it; a phase that lacks a package it must have is an error without running. The first five
phases' budgets add up to the check's 6 minutes; the second learner runs only in what they leave.
Writes OUT/gpu_check.json (every phase's status, figures and errors; the targets met or not),
OUT/provenance.json (command, commit, GPU, driver, torch, CUDA, date) and OUT/gpu_check.log (each phase's
output); `benchmarks/results.py render` turns a committed copy in docs/results/gpu-check/ into the
"On a GPU" section of docs/bench.md. Exit 1 when a phase failed or timed out.
Usage: python benchmarks/gpu_check.py --out DIR [--adam-impls deepspeed,torch] [--engine-option K=V]
       python benchmarks/gpu_check.py --smoke --out DIR    # every phase at tiny size on the CPU (the suite)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu.flops import utilisation  # noqa: E402
from gpu.hardware import arch_list_for_deepspeed  # noqa: E402
from gpu.image import PHASE_NEEDS, preflight_line  # noqa: E402
from gpu.record import PhaseRecord, PhaseSkipped, read_record  # noqa: E402

from april.files import write_json  # noqa: E402
from april.provenance import provenance  # noqa: E402

SHOWN_OUT = "docs/results/gpu-check"  # where the artifact is meant to be committed
LOG_LINES = 400  # of each phase's output kept in gpu_check.log


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    module: str  # benchmarks/gpu/MODULE.py, whose run(params, record) measures
    budget_s: float  # its timeout
    least_s: float  # not started with less of the check's budget left
    params: dict[str, Any]
    gpus: int = 1  # skipped where the device phase saw fewer (a placed `april up` needs 2 or more)


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    path: tuple[str, ...]  # where the figure is in the artifact's phases
    unit: str
    at_most: float | None = None
    at_least: float | None = None

    def judge(self, phases: dict[str, Any]) -> dict[str, Any]:
        value: Any = phases
        for key in self.path:
            value = value.get(key) if isinstance(value, dict) else None
        met = None
        if isinstance(value, int | float):
            met = value <= self.at_most if self.at_most is not None else value >= (self.at_least or 0.0)
        limit = f"<= {self.at_most:g}" if self.at_most is not None else f">= {self.at_least:g}"
        return {"target": self.name, "limit": f"{limit} {self.unit}", "measured": value, "met": met}


TARGETS = (
    Target(
        "tiny model, decode step at 64 rows", ("engine", "result", "decode", "tiny", "ms_at", "64"), "ms", 2.0
    ),
    Target(
        "Qwen3-0.6B bf16, decode step at 64 rows",
        ("engine", "result", "decode", "qwen3-0.6b", "ms_at", "64"),
        "ms",
        8.0,
    ),
    Target(
        "continuous batching over HF generate, useful tokens/s",
        ("engine", "result", "batching", "ratio"),
        "x",
        at_least=5.0,
    ),
)


# Per phase: (budget s: its timeout, least s: not started with less of the check's budget left, params).
# Learner sizes: [samples, response tokens, warm-up steps, timed steps]; `threads`: torch's CPU threads
# (left to torch where absent). A phase also gets `device` and `timeout_s`, its time at the start.
# Full size: the first five phases' budgets are the 360 s; each is the phase's expected time with room
# (april up 3 steps on the tiny model: about 45 s; a 1.7B learner built and DeepSpeed set up: about 40 s,
# GPU-MACHINE.md), and `gpu-tests` runs the engine's graph checks and one `april up` on CUDA.
FULL: dict[str, tuple[float, float, dict[str, Any]]] = {
    "device": (30, 10, {"matmul_n": 8192, "matmul_reps": 20, "rounds": 3}),
    "learner": (
        115,
        60,
        {"shape": "qwen3-1.7b", "prompt": 64, "group": 4, "sizes": [[16, 8192, 1, 2], [64, 8192, 0, 1]]},
    ),
    "up": (80, 45, {"steps": 3, "sets": []}),
    "engine": (
        60,
        30,
        {
            "max_rows": 64,
            "prompt": 128,
            "repeats": 20,
            "decode": [{"name": "tiny", "dir": "models/tiny"}, {"name": "qwen3-0.6b", "shape": "qwen3-0.6b"}],
            "batching": {
                "model": "tiny",
                "n": 256,
                "slots": 64,
                "prompt_min": 16,
                "prompt_max": 64,
                "median": 32.0,
                "sigma": 0.9,
                "cap": 256,
            },
        },
    ),
    "gpu-tests": (75, 15, {}),
}
# The same code at sizes a loaded 2-core CPU runs in about a minute; the budgets are "did not hang" limits.
# `april up`'s learner is plain torch here: DeepSpeed's start-up is the learner phase's.
SMOKE: dict[str, tuple[float, float, dict[str, Any]]] = {
    "device": (60, 5, {"matmul_n": 256, "matmul_reps": 4, "rounds": 2}),
    "learner": (
        120,
        5,
        {
            "shape": "qwen3-smoke",
            "prompt": 8,
            "group": 4,
            "sizes": [[4, 16, 1, 1], [8, 16, 0, 1]],
            "threads": 1,
        },
    ),
    "up": (
        180,
        5,
        {
            "steps": 1,
            "sets": [
                "algo.rollout_batch_size=2",
                "algo.over_sampling_batch_size=2",
                "algo.n_samples_per_prompt=2",
                "algo.max_new_tokens=16",
                "run.eval_every=0",
                "learner.backend=torch",
            ],
        },
    ),
    "engine": (
        120,
        5,
        {
            "max_rows": 2,
            "prompt": 8,
            "repeats": 2,
            "threads": 1,
            "decode": [
                {"name": "tiny", "dir": "models/tiny"},
                {"name": "qwen3-smoke", "shape": "qwen3-smoke"},
            ],
            "batching": {
                "model": "tiny",
                "n": 8,
                "slots": 4,
                "prompt_min": 4,
                "prompt_max": 8,
                "median": 4.0,
                "sigma": 0.9,
                "cap": 12,
            },
        },
    ),
    "gpu-tests": (120, 5, {}),
}


def plan(args: argparse.Namespace) -> list[Phase]:
    """The phases in order: the first learner variant early, the others last ("if time allows")."""
    sizes = SMOKE if args.smoke else FULL

    def phase(name: str, size: str, module: str, **extra: Any) -> Phase:
        budget, least, params = sizes[size]
        return Phase(name, module, budget, least, {"device": args.device, **params, **extra})

    learners = [phase(f"learner-{i}", "learner", "learner_scale", adam_impl=i) for i in args.adam_impls]
    return [
        phase("device", "device", "hardware"),
        *learners[:1],
        phase("up", "up", "up_run"),
        phase("engine", "engine", "engine_decode", engine_options=args.engine_options),
        phase("gpu-tests", "gpu-tests", "gpu_tests"),
        dataclasses.replace(phase("up-placed", "up", "up_run", placed=True), gpus=2),
        *learners[1:],
    ]


def option(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` with VALUE read as JSON where it parses (true, 3, "x"), else as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out",
        type=Path,
        help="folder for gpu_check.json, provenance.json, gpu_check.log "
        "(default bench-out/gpu-check, or bench-out/gpu-check-smoke)",
    )
    p.add_argument("--smoke", action="store_true", help="every phase at tiny size, on the CPU by default")
    p.add_argument("--device", default=None, help="cuda (default) | cuda:N | cpu (the smoke's default)")
    p.add_argument("--budget-s", type=float, default=None, help="the whole check's budget (360; smoke 280)")
    p.add_argument("--phases", default="", help="comma-separated phase names to run (default: all)")
    p.add_argument(
        "--adam-impls",
        default=None,
        help="learner.adam_impl values, one learner phase each (deepspeed,torch; smoke: torch)",
    )
    p.add_argument(
        "--engine-option",
        type=option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a TorchEngine keyword argument for the engine phase (repeatable)",
    )
    p.add_argument(
        "--source-stamp",
        type=Path,
        default=None,
        help="source.json of `make gpu-wheels`: the commit, where this tree has no git",
    )
    p.add_argument(
        "--keep-arch-list",
        action="store_true",
        help="leave TORCH_CUDA_ARCH_LIST as found (by default a suffix like 9.0a is dropped)",
    )
    p.add_argument("--child", nargs=3, metavar=("MODULE", "PARAMS", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    args.out = args.out or Path("bench-out/gpu-check-smoke" if args.smoke else "bench-out/gpu-check")
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.budget_s = args.budget_s or (280.0 if args.smoke else 360.0)
    impls = args.adam_impls or ("torch" if args.smoke else "deepspeed,torch")
    args.adam_impls = [x.strip() for x in impls.split(",") if x.strip()]
    args.engine_options = dict(args.engine_option)
    return args


def child(module: str, params_path: Path, result_path: Path) -> int:
    """In the phase's own process: run it, recording as it goes."""
    record = PhaseRecord(result_path)
    params = json.loads(params_path.read_text(encoding="utf-8"))
    try:
        importlib.import_module(f"gpu.{module}").run(params, record)
    except PhaseSkipped as exc:
        record.skip(str(exc))
    except Exception as exc:
        traceback.print_exc()
        record.error("phase", exc)
        return 1
    return 0


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the phase's process group, SIGKILL after 10 s (april up's children go with it)."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def run_phase(phase: Phase, scratch: Path, env: dict[str, str], deadline: float) -> dict[str, Any]:
    left = deadline - time.monotonic()
    entry: dict[str, Any] = {
        "module": f"benchmarks/gpu/{phase.module}.py",
        "params": phase.params,
        "budget_s": phase.budget_s,
    }
    if left < phase.least_s:
        reason = f"out of time: {left:.0f} s of the check's budget left, it needs {phase.least_s:.0f} s"
        return {**entry, "status": "skipped", "reason": reason, "wall_s": 0.0}
    timeout = min(phase.budget_s, left)
    params, result, log = (scratch / f"{phase.name}.{ext}" for ext in ("params.json", "result.json", "log"))
    params.write_text(json.dumps({**phase.params, "timeout_s": timeout}), encoding="utf-8")
    started = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", phase.module, str(params), str(result)],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            code = None
    wall = time.monotonic() - started
    rec = read_record(result)
    entry.update(timeout_s=timeout, wall_s=wall, exit_code=code, result=rec["result"], errors=rec["errors"])
    if code is None:
        entry.update(status="timeout", errors=[*rec["errors"], f"timed out after {timeout:.0f} s"])
    elif rec["skipped"]:
        entry.update(status="skipped", reason=rec["skipped"])
    elif code == 0 and not rec["errors"]:
        entry["status"] = "ok"
    else:
        entry.update(status="error", errors=rec["errors"] or [f"exited {code}"])
    if entry["status"] in ("error", "timeout"):
        entry["log_tail"] = tail(log, 12)[-2000:]
    return entry


def gpu_shortfall(phase: Phase, results: dict[str, Any]) -> str:
    """Why `phase` cannot run here for want of GPUs (the device phase's count), or ""."""
    seen = results.get("device", {}).get("result", {}).get("identity", {}).get("gpus")
    if phase.gpus <= 1 or (isinstance(seen, int) and seen >= phase.gpus):
        return ""
    return f"needs {phase.gpus} GPUs, the device phase saw {seen}"


def with_utilisation(phases: dict[str, Any], device: dict[str, Any]) -> None:
    """Each learner size's model-FLOPs utilisation, with and without attention, against the vendor's
    dense peak (`spec`) and the matmul measured in this run (`measured`)."""
    peaks = {"spec": device.get("dense_bf16_tflops_spec"), "measured": device.get("matmul_tflops")}
    for entry in phases.values():
        for row in entry.get("result", {}).get("sizes", []):
            flops = {
                "weights": row["weight_flops"],
                "with_attention": row["weight_flops"] + row["attention_flops"],
            }
            row["achieved_tflops"] = {k: f / row["median_s"] / 1e12 for k, f in flops.items()}
            row["mfu"] = {
                peak: {k: utilisation(f, row["median_s"], value) for k, f in flops.items()}
                for peak, value in peaks.items()
            }


def optimizer_comparison(phases: dict[str, Any]) -> list[dict[str, Any]]:
    """Per learner size measured under more than one `learner.adam_impl`: each one's median step seconds
    and the fastest."""
    times: dict[str, dict[str, float]] = {}
    for name, entry in phases.items():
        for row in entry.get("result", {}).get("sizes", []) if name.startswith("learner-") else []:
            size = f"{row['samples']} x {row['response_len']}"
            times.setdefault(size, {})[entry["result"]["engine"]["adam_impl"]] = row["median_s"]
    return [
        {"size": size, "median_s": by_impl, "fastest": min(by_impl, key=by_impl.__getitem__)}
        for size, by_impl in times.items()
        if len(by_impl) > 1
    ]


def arch_environment(env: dict[str, str], keep: bool) -> dict[str, Any]:
    found = env.get("TORCH_CUDA_ARCH_LIST")
    fixed = None if keep or found is None else arch_list_for_deepspeed(found)
    if fixed is None:
        return {"TORCH_CUDA_ARCH_LIST": found}
    env["TORCH_CUDA_ARCH_LIST"] = fixed
    return {
        "TORCH_CUDA_ARCH_LIST": fixed,
        "TORCH_CUDA_ARCH_LIST_found": found,
        "why": "DeepSpeed's op builder reads each entry as numbers and fails on a suffix (FusedAdam's build)",
    }


def stamp(args: argparse.Namespace, argv: list[str], device: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """provenance.json: april.provenance's stamp, the commit from `make gpu-wheels`'s source.json where
    this copy of the tree has no git, and the GPU."""
    shown: list[str] = []
    given = iter(argv)
    for a in given:  # the artifact's folder as committed; the wheels' stamp is not part of the command
        name = a.split("=", 1)[0]
        if name in ("--out", "--source-stamp"):
            if "=" not in a:
                next(given, None)
            shown += ["--out", SHOWN_OUT] if name == "--out" else []
        else:
            shown.append(a)
    stamp = provenance(["python", "benchmarks/gpu_check.py", *shown])
    if stamp["commit"] == "unknown" and args.source_stamp and args.source_stamp.exists():
        source = json.loads(args.source_stamp.read_text(encoding="utf-8"))
        stamp.update(
            commit=source["commit"], dirty=source["dirty"], commit_from="source.json of make gpu-wheels"
        )
    keys = ("name", "driver", "memory_gib", "capability", "torch_cuda")
    stamp["machine"]["gpu"] = {k: device.get(k) for k in keys}
    stamp["wall_s"] = round(wall_s, 1)
    stamp["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    return stamp


def summary_lines(artifact: dict[str, Any]) -> list[str]:
    spent = f"{artifact['wall_s']:.0f} s of a {artifact['budget_s']:.0f} s budget"
    lines = [f"gpu-check on {artifact['device'].get('name')}: {spent}"]
    for name, e in artifact["phases"].items():
        why = "; ".join(e.get("errors") or []) or e.get("reason", "")
        lines.append(f"  {name:<18} {e['status']:<8} {e['wall_s']:6.1f} s  {why}".rstrip())
    for t in artifact["targets"]:
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"  target {t['target']} {t['limit']}: {t['measured']} -> {met}")
    return lines


def selected(phases: list[Phase], names: str) -> list[Phase]:
    """The phases `--phases` names (all when empty), in the plan's order."""
    if not names:
        return phases
    wanted = {x.strip() for x in names.split(",")}
    unknown = wanted - {p.name for p in phases}
    if unknown:
        known = ", ".join(p.name for p in phases)
        raise SystemExit(f"gpu-check: error: --phases: unknown {', '.join(sorted(unknown))} (known: {known})")
    return [p for p in phases if p.name in wanted]


def artifact(
    args: argparse.Namespace, environment: dict[str, Any], results: dict[str, Any], wall_s: float
) -> dict[str, Any]:
    """gpu_check.json's content from the phases' entries so far."""
    measured = results.get("device", {}).get("result", {})
    device = {
        **measured.get("identity", {}),
        "matmul_tflops": measured.get("matmul", {}).get("tflops"),
        "matmul": measured.get("matmul"),
    }
    with_utilisation(results, device)
    return {
        "benchmark": "gpu_check",
        "smoke": args.smoke,
        "device": device,
        "environment": environment,
        "budget_s": args.budget_s,
        "wall_s": wall_s,
        "phases": results,
        "targets": [t.judge(results) for t in TARGETS],
        "optimizers": optimizer_comparison(results),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        return child(args.child[0], Path(args.child[1]), Path(args.child[2]))
    phases = selected(plan(args), args.phases)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TQDM_DISABLE": "1",  # transformers' progress bars, in every phase's log
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    environment = arch_environment(env, args.keep_arch_list)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {}
    packages = {}
    for phase in phases:  # before any phase runs: what this Python lacks, one line a phase
        lacks, packages[phase.name] = preflight_line(phase.name, PHASE_NEEDS[phase.module])
        print(f"gpu-check: {packages[phase.name]}", flush=True)
        if lacks:
            results[phase.name] = {"status": "error", "errors": [packages[phase.name]], "wall_s": 0.0}

    def save() -> dict[str, Any]:  # after every phase: a check killed from outside keeps what it measured
        doc = {**artifact(args, environment, results, time.monotonic() - started), "packages": packages}
        write_json(args.out / "gpu_check.json", doc, indent=1)
        prov = stamp(args, argv, doc["device"], doc["wall_s"])
        write_json(args.out / "provenance.json", prov)
        return doc

    with (
        tempfile.TemporaryDirectory(prefix="april-gpu-check-") as tmp,
        open(args.out / "gpu_check.log", "w") as log,
    ):
        for phase in phases:
            if phase.name in results:  # skipped already, or lacking a package
                continue
            short = gpu_shortfall(phase, results)
            if short:
                results[phase.name] = {"status": "skipped", "reason": short, "wall_s": 0.0}
                continue
            print(f"gpu-check: {phase.name} ...", flush=True)
            results[phase.name] = entry = run_phase(phase, Path(tmp), env, started + args.budget_s)
            print(f"gpu-check: {phase.name}: {entry['status']} in {entry['wall_s']:.1f} s", flush=True)
            log.write(f"===== {phase.name}: {entry['status']} in {entry['wall_s']:.1f} s\n")
            log.write(tail(Path(tmp) / f"{phase.name}.log", LOG_LINES) + "\n")
            log.flush()
            if phase.name == "device" and entry["status"] != "ok" and not args.smoke:
                no_gpu = {"status": "skipped", "reason": "the device phase failed", "wall_s": 0.0}
                results.update({p.name: dict(no_gpu) for p in phases if p.name not in results})
            save()
    doc = save()
    print("\n".join(summary_lines(doc)))
    print(f"wrote {args.out}/gpu_check.json, provenance.json, gpu_check.log")
    return 0 if all(e["status"] in ("ok", "skipped") for e in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
