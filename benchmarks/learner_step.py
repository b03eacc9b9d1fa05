"""Learner step time: plain torch vs DeepSpeed ZeRO-0/1/2 (CPU, gloo, fp32, torch AdamW) on the same batch.

What runs: a random Llama-style model from `april.hf.make_tiny_model` (`--hidden 256 --layers 4` by
default), a batch of `--n` samples x `--seq` tokens (an LM cross-entropy loss: the engine does not know
RL), split into micro-batches of `--micro` and accumulated into one AdamW step with clipping. One timed
step = every micro-batch's forward + backward, then `TrainEngine.step()`. Each backend runs in its own
fresh process (DeepSpeed's process group and globals never meet the baseline); `--warmup` untimed steps,
then `--steps` timed ones; `--rounds` rounds run the backends in turn (on a shared machine a burst of
load from elsewhere then hits all of them), and the median and min over all timed steps are reported.
Also timed: `state_dict_for_publish()` + `weights.publish()`.

Reported: median and min step time per backend, and their ratios to plain torch (the target: DeepSpeed
within 1.15x). Not a test: nothing is asserted. Prints a table and writes JSON (`--out`).
Usage: python benchmarks/learner_step.py [--n 64 --seq 256 --micro 8 --steps 3 --rounds 3 --threads 2]
       python benchmarks/learner_step.py --smoke       # tiny sizes, torch and ZeRO-2 (the suite runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from april.files import write_json

BACKENDS: dict[str, tuple[Literal["torch", "deepspeed"], int]] = {
    "torch": ("torch", 0),
    "zero0": ("deepspeed", 0),
    "zero1": ("deepspeed", 1),
    "zero2": ("deepspeed", 2),
}


# --smoke: a tiny model and batch, one timed step, plain torch and one DeepSpeed backend (ZeRO-2: the
# partitioned optimizer and gradients; stages 0 and 1 take the same path through this script)
SMOKE: dict[str, Any] = {
    "hidden": 32,
    "layers": 1,
    "heads": 2,
    "n": 4,
    "seq": 16,
    "micro": 2,
    "steps": 1,
    "rounds": 1,
    "warmup": 0,
    "threads": 1,
    "backends": ["torch", "zero2"],
    "out": Path("bench-out/learner_step-smoke.json"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--n", type=int, default=64, help="samples per step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sample")
    ap.add_argument("--micro", type=int, default=8, help="samples per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per backend per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every backend once, in turn")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-out/learner_step.json"))
    ap.add_argument(
        "--smoke", action="store_true", help="a few seconds a backend: tiny sizes (options given win)"
    )
    ap.add_argument("--child", nargs=2, metavar=("BACKEND", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:  # the smoke sizes become the defaults, so options given on the command line still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    return args


def measure(args: argparse.Namespace, name: str, model_dir: Path) -> dict[str, Any]:
    """In this (fresh) process: build the engine, run warm-up + timed steps, time one publish."""
    import torch

    from april.hf import load_model, set_torch_threads
    from learner.engine import TrainEngine, TrainSettings
    from learner.weights import publish

    set_torch_threads(args.threads)
    backend, stage = BACKENDS[name]
    settings = TrainSettings(
        backend=backend,
        zero_stage=stage,
        micro_batch_size=args.micro,
        grad_accum_steps=args.n // args.micro,
        lr=1e-4,
        weight_decay=0.01,
        grad_clip=1.0,
    )
    engine = TrainEngine(load_model(model_dir), settings)
    gen = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(3, 259, (args.n, args.seq), generator=gen)

    def loss_fn(model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]

    times = []
    for i in range(args.warmup + args.steps):
        started = time.perf_counter()
        for micro_batch in torch.split(batch, args.micro):
            engine.forward_backward(loss_fn, micro_batch)
        engine.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as weights_dir:
        started = time.perf_counter()
        publish(engine.state_dict_for_publish(), Path(weights_dir), 1)
        publish_s = time.perf_counter() - started
    return {"step_s": times, "median_s": statistics.median(times), "publish_s": publish_s}


def run_child(args: argparse.Namespace, name: str, model_dir: Path) -> dict[str, Any]:
    """`measure` in a fresh interpreter (its last stdout line is the JSON result)."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", name, str(model_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(
            f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def version(dist: str) -> str:
    try:
        return _dist_version(dist)
    except PackageNotFoundError:
        return "absent"


def main() -> None:
    args = parse_args()
    if args.n % args.micro:
        raise SystemExit(f"--n {args.n} must be a multiple of --micro {args.micro}")
    if args.child:
        print(json.dumps(measure(args, args.child[0], Path(args.child[1]))))
        return
    from april.hf import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "model", args.seed, vocab_size=args.vocab, hidden=args.hidden,
            layers=args.layers, heads=args.heads,
        )  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.backends}
        for _ in range(args.rounds):  # interleaved, so a burst of load from elsewhere hits every backend
            for name in args.backends:
                runs[name].append(run_child(args, name, model_dir))
    results: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        times = [t for r in rs for t in r["step_s"]]
        results[name] = {
            "step_s": times,
            "median_s": statistics.median(times),
            "min_s": min(times),
            "publish_s": statistics.median(r["publish_s"] for r in rs),
        }
    base = results.get("torch", {}).get("median_s")
    base_min = results.get("torch", {}).get("min_s")
    print(f"learner step: {args.n} samples x {args.seq} tokens, micro-batch {args.micro}, "
          f"hidden {args.hidden}, {args.layers} layers, {args.threads} threads, CPU fp32")  # fmt: skip
    print(f"{'backend':<8} {'median s':>9} {'min s':>7} {'max s':>7} {'median/torch':>13} {'min/torch':>10} "
          f"{'publish s':>10}")  # fmt: skip
    for name, r in results.items():
        r["ratio_vs_torch"] = r["median_s"] / base if base else float("nan")
        r["min_ratio_vs_torch"] = r["min_s"] / base_min if base_min else float("nan")
        print(
            f"{name:<8} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {max(r['step_s']):>7.3f} "
            f"{r['ratio_vs_torch']:>12.3f}x {r['min_ratio_vs_torch']:>9.3f}x {r['publish_s']:>10.3f}"
        )
    report = {
        "benchmark": "learner_step",
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
        "platform": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "torch": version("torch"),
            "deepspeed": version("deepspeed"),
        },
        "target_ratio": 1.15,
        "results": results,
    }
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
