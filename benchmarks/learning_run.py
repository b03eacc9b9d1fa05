"""A task's learning curve: `april up --config CONFIG` in each asked mode at equal steps, then the held-out
accuracy of the starting weights and of each run's final weights.

The runs' own figures are training accuracy per step (`metrics.jsonl`: sampled at T = 1 on the prompts
each step drew, partly by older versions in april and async) and the broker's greedy evaluations
(`eval.jsonl`). Neither holds the prompts still while sampling as training does, so afterwards every
policy plays the same held-out prompts, sampled at T = 1 (`--eval-samples` each) and greedy, in this
process: calculator episodes for `data.source = "calculator"` (`cli.sft_cmd.evaluate_episodes`), a
reasoning-gym source's held-out questions (generator seeds past every training entry's,
`cli.sft_cmd.reasoning_held_out`, scored by the task's own `score_answer`) for `reasoning_gym:`.
The modes run one after another on the same machine; each run's wall time, samples per second and the
load average around it are recorded beside its accuracy.

    python benchmarks/learning_run.py --config configs/spell_backward.toml --modes sync,april,async --out DIR
    python benchmarks/learning_run.py --smoke     # 2 steps, 4 held-out prompts (the suite runs it)

Writes DIR/<mode>/ (the run directories) and DIR/learning_run.json. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from april.config import Config  # noqa: E402
from april.files import write_json  # noqa: E402
from april.ports import free_ports  # noqa: E402
from april.weights_uri import version_path  # noqa: E402
from cli.options import resolve_config  # noqa: E402

MODES = ("sync", "april", "async")


def held_out_accuracy(
    config: Config, model: Path, weights: Path | None, prompts: int, samples: int, greedy: bool
) -> dict[str, Any]:
    """The policy (`model`, with `weights` over it) on the task's held-out prompts: its result record."""
    from cli import sft_cmd

    if config.data.source == "calculator":
        r: Any = sft_cmd.evaluate_episodes(
            model, prompts, greedy=greedy, samples_per_prompt=samples, weights=weights
        )
        return dataclasses.asdict(r)
    if not config.data.source.startswith("reasoning_gym:"):
        raise SystemExit(
            f"data.source = {config.data.source!r}: expected calculator or reasoning_gym:TASK (a task "
            "whose held-out prompts this benchmark knows)"
        )
    from actors.rewards import reasoning_gym_reward

    seed = config.data.generator_seed(config.run.seed)
    records = sft_cmd.reasoning_held_out(
        config.data.source, config.data.options, prompts, config.data.size, seed
    )
    r = sft_cmd.evaluate(
        model,
        records,
        reasoning_gym_reward,
        greedy=greedy,
        samples_per_prompt=samples,
        max_new_tokens=config.algo.max_new_tokens,
        weights=weights,
    )
    return dataclasses.asdict(r)


def curve(run_dir: Path) -> dict[str, Any]:
    """The run's learning curve: per learner step its training accuracy (reward > 0), mean reward and
    throughput, and the broker's greedy held-out evaluations by version."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    eval_file = run_dir / "eval.jsonl"
    evals = (
        [json.loads(x) for x in eval_file.read_text().splitlines() if x.strip()] if eval_file.exists() else []
    )
    t0 = lines[0]["time"] - lines[0]["step_time_s"] if lines else 0.0
    keys = (
        "step",
        "accuracy",
        "reward_mean",
        "samples_per_s",
        "aborted",
        "offpolicy_token_frac",
        "response_len_mean",
    )
    return {
        "steps": [{**{k: x[k] for k in keys}, "time_s": x["time"] - t0} for x in lines],
        "greedy_eval": [
            {"version": e["version"], "accuracy": e["accuracy"], "reward_mean": e["reward_mean"], "n": e["n"]}
            for e in evals
        ],
    }


def run_mode(
    config_path: str, mode: str, run_dir: Path, steps: int | None, sets: list[str]
) -> dict[str, Any]:
    """`april up --headless` in `mode` into run_dir (on free loopback ports); its command, wall time and
    the load average before and after."""
    ports = free_ports(3)
    names = ("worker_port", "learner_port", "pub_port")
    port_sets = [f"broker.{n}={p}" for n, p in zip(names, ports, strict=True)]
    shown = ["april", "up", "--headless", "--config", config_path, "--mode", mode]
    shown += [*([] if steps is None else ["--steps", str(steps)]), *(x for s in sets for x in ("--set", s))]
    launcher = [
        sys.executable,
        "-c",
        "from cli.main import main; main()",
        *shown[1:],
        "--run-dir",
        str(run_dir),
    ]
    launcher += [x for s in port_sets for x in ("--set", s)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    subprocess.run(launcher, cwd=REPO, env=env, check=True)
    return {
        "command": " ".join(shown),
        "launcher_wall_s": time.perf_counter() - started,
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="the run's config (configs/calculator.toml)")
    ap.add_argument(
        "--modes", default=None, help="comma-separated modes, run one after another (the config's)"
    )
    ap.add_argument("--out", type=Path, default=None, help="folder for the runs and learning_run.json")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="passed to april up")
    ap.add_argument("--steps", type=int, default=None, help="learner steps (default: the config's)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts to play (200)")
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per prompt at T = 1")
    ap.add_argument("--smoke", action="store_true", help="2 steps and 4 prompts (options given win)")
    args = ap.parse_args(argv)
    smoke = {"out": REPO / "bench-out" / "learning-run-smoke", "steps": 2, "eval_prompts": 4}
    full = {"out": REPO / "bench-out" / "learning-run", "steps": None, "eval_prompts": 200}
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    config_path = args.config or "configs/calculator.toml"
    base = resolve_config(REPO / config_path, args.sets)  # what the runs will resolve
    modes = args.modes.split(",") if args.modes else [base.run.mode]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: got {unknown[0]!r}, expected some of {', '.join(MODES)}")
    out = args.out.resolve()
    model = Path(base.worker.model)
    model = model if model.is_absolute() else REPO / model
    held_out: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Any]] = {}

    def play(name: str, weights: Path | None) -> None:
        for greedy in (False, True):
            samples = 1 if greedy else args.eval_samples
            r = held_out_accuracy(base, model, weights, args.eval_prompts, samples, greedy)
            held_out.setdefault(name, {})["greedy" if greedy else "sampled"] = r
            print(f"[learning_run] {name} {'greedy' if greedy else 'sampled'}: accuracy {r['accuracy']:.3f}")

    play("v0", None)
    for mode in modes:
        run_dir = out / mode
        info = run_mode(config_path, mode, run_dir, args.steps, args.sets)
        summary = json.loads((run_dir / "summary.json").read_text())
        final = int(summary["final_version"])
        runs[mode] = {**info, "final_version": final, "summary": summary, "curve": curve(run_dir)}
        play(mode, version_path(run_dir / "weights", final))
    doc = {
        "config": config_path,
        "modes": modes,
        "eval_prompts": args.eval_prompts,
        "eval_samples": args.eval_samples,
        "held_out": held_out,
        "runs": runs,
    }
    write_json(out / "learning_run.json", doc, indent=1)


if __name__ == "__main__":
    main()
