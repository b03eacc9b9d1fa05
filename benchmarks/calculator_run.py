"""The calculator task's learning curve: `april up --config configs/calculator.toml`, then the held-out
accuracy of the run's starting and final weights.

The run's own figures are its training accuracy per step (`metrics.jsonl`: sampled at T = 1 on the
prompts each step drew, whose count of numbers to sum varies from step to step, and in APRIL's rounds the
quick episodes complete first) and the broker's greedy evaluations (`eval.jsonl`, where the SFT model is
already right on most prompts). Neither holds the prompts still while sampling as training does, so
afterwards both weights play the same held-out calculator prompts (`cli.sft_cmd.evaluate_episodes`, the
evaluation `april sft` reports), sampled at T = 1 and greedy, by count of numbers to sum.

    python benchmarks/calculator_run.py --out DIR [--set section.key=value ...]
    python benchmarks/calculator_run.py --smoke     # 2 steps, 4 held-out prompts (the suite runs it)

Writes DIR/run/ (the run directory) and DIR/calculator_run.json. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from april.config import load_config  # noqa: E402
from april.files import write_text_atomic  # noqa: E402
from april.weights_uri import version_path  # noqa: E402
from cli.sft_cmd import evaluate_episodes  # noqa: E402

CONFIG = "configs/calculator.toml"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the run and calculator_run.json")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="passed to april up")
    ap.add_argument("--steps", type=int, default=None, help="learner steps (default: the config's)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts to play (200)")
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per prompt at T = 1")
    ap.add_argument("--smoke", action="store_true", help="2 steps and 4 prompts (options given win)")
    args = ap.parse_args(argv)
    smoke = {"out": REPO / "bench-out" / "calculator-run-smoke", "steps": 2, "eval_prompts": 4}
    full = {"out": REPO / "bench-out" / "calculator-run", "steps": None, "eval_prompts": 200}
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    out = args.out.resolve()
    run_dir = out / "run"
    sets = [x for s in args.sets for x in ("--set", s)]
    steps = [] if args.steps is None else ["--steps", str(args.steps)]
    command = ["april", "up", "--headless", "--config", CONFIG, "--run-dir", str(run_dir), *steps, *sets]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    launcher = [sys.executable, "-c", "from cli.main import main; main()", *command[1:]]
    subprocess.run(launcher, cwd=REPO, env=env, check=True)
    config = load_config(run_dir / "config.toml")
    model = Path(config.worker.model)
    model = model if model.is_absolute() else REPO / model
    final = json.loads((run_dir / "summary.json").read_text())["final_version"]
    weights = version_path(run_dir / "weights", final)
    held_out: dict[str, dict[str, object]] = {}
    for version, path in ((0, None), (final, weights)):
        for greedy in (False, True):
            samples = 1 if greedy else args.eval_samples
            r = evaluate_episodes(
                model, args.eval_prompts, greedy=greedy, samples_per_prompt=samples, weights=path
            )
            held_out.setdefault(f"v{version}", {})["greedy" if greedy else "sampled"] = dataclasses.asdict(r)
            print(f"[calculator] v{version} {'greedy' if greedy else 'sampled'}: accuracy {r.accuracy:.3f}")
    doc = {
        "command": " ".join(command),
        "final_version": final,
        "eval_prompts": args.eval_prompts,
        "eval_samples": args.eval_samples,
        "held_out": held_out,
    }
    write_text_atomic(out / "calculator_run.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
