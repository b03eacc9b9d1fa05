"""The scheduling ablation of issue 17: every policy option on and off, in `april simulate`'s virtual time.

For each shipped workload (math-long-tail, short-answer), with response lengths independent of their
prompt (`--prompt-corr 0`, the workloads as shipped) and mostly the prompt's (0.8, over a dataset that
recurs every few steps, so the length history has something to learn), it simulates each run of
`RUNS` for `--steps` learner steps and `--seeds` seeds on the paper-like cluster (8 engines x 64 slots,
32 x 8 samples, the cost model's defaults) and reports, per run, samples/s over the same seed's sync run
(mean and min-max over seeds), the staleness of trained samples (mean, max) and the slot utilisation.
The simulator drives the broker's own core (broker/core.py, from broker/sim/model.py), and `april bench
--engine sim` checks it against real processes (docs/bench.md: within a few percent).

A run is (label, mode, "section.key" overrides as `--set` takes them); the `april simulate` command
equivalent to each is printed in the report. Writes OUT JSON; not a test: nothing is asserted.

Usage: python benchmarks/scheduling.py --out docs/results/scheduling/scheduling.json
       python benchmarks/scheduling.py --smoke     # a few runs at tiny sizes (the suite runs it)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from april.config import Mode, replace_fields  # noqa: E402
from april.files import write_json  # noqa: E402
from broker.sim.model import SimConfig, simulate  # noqa: E402
from cli.sim_options import paper_config, resolve_lengths  # noqa: E402


@dataclass(frozen=True, slots=True)
class Run:
    label: str
    mode: Mode
    overrides: tuple[tuple[str, str], ...] = ()


def run(label: str, mode: str, resume_kv: str = "", **algo: object) -> Run:
    """A run with `[algo]` fields set (and the workers' `resume_kv`)."""
    pairs = [(f"algo.{k}", str(v).lower() if isinstance(v, bool) else str(v)) for k, v in algo.items()]
    return Run(label, Mode(mode), tuple(pairs + ([("worker.resume_kv", resume_kv)] if resume_kv else [])))


AUTO128: dict[str, object] = {"over_sampling": "auto", "over_sampling_batch_size": 128}
RUNS: tuple[Run, ...] = (
    run("sync", "sync"),
    run("april", "april"),  # the paper's setting: over-sampling 2 x B
    run("april-os96", "april", over_sampling_batch_size=96),
    run("april-os128", "april", over_sampling_batch_size=128),
    run("april-os192", "april", over_sampling_batch_size=192),
    run("april-auto128", "april", **AUTO128),
    run("april-auto192", "april", over_sampling="auto", over_sampling_batch_size=192),
    run("april-shortest", "april", prompt_order="shortest_first"),
    run("april-longest", "april", prompt_order="longest_first"),
    run("april-affinity", "april", resume_affinity=True),
    run("april-affinity-reuse", "april", resume_affinity=True, resume_kv="reuse"),
    run("april-auto128-affinity-reuse", "april", resume_affinity=True, resume_kv="reuse", **AUTO128),
    run("async-eta1", "async", max_staleness=1),
    run("async-eta2", "async", max_staleness=2),
    run("async-eta2-shortest", "async", max_staleness=2, prompt_order="shortest_first"),
    run("async-eta2-affinity-reuse", "async", max_staleness=2, resume_affinity=True, resume_kv="reuse"),
)
WORKLOADS = {"math-long-tail": 16384, "short-answer": 1024}  # name -> max_new_tokens
CORRELATED = (0.8, 256)  # prompt_corr, dataset_size of the correlated setting (an epoch: 256 groups)


def simulate_run(r: Run, workload: str, corr: tuple[float, int], seed: int, steps: int, small: bool) -> Any:
    """One run: `april simulate`'s base layer (the paper's setting), the workload and the run's fields."""
    fields: dict[str, object] = {
        "run.mode": r.mode.value,
        "run.steps": steps,
        "run.seed": seed,
        "algo.max_new_tokens": WORKLOADS[workload],
        "worker.sim_prompt_corr": corr[0],
        "data.synthetic_size": corr[1],
    }
    if small:
        fields |= {
            "algo.rollout_batch_size": 4,
            "algo.over_sampling_batch_size": 8,
            "algo.n_samples_per_prompt": 2,
            "worker.slots": 8,
        }
    overrides = dict(r.overrides)
    if small and "algo.over_sampling_batch_size" in overrides:
        overrides["algo.over_sampling_batch_size"] = str(int(overrides["algo.over_sampling_batch_size"]) // 8)
    config = replace_fields(replace_fields(paper_config(), fields), overrides)
    return simulate(SimConfig(config, engines=1 if small else 8), resolve_lengths(workload))


def command(r: Run, workload: str, corr: tuple[float, int], steps: int) -> str:
    """The `april simulate` command of one run (one seed: add --seed)."""
    parts = ["april simulate", f"--lengths {workload}", f"--max-new-tokens {WORKLOADS[workload]}"]
    parts += [f"--modes {r.mode.value}", f"--steps {steps}"]
    if corr[0]:
        parts += [f"--prompt-corr {corr[0]:g}", f"--dataset-size {corr[1]}"]
    for key, value in r.overrides:
        flag = "--" + key.partition(".")[2].replace("_", "-")
        parts.append(flag if value == "true" else f"{flag} {value}")
    return " ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "scheduling.json")
    p.add_argument("--smoke", action="store_true", help="three runs at tiny sizes")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = RUNS[:2] + RUNS[5:6] if args.smoke else RUNS
    steps = 3 if args.smoke else args.steps
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    for workload in WORKLOADS:
        for corr in ((0.0, 10000), CORRELATED):
            sync = {s: simulate_run(runs[0], workload, corr, s, steps, args.smoke).figures for s in seeds}
            for r in runs:
                figs = [
                    sync[s]
                    if r.label == "sync"
                    else simulate_run(r, workload, corr, s, steps, args.smoke).figures
                    for s in seeds
                ]
                ratios = [f.samples_per_s / sync[s].samples_per_s for f, s in zip(figs, seeds, strict=True)]
                results.append(
                    {
                        "workload": workload,
                        "prompt_corr": corr[0],
                        "dataset_size": corr[1],
                        "run": r.label,
                        "mode": r.mode.value,
                        "overrides": dict(r.overrides),
                        "command": command(r, workload, corr, steps),
                        "speedup_mean": statistics.mean(ratios),
                        "speedup_min": min(ratios),
                        "speedup_max": max(ratios),
                        "samples_per_s_mean": statistics.mean(f.samples_per_s for f in figs),
                        "staleness_mean": statistics.mean(f.staleness_mean for f in figs),
                        "staleness_max": max(f.staleness_max for f in figs),
                        "offpolicy_token_frac": statistics.mean(f.offpolicy_token_frac for f in figs),
                        "slot_utilization": statistics.mean(f.slot_utilization for f in figs),
                        "wasted_tokens": max(f.wasted_tokens for f in figs),
                        "reprefill_frac": statistics.mean(f.reprefill_frac for f in figs),
                        "stale_kv_token_frac": statistics.mean(f.stale_kv_token_frac for f in figs),
                    }
                )
                row = results[-1]
                print(
                    f"{workload:15s} corr {corr[0]:g} {r.label:20s} {row['speedup_mean']:.2f}x "
                    f"[{row['speedup_min']:.2f}, {row['speedup_max']:.2f}] stale {row['staleness_mean']:.2f}/"
                    f"{row['staleness_max']} util {row['slot_utilization']:.3f}",
                    file=sys.stderr,
                )
    doc = {
        "benchmark": "scheduling",
        "params": {"steps": steps, "seeds": seeds, "smoke": args.smoke, "correlated": list(CORRELATED)},
        "results": results,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    write_json(args.out, doc)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
