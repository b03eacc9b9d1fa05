"""`make results`: rerun every measurement that README.md and docs/ quote, then render their tables.

    python benchmarks/results.py run [--only up-run,fuzz] [--list]   # every step, one after another
    python benchmarks/results.py render [--check]                   # README.md and docs/*.md blocks

`run` executes each step's command (the very command a reader would type) in a scratch directory and
copies the step's artifact files into docs/ (`docs/results/STEP/`, or `docs/bench/STEP/` for the `april
bench` runs), with `provenance.json` beside them: the command, the commit it ran (and whether the tree was
dirty), the date, the machine and its load, and the step's wall seconds. Steps run one at a time: the
machine is the instrument, and two at once would measure each other. `--list` prints the plan with each
step's expected minutes on a quiet 2-core machine; the whole plan takes about two hours there.

`render` rewrites every block between `<!-- measured:NAME -->` and `<!-- /measured:NAME -->` in
README.md and docs/*.md from those artifacts alone (`--check`: exit 1 naming each stale block, which the
suite runs), so no figure in the docs can drift from its artifact, and each block names its source, command
and commit. Prose around a block may say what a figure means; it quotes no number of its own.

The GPU check's artifact (`docs/results/gpu-check/`, made on a lent GPU machine by `make gpu-check`, never
by `run`) is rendered the same way; while none is committed, its block says how to make one.

`--smoke` (with `run`) runs the two cheapest steps at tiny sizes into `--out` instead of docs/: the
orchestration and the provenance, checked in seconds by tests/test_benchmarks.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from april.files import write_json  # noqa: E402
from april.provenance import provenance  # noqa: E402

DOCS = REPO / "docs"


@dataclass(frozen=True, slots=True)
class Step:
    """One measurement: its command line (`{out}`: the artifact folder, `{work}`: a scratch folder), the
    files it leaves in the scratch folder to copy into `dest` (or `stdout`: the file its standard output
    goes to), and its expected minutes on a quiet 2-core machine."""

    name: str
    dest: str  # relative to docs/
    command: str
    collect: tuple[str, ...] = ()  # paths relative to {work}, copied into dest
    stdout: str = ""  # file in dest that receives the command's standard output
    minutes: float = 1.0
    smoke: str = ""  # the command at tiny sizes (run --smoke); empty: not run by --smoke


# configs/spell_backward.toml's data.options: the model is taught the questions the run asks
SPELL_BACKWARD_OPTIONS = '{"spell_backward": {"min_word_len": 3, "max_word_len": 8}}'
# configs/word_sequence_reversal.toml's data.options
WORD_SEQUENCE_REVERSAL_OPTIONS = '{"word_sequence_reversal": {"min_words": 2, "max_words": 2}}'


def braced(text: str) -> str:
    """`text` inside a step's command template, whose `{out}` and `{work}` are filled by str.format."""
    return text.replace("{", "{{").replace("}", "}}")


BENCH_FILES = ("bench/bench.json", "bench/bench.md", "bench/bench.png")
PAPER = "april bench --engine sim --workload math-long-tail --steps 5 --max-staleness 1,2 --slots 64"
# issue 17's options on and off, with real processes, each against the same sync run (the simulator's
# ablation of every option, more seeds and steps is the `scheduling` step)
SCHEDULING_VARIANTS = (
    "--variant april-os96:april:algo.over_sampling_batch_size=96 "
    "--variant april-auto128:april:algo.over_sampling=auto,algo.over_sampling_batch_size=128 "
    "--variant april-affinity-reuse:april:algo.resume_affinity=true,worker.resume_kv=reuse "
    "--variant async-eta2-affinity-reuse:async:algo.max_staleness=2,algo.resume_affinity=true,"
    "worker.resume_kv=reuse"
)
STEPS: tuple[Step, ...] = (
    Step(
        "up-run",
        "results/up-run",
        "april up --headless --steps 100 --run-dir {work}/run",
        collect=("run/metrics.jsonl", "run/eval.jsonl", "run/summary.json", "run/config.toml"),
        minutes=7,
    ),
    Step(
        "sft-calculator",
        "results/sft-calculator",
        "april sft --task calculator --report {out}/sft.json",
        minutes=7,
    ),
    Step(
        "calculator-run",
        "results/calculator-run",
        "python benchmarks/learning_run.py --config configs/calculator.toml --out {work}/calc",
        collect=(
            "calc/april/metrics.jsonl",
            "calc/april/eval.jsonl",
            "calc/april/summary.json",
            "calc/april/config.toml",
            "calc/learning_run.json",
        ),
        minutes=6,
    ),
    Step(
        "sft-word-sequence-reversal",
        "results/sft-word-sequence-reversal",
        "april sft --task reasoning_gym:word_sequence_reversal "
        f"--options '{braced(WORD_SEQUENCE_REVERSAL_OPTIONS)}' "
        "--steps 650 --threads 1 --report {out}/sft.json",
        minutes=10,
    ),
    Step(
        "word-sequence-reversal-run",
        "results/word-sequence-reversal-run",
        "python benchmarks/learning_run.py --config configs/word_sequence_reversal.toml "
        "--modes sync,april,async --out {work}/rg",
        collect=("rg/learning_run.json",),
        minutes=10,
    ),
    Step(
        "sft-spell-backward",
        "results/sft-spell-backward",
        f"april sft --task reasoning_gym:spell_backward --options '{braced(SPELL_BACKWARD_OPTIONS)}' "
        "--steps 600 --threads 1 --report {out}/sft.json",
        minutes=8,
    ),
    Step(
        "spell-backward-run",
        "results/spell-backward-run",
        "python benchmarks/learning_run.py --config configs/spell_backward.toml --modes sync,april,async "
        "--out {work}/rg",
        collect=("rg/learning_run.json",),
        minutes=12,
    ),
    Step(
        "simulate",
        "results/simulate",
        "april simulate --lengths math-long-tail --engines 8 --slots 64 --max-staleness 1 --json",
        stdout="simulate.json",
        minutes=1,
        smoke="april simulate --lengths fixed:8 --engines 1 --slots 4 --rollout-batch-size 2 "
        "--over-sampling-batch-size 4 --n-samples-per-prompt 2 --steps 2 --json",
    ),
    Step(
        "paper-config",
        "results/paper-config",
        # the paper's run as configured; what the simulator cannot read or score is set for it: the
        # dataset file (the user's) by 256-token synthetic prompts, and dynamic sampling off (its rewards
        # are all 0, so the filter would drop every group)
        "april simulate --config configs/qwen3-4b-dapo.toml --engines 3 --set data.source=synthetic "
        "--set data.synthetic_prompt_len_min=256 --set data.synthetic_prompt_len_max=256 "
        "--set algo.dynamic_sampling=false --json",
        stdout="simulate.json",
        minutes=2,
    ),
    Step(
        "paper-sim",
        "bench/paper-sim",
        f"{PAPER} --engines 8 --target-s 150 --out {{work}}/bench",
        collect=BENCH_FILES,
        minutes=14,
    ),
    Step(
        "saturated-sim",
        "bench/saturated-sim",
        f"{PAPER} --engines 2 --target-s 90 --out {{work}}/bench",
        collect=BENCH_FILES,
        minutes=9,
    ),
    Step(
        "agentic-sim",
        "bench/agentic-sim",
        "april bench --engine sim --episodes agentic --sweep worker.sim_tool_repeatable=true,false --steps 5 "
        "--target-s 100 --out {work}/bench",
        collect=BENCH_FILES,
        minutes=12,
    ),
    Step(
        "scheduling-paper",
        "bench/scheduling-paper",
        "april bench --engine sim --workload math-long-tail --steps 8 --max-staleness 1,2 --slots 64 "
        f"--engines 8 --target-s 100 {SCHEDULING_VARIANTS} --out {{work}}/bench",
        collect=BENCH_FILES,
        minutes=16,
    ),
    Step(
        "result-hold",
        "bench/result-hold",
        "april bench --engine sim --workload math-long-tail --steps 8 --slots 64 --engines 8 --target-s 100 "
        "--variant april-hold20:april:worker.result_hold_ms=20 "
        "--variant async-hold20:async:worker.result_hold_ms=20 --out {work}/bench",
        collect=BENCH_FILES,
        minutes=8,
    ),
    Step(
        "scheduling-short",
        "bench/scheduling-short",
        "april bench --engine sim --workload short-answer --max-new-tokens 1024 --steps 8 "
        f"--max-staleness 1,2 --slots 64 --engines 8 --target-s 60 {SCHEDULING_VARIANTS} "
        "--out {work}/bench",
        collect=BENCH_FILES,
        minutes=10,
    ),
    Step(
        "torch-tiny",
        "bench/torch-tiny",
        "april bench --engine torch --steps 20 --out {work}/bench",
        collect=BENCH_FILES,
        minutes=6,
    ),
    Step(
        "scheduling",
        "results/scheduling",
        "python benchmarks/scheduling.py --out {out}/scheduling.json",
        minutes=8,
    ),
    Step(
        "cluster-load",
        "results/cluster-load",
        "april simulate --lengths short-answer --max-new-tokens 1024 --engines 1000 --slots 64 "
        "--rollout-batch-size 4096 --over-sampling-batch-size 8192 --modes async --steps 3 "
        "--set broker.max_buffered_samples=65536 --json",
        stdout="simulate.json",
        minutes=1,
    ),
    Step(
        "agentic",
        "results/agentic",
        "april simulate --episodes agentic --sweep worker.sim_tool_repeatable=true,false --json",
        stdout="simulate.json",
        minutes=2,
    ),
    Step(
        "agentic-no-latency",
        "results/agentic-no-latency",
        "april simulate --episodes agentic --set worker.sim_tool_ms= --json",
        stdout="simulate.json",
        minutes=1,
    ),
    Step(
        "broker-throughput",
        "results/broker-throughput",
        "python benchmarks/broker_throughput.py --repeat 3 --out {out}/broker_throughput.json",
        minutes=10,
    ),
    Step(
        "engine-throughput",
        "results/engine-throughput",
        "python benchmarks/engine_throughput.py --out {out}/engine_throughput.json",
        minutes=6,
    ),
    Step(
        "learner-step",
        "results/learner-step",
        "python benchmarks/learner_step.py --out {out}/learner_step.json",
        minutes=6,
    ),
    Step(
        "learner-memory",
        "results/learner-memory",
        "python benchmarks/learner_memory.py --out {out}/learner_memory.json",
        minutes=40,
    ),
    Step(
        "weight-sync",
        "results/weight-sync",
        "python benchmarks/weight_sync.py --out {out}/weight_sync.json",
        minutes=8,
    ),
    Step(
        "weight-sync-sglang",
        "results/weight-sync-sglang",
        "python benchmarks/weight_sync.py --sizes 500M-llama --transports sglang-disk,sglang-broadcast "
        "--out {out}/weight_sync.json",
        minutes=6,
    ),
    Step("sft", "results/sft", "april sft --out {work}/tiny --report {out}/sft.json", minutes=6),
    Step(
        "accuracy",
        "results/accuracy",
        "python benchmarks/accuracy.py --modes sync,april,async --seeds 0,1,2 --steps 80 --target 0.55 "
        "--eval-prompts 400 --eval-samples 4 --out {work}/accuracy",
        collect=("accuracy/accuracy.json", "accuracy/accuracy.md", "accuracy/accuracy.png"),
        minutes=55,
    ),
    Step(
        "soak",
        "results/soak",
        "python benchmarks/soak.py --duration-s 600 --worker-every 30 --learner-every 200 "
        "--broker-every 200 --out {work}/soak",
        collect=("soak/soak.json",),
        minutes=14,
    ),
    Step(
        "compose",
        "results/compose",
        "python compose/compose_test.py --report {out}/compose_test.json",
        minutes=5,
    ),
    Step(
        "fuzz",
        "results/fuzz",
        "python tests/codec_fuzz.py --inputs 1000000 --seed 1",
        stdout="fuzz.json",
        minutes=3,
        smoke="python tests/codec_fuzz.py --inputs 2000 --seed 1",
    ),
)


def argv(command: list[str]) -> list[str]:
    """What actually runs: `april` through this interpreter and this tree, `python` as this interpreter."""
    if command[0] == "april":
        return [sys.executable, "-c", "from cli.main import main; main()", *command[1:]]
    if command[0] == "python":
        return [sys.executable, *command[1:]]
    return command


def run_step(step: Step, docs: Path, smoke: bool = False) -> Path:
    """Run `step`, copy its artifacts into docs/DEST with provenance.json; returns DEST."""
    dest = docs / step.dest
    with tempfile.TemporaryDirectory(prefix=f"april-results-{step.name}-") as scratch:
        work = Path(scratch)
        staged = work / "artifact"
        staged.mkdir()
        template = shlex.split(step.smoke if smoke else step.command)
        command = [part.format(out=staged, work=work) for part in template]
        shown = [part.format(out=f"docs/{step.dest}", work="WORK") for part in template]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
        }
        stamp = provenance(shown)  # the commit and machine as the step starts
        print(f"results: {step.name}: {shlex.join(shown)}", file=sys.stderr, flush=True)
        started = time.monotonic()
        proc = subprocess.run(argv(command), cwd=REPO, env=env, stdout=subprocess.PIPE, check=False)
        wall_s = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(
                f"results: {step.name} failed (exit {proc.returncode}); docs/{step.dest} unchanged"
            )
        if step.stdout:
            (staged / step.stdout).write_bytes(proc.stdout)
        else:
            sys.stdout.buffer.write(proc.stdout)
        for rel in step.collect:
            shutil.copy2(work / rel, staged / Path(rel).name)
        stamp["wall_s"] = round(wall_s, 1)
        stamp["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
        write_json(staged / "provenance.json", stamp)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staged, dest)
    print(f"results: {step.name}: {wall_s / 60:.1f} min -> {dest}", file=sys.stderr, flush=True)
    return dest


# ------------------------------------------------------------------------------------------- rendering


def load(rel: str) -> Any:
    path = DOCS / rel
    return (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        if rel.endswith(".jsonl")
        else (json.loads(path.read_text()))
    )


def source(step: str) -> str:
    """The line under every block: which artifact, which command, which commit, how busy the machine was."""
    by_name = {s.name: s for s in STEPS}
    p = load(f"{by_name[step].dest}/provenance.json")
    dirty = " (with uncommitted changes)" if p["dirty"] else ""
    return (
        f"Source: [`docs/{by_name[step].dest}/`]({{root}}{by_name[step].dest}/), made by `{p['command']}` at "
        f"commit `{p['commit'][:10]}`{dirty} on {p['date'][:10]}, {p['machine']['cpus']} CPUs, load average "
        f"{p['machine']['load_avg_1m']:.1f} at the start, {p['wall_s'] / 60:.0f} min."
    )


def sourced(step: str, *parts: str | list[str]) -> str:
    """A block: its paragraphs (a string, or lines: a table), a blank line between two, and the source
    line of `step` under them."""
    return "\n\n".join(
        [*(part if isinstance(part, str) else "\n".join(part) for part in parts), source(step)]
    )


def x(value: float) -> str:
    return f"{value:.2f}x"


def num(value: Any, fmt: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def started_at(step: str) -> float:
    """When a step's command started (epoch seconds, to the second): its provenance date."""
    by_name = {s.name: s for s in STEPS}
    date = load(f"{by_name[step].dest}/provenance.json")["date"]
    return datetime.datetime.strptime(date, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def block_up_run(step: str = "up-run") -> str:
    """An `april up` run's training accuracy by windows of ten steps, and what the run did."""
    lines = load(f"results/{step}/metrics.jsonl")
    evals = load(f"results/{step}/eval.jsonl")
    t0 = started_at(step)  # `april up` launched
    windows = [lines[i : i + 10] for i in range(0, len(lines), 10)]
    head = "| steps | " + " | ".join(f"{w[0]['step']}-{w[-1]['step']}" for w in windows) + " |"
    acc = (
        "| training accuracy (sampled at T=1) | "
        + " | ".join(num(statistics.fmean(r["accuracy"] for r in w), ".2f") for w in windows)
        + " |"
    )
    elapsed = (
        "| seconds since `april up` started, at the window's end | "
        + " | ".join(f"{w[-1]['time'] - t0:.0f}" for w in windows)
        + " |"
    )
    aborted = statistics.fmean(r["aborted"] for r in lines)
    off = [r["offpolicy_token_frac"] for r in lines[1:]]
    greedy = [e["accuracy"] for e in evals]
    return "\n".join(
        [
            head,
            "|---" * (len(windows) + 1) + "|",
            acc,
            elapsed,
            "",
            f"{len(lines)} steps in {lines[-1]['time'] - t0:.0f} s; the first trained step came "
            f"{lines[0]['time'] - t0:.0f} s after `april up` started; per step the broker aborted "
            f"{aborted:.1f} samples on average (N = {lines[0]['samples']}), and "
            f"{min(off):.0%}-{max(off):.0%} "
            f"of the trained tokens were off-policy (steps 2-{len(lines)}); held-out greedy accuracy "
            f"(`eval.jsonl`, {evals[0]['n']} prompts) {min(greedy):.2f}-{max(greedy):.2f} over "
            f"{len(evals)} evaluations.",
            "",
            source(step),
        ]
    )


def block_calculator_held_out() -> str:
    rows = [
        "| weights | sampled at T=1 | by numbers to sum (2 / 3 / 4 / 5-10) | greedy |",
        "|---|---|---|---|",
    ]
    doc = load("results/calculator-run/learning_run.json")
    (mode,) = doc["modes"]
    final = doc["runs"][mode]["final_version"]
    for name, ev in doc["held_out"].items():
        s = ev["sampled"]
        by = {int(k): v for k, v in s["by_numbers"].items()}
        tail = [v for k, v in by.items() if k >= 5]
        long = sum(a * n for a, n in tail) / max(1, sum(n for _, n in tail))
        parts = " / ".join(f"{by[k][0]:.2f}" for k in (2, 3, 4) if k in by) + f" / {long:.2f}"
        version = name if name == "v0" else f"v{final}"
        rows.append(f"| {version} | {s['accuracy']:.3f} | {parts} | {ev['greedy']['accuracy']:.3f} |")
    return sourced(
        "calculator-run",
        rows,
        (
            f"The first {doc['eval_prompts']} held-out calculator prompts (seed 0, never trained on), "
            f"{doc['eval_samples']} samples each at T=1, and once greedily; v0 is models/tiny-calculator as "
            f"shipped, v{final} the run's final weights."
        ),
    )


def block_sft_reasoning_gym(name: str) -> str:
    """An `april sft --task reasoning_gym:TASK` report: the model, its training and its held-out score
    (and, where the report has it, the fraction solved exactly)."""
    doc = load(f"results/{name}/sft.json")
    d = doc["demonstrations"]
    evals = [
        f"{m} {doc['eval'][m]['accuracy']:.3f}"
        + (f" (solved {doc['eval'][m]['solved']:.3f})" if "solved" in doc["eval"][m] else "")
        + f" over {doc['eval'][m]['samples']} answers"
        for m in ("greedy", "sampled")
    ]
    return "\n".join(
        [
            f"{doc['parameters'] / 1e6:.2f}M parameters ({doc['size_mib']:.1f} MiB), {doc['steps']} steps, "
            f"{doc['wall_s']:.0f} s, final loss {doc['final_loss']:.3f}; held-out mean reward "
            f"{'; '.join(evals)}. Demonstrations from generator seeds {d['generator_seeds_from']} to "
            f"{d['generator_seeds_below'] - 1}; held-out questions from seed {d['held_out_seeds_from']} on.",
            "",
            source(name),
        ]
    )


def block_reasoning_gym_run(name: str, model: str) -> str:
    """Each mode's run at equal steps: held-out score of its final weights, wall time, throughput, and
    the curves (training mean reward by windows of ten steps, the broker's greedy evaluations)."""
    doc = load(f"results/{name}/learning_run.json")

    def scores(ev: dict[str, Any]) -> str:
        sampled, greedy = ev["sampled"], ev["greedy"]
        return (
            f"{sampled['accuracy']:.3f} | {sampled['solved']:.3f} | {greedy['accuracy']:.3f} | "
            f"{greedy['solved']:.3f}"
        )

    rows = [
        "| weights | sampled: mean reward | sampled: solved | greedy: mean reward | greedy: solved "
        "| wall s | trained samples/s | load before / after |",
        "|---|---|---|---|---|---|---|---|",
        f"| v0 ({model}) | {scores(doc['held_out']['v0'])} | | | |",
    ]
    for mode in doc["modes"]:
        r, sm = doc["runs"][mode], doc["runs"][mode]["summary"]
        rows.append(
            f"| {mode}, v{r['final_version']} | {scores(doc['held_out'][mode])} | {sm['wall_s']:.0f} | "
            f"{sm['samples_per_s']:.1f} | {r['load_avg_1m_before']:.1f} / {r['load_avg_1m_after']:.1f} |"
        )
    steps = doc["runs"][doc["modes"][0]]["curve"]["steps"]
    windows = [(w, min(w + 9, len(steps) - 1)) for w in range(0, len(steps), 10)]
    curve = [
        "| training mean reward (T=1), steps | " + " | ".join(f"{a}-{b}" for a, b in windows) + " |",
        "|---" * (len(windows) + 1) + "|",
    ]
    for mode in doc["modes"]:
        got = [x["reward_mean"] for x in doc["runs"][mode]["curve"]["steps"]]
        means = [num(statistics.fmean(got[a : b + 1]), ".2f") if got[a : b + 1] else "" for a, b in windows]
        curve.append(f"| {mode} | " + " | ".join(means) + " |")
    evals = "; ".join(
        f"{mode}: "
        + ", ".join(
            f"v{e['version']} {e['reward_mean']:.2f}" for e in doc["runs"][mode]["curve"]["greedy_eval"]
        )
        for mode in doc["modes"]
    )
    first = doc["runs"][doc["modes"][0]]["curve"]["greedy_eval"]
    return "\n".join(
        [
            *rows,
            "",
            *curve,
            "",
            f"Held out: the first {doc['eval_prompts']} questions from generator seeds past the runs' "
            f"training ones, {doc['eval_samples']} samples each at T=1 and once greedily, played after the "
            "runs by every policy alike; mean reward is the task's score (partial credit included), solved "
            "the fraction scored 1.0. The broker's greedy evaluations during the runs (mean reward over "
            f"{first[0]['n'] if first else 0} held-out questions): {evals}. The modes ran one after "
            "another on the same shared machine (load average before and after each in the table).",
            "",
            source(name),
        ]
    )


def block_sft_calculator() -> str:
    doc = load("results/sft-calculator/sft.json")
    evals = []
    for mode in ("greedy", "sampled"):
        e = doc["eval"][mode]
        by = ", ".join(f"{k}: {a:.2f}" for k, (a, _) in e["by_numbers"].items())
        evals.append(f"{mode} {e['accuracy']:.3f} over {e['samples']} episodes (by numbers to sum: {by})")
    return sourced(
        "sft-calculator",
        (
            f"{doc['parameters'] / 1e6:.2f}M parameters, {doc['steps']} steps, {doc['wall_s']:.0f} s; "
            f"held-out accuracy {'; '.join(evals)}."
        ),
    )


def block_simulate() -> str:
    doc = load("results/simulate/simulate.json")
    rows = ["| mode | trained samples/s | vs sync |", "|---|---|---|"]
    for mode, fig in doc["modes"].items():
        rows.append(f"| {mode} | {fig['samples_per_s']:.3f} | {x(fig['speedup'])} |")
    return sourced("simulate", rows)


def block_paper_config() -> str:
    """configs/qwen3-4b-dapo.toml simulated: each mode's trained samples/s and what it cost."""
    doc = load("results/paper-config/simulate.json")
    s = doc["setting"]
    rows = [
        "| mode | trained samples/s | vs sync | off-policy tokens | aborted / resumed | wasted tokens |",
        "|---|---|---|---|---|---|",
    ]
    for mode, f in doc["modes"].items():
        rows.append(
            f"| {mode} | {f['samples_per_s']:.3f} | {x(f['speedup'])} | {f['offpolicy_token_frac']:.3f} | "
            f"{f['aborted']} / {f['resumed']} | {f['wasted_tokens']} |"
        )
    return sourced(
        "paper-config",
        rows,
        (
            f"{s['steps']} steps of {s['rollout_batch_size']} x {s['n_samples_per_prompt']} samples "
            f"(over-sampling {s['over_sampling_batch_size']}, {s['max_new_tokens']} tokens max) on "
            f"{s['engines']} engines x {s['slots']} slots; lengths {s['lengths']}; the sim engine's cost "
            f"(decode step {s['decode_ms']:g} + {s['decode_ms_per_seq']:g} ms a sequence, prefill "
            f"{s['prefill_ms_per_token']:g} ms a token) and a {s['learner_step_s']:g} s learner step."
        ),
    )


def block_paper_config_gain() -> str:
    """One line: april's predicted samples/s over sync's for configs/qwen3-4b-dapo.toml."""
    doc = load("results/paper-config/simulate.json")
    return (
        f"`april simulate` predicts {x(doc['modes']['april']['speedup'])} sync's trained samples/s for this "
        f"run ([docs/bench.md]({{root}}bench.md#the-papers-run-simulated))."
    )


def bench_table(step: str, *notes: str) -> str:
    """A bench's runs, one row each, then `notes` (lines), then its source."""
    doc = load(f"bench/{step}/bench.json")
    has_error = "prediction_error" in doc
    head = "| run | samples/s | vs sync | slot util | bubble | wasted tok | off-policy | stale mean/max |"
    head += " aborted |"
    head += " predicted samples/s error |" if has_error else " accuracy |"
    rows = [head, "|---" * (head.count("|") - 1) + "|"]
    for label, f in doc["modes"].items():
        last = f"{doc['prediction_error'][label]:+.1%}" if has_error else num(f["accuracy_final"])
        rows.append(
            f"| {label} | {f['samples_per_s']:.3f} | {x(f['speedup'])} | {num(f['slot_utilization'])} | "
            f"{num(f['bubble_frac'])} | {f['wasted_tokens']} | {num(f['offpolicy_token_frac'])} | "
            f"{f['staleness_mean']:.2f}/{f['staleness_max']} | {f['aborted']} | {last} |"
        )
    return "\n".join([*rows, "", *(f"{n}\n" for n in notes), source(step)])


def streamed_latency(broker: dict[str, Any]) -> str:
    """The broker's response time at an offered load under its capacity (the `streamed` scenario), or
    nothing for an artifact from before it existed (a saturated loop's latency is its own queue)."""
    streamed = next((r for r in broker["results"] if r["scenario"] == "streamed"), None)
    if streamed is None:
        return ""
    return (
        f"; one sample a message at {streamed['generated_per_s']:,.0f} samples/s offered, p50 / p99 "
        f"{streamed['latency_ms_p50']:.1f} / {streamed['latency_ms_p99']:.1f} ms from a result to its lease"
        f"{latency_floor(next((r for r in broker['results'] if r['scenario'] == 'floor'), None))}"
    )


def latency_floor(floor: dict[str, Any] | None) -> str:
    """The `floor` scenario's latency (the echo broker's, on the same machine and load), or nothing for an
    artifact from before it existed."""
    if floor is None:
        return ""
    return (
        f" (an echo broker that only reads each result and answers with a ready Lease: "
        f"{floor['latency_ms_p50']:.1f} / {floor['latency_ms_p99']:.1f} ms)"
    )


def block_components() -> str:
    broker = load("results/broker-throughput/broker_throughput.json")
    bounded = next(r for r in broker["results"] if r["scenario"] == "bounded")
    engine = load("results/engine-throughput/engine_throughput.json")
    step = load("results/learner-step/learner_step.json")
    sft = load("results/sft/sft.json")
    gains = ", ".join(f"{x(r['ratio'])} at {r['slots']} slots" for r in engine["throughput"])
    sweep = {r["active"]: r["ms_per_step"] for r in engine["step_sweep"]}
    shown = [a for a in (1, 16, 64) if a in sweep] or sorted(sweep)[:3]
    steps_ms = " / ".join(f"{sweep[a]:.1f}" for a in shown)
    others = [b for b in step["results"] if b != "torch"]
    ratios = " / ".join(x(step["results"][b]["ratio_vs_torch"]) for b in others)
    args = step["args"]
    rows = [
        "| what | figure | source |",
        "|---|---|---|",
        f"| broker, async with a staleness bound, {broker['params']['workers']} workers x "
        f"{broker['params']['slots']} slots, {broker['params']['tokens']}-token samples | "
        f"{bounded['samples_per_s']:,.0f} samples/s trained, {bounded['broker_cpu_us_per_sample']:.0f} us of "
        f"broker CPU per sample{streamed_latency(broker)} | "
        f"[broker-throughput]({{root}}results/broker-throughput/) |",
        f"| torch engine, long-tailed lengths: continuous batching over static `generate`, useful tokens/s | "
        f"{gains} | [engine-throughput]({{root}}results/engine-throughput/) |",
        f"| torch engine on CPU, one decode step at {' / '.join(map(str, shown))} active sequences (ms) | "
        f"{steps_ms} | [engine-throughput]({{root}}results/engine-throughput/) |",
        f"| learner step, {args['n']} samples x {args['seq']} tokens: DeepSpeed {'/'.join(others)} over "
        "plain "
        f"torch, median step time | {ratios} | [learner-step]({{root}}results/learner-step/) |",
        f"| `april sft` (the tiny model: {sft['parameters'] / 1e6:.2f}M parameters, {sft['steps']} steps) | "
        f"{sft['wall_s']:.0f} s; held-out accuracy greedy {sft['eval']['greedy']['accuracy']:.3f}, sampled "
        f"{sft['eval']['sampled']['accuracy']:.3f} | [sft]({{root}}results/sft/) |",
    ]
    commands = "; ".join(
        f"`{load(f'results/{n}/provenance.json')['command']}`"
        for n in ("broker-throughput", "engine-throughput", "learner-step", "sft")
    )
    return "\n".join(
        [*rows, "", f"Commands: {commands}; each folder's `provenance.json` has its commit and load."]
    )


def block_learner_memory() -> str:
    doc = load("results/learner-memory/learner_memory.json")
    gib = 1024**3
    by_tokens: dict[int, dict[str, dict[str, Any]]] = {}
    for r in doc["rows"]:
        by_tokens.setdefault(r["tokens_per_step"], {})[r["config"]] = r
    args = doc["args"]

    def cell(row: dict[str, Any] | None) -> str:
        if row is None:
            return "-"
        cuda = row.get("cuda_max_allocated_bytes")
        extra = f" (CUDA {cuda / gib:.2f})" if cuda is not None else ""
        return f"{row['peak_rss_bytes'] / gib:.2f}{extra} in {row['micro_batches']} mb, {row['step_s']:.0f} s"

    rows = [
        "| tokens per step (samples x (prompt + response)) | before: full logits, peak GiB "
        "| after: defaults, peak GiB |",
        "|---|---|---|",
    ]
    for tokens, configs in sorted(by_tokens.items()):
        length = next(iter(configs.values()))["response_len"]
        rows.append(
            f"| {tokens:,} ({args['samples']} x ({args['prompt']} + {length})) "
            f"| {cell(configs.get('before'))} | {cell(configs.get('after'))} |"
        )
    growth = ", ".join(
        f"{g['from_tokens']:,}->{g['to_tokens']:,}: {g['bytes'] / 1024:.1f}"
        for g in doc["growth_per_token"]["after"]
    )
    before = ", ".join(
        f"{g['from_tokens']:,}->{g['to_tokens']:,}: {g['bytes'] / 1024:.0f}"
        for g in doc["growth_per_token"]["before"]
    )
    return sourced(
        "learner-memory",
        rows,
        (
            f"Peak = the child process's maximum resident set (interpreter, torch and "
            f"{args['backend']} included), `mb` = micro-batches in the step. KiB of peak added per token, "
            f"after: {growth}; before: {before}. Target: {doc['target_bytes'] / gib:.0f} GiB."
        ),
    )


def block_weight_sync() -> str:
    doc = load("results/weight-sync/weight_sync.json")
    rows = [
        "| model | transport | sync s (publish, transfer, load) | transfer s | transfer GB/s | x loopback |",
        "|---|---|---|---|---|---|",
    ]
    for size in doc["sizes"]:
        model = f"{size['parameters'] / 1e6:.0f}M ({size['loopback']['bytes'] / 1e9:.2f} GB)"
        lb = size["loopback"]
        rows.append(
            f"| {model} | loopback TCP | - | {lb['transfer_s']:.3f} | {lb['transfer_gbps']:.2f} | 1 |"
        )
        for name, t in size["transports"].items():
            rows.append(
                f"| {model} | {name} | {t['sync_s']:.3f} | {t['transfer_s']:.3f} | "
                f"{t['transfer_gbps']:.2f} | {t['vs_loopback']:.2f} |"
            )
    notes = [f"Medians of {doc['args']['rounds']} rounds after a warm-up."]
    if "network" in doc["transports"]:
        ratios = ", ".join(
            f"{s['size']} {s['transports']['network']['vs_loopback']:.2f}x" for s in doc["sizes"]
        )
        notes.append(
            f"Target: network transfer at {doc['target_network_vs_loopback']}x loopback or better; "
            f"measured {ratios}."
        )
    if doc["skipped"]:
        notes.append("Not measured: " + "; ".join(f"{t} ({why})" for t, why in doc["skipped"].items()) + ".")
    return sourced("weight-sync", rows, " ".join(notes))


def block_weight_sync_sglang() -> str:
    doc = load("results/weight-sync-sglang/weight_sync.json")
    rows = [
        "| model | path into the server | sync s | publish s | after the publish s | GB/s after it |",
        "|---|---|---|---|---|---|",
    ]
    names = {"sglang-disk": "disk: file, link, /update_weights_from_disk",
             "sglang-broadcast": "collective: gloo broadcast, read back"}  # fmt: skip
    notes = [f"Medians of {doc['args']['rounds']} rounds after a warm-up."]
    for size in doc["sizes"]:
        gb = size["transports"]["sglang-broadcast"]["bytes"] / 1e9
        model = f"{size['parameters'] / 1e6:.0f}M bf16 ({gb:.2f} GB)"
        for name, t in size["transports"].items():
            rows.append(
                f"| {model} | {names[name]} | {t['sync_s']:.3f} | {t['publish_s']:.3f} | "
                f"{t['transfer_s']:.3f} | {t['transfer_gbps']:.2f} |"
            )
        r = size["sglang_disk_over_broadcast"]
        notes.append(
            f"{size['size']}: the disk path takes {x(r['sync_s'])} the collective's sync time, "
            f"{x(r['transfer_s'])} its time after the publish."
        )
    return sourced("weight-sync-sglang", rows, " ".join(notes))


def block_accuracy() -> str:
    text = (DOCS / "results/accuracy/accuracy.md").read_text()
    body = re.sub(r"^# .*\n+", "", text)  # the file's own title: the doc has its heading
    return sourced("accuracy", body.strip())


def block_accuracy_summary() -> str:
    doc = load("results/accuracy/accuracy.json")
    parts = []
    for mode, s in doc["modes"].items():
        final = s["final_train_accuracy"]
        parts.append(f"{mode} {final['mean']:.3f} ± {final['std']:.3f}")
    ratios = ", ".join(f"{m} {r:.2f}x" for m, r in doc["ratios_to_sync"].items() if r is not None)
    return (
        f"training accuracy over the last {doc['final_window']} of {doc['steps']} steps, mean ± std over "
        f"{len(next(iter(doc['modes'].values()))['seeds'])} seeds: {'; '.join(parts)}; wall time to "
        f"{doc['target']} relative to sync: {ratios}. {source('accuracy')}"
    )


def block_soak() -> str:
    s = load("results/soak/soak.json")
    kills = ", ".join(f"{n} {role}" for role, n in s["kills"].items())
    return (
        f"{s['duration_s'] / 60:.0f}-minute soak (sim workers, the real tiny learner): "
        f"{sum(s['kills'].values())} "
        f"SIGKILLs ({kills}), {s['steps']:,} steps trained once each, {s['trained_samples']:,} samples, "
        f"{s['samples_lost']} lost, every check held: {', '.join(k for k, ok in s['checks'].items() if ok)}. "
        + source("soak")
    )


def block_soak_table() -> str:
    s = load("results/soak/soak.json")
    moments: dict[str, list[str]] = {}  # where each learner and broker kill landed
    for event in s["kill_moments"]:
        if event["killed"] in ("learner", "broker"):
            where = (
                "with a batch unacked" if event["unacked_batch"] else
                "while the learner waited for a batch" if event["learner_waiting"] else "between steps"
            )  # fmt: skip
            moments.setdefault(event["killed"], []).append(
                f"at {event['t']:.0f} s {where}" + (" during an abort round" if event["aborting"] else "")
            )
    ledger = s["ledger"]
    dropped = sum(ledger["dropped"].values())
    rows = [
        "| figure | value |",
        "|---|---|",
        f"| kills survived | {sum(s['kills'].values())}: "
        + ", ".join(f"{role} {n}" for role, n in s["kills"].items())
        + f" (restarts: {', '.join(f'{k} {v}' for k, v in s['restarts'].items())}) |",
        *(f"| {role} kills landed | {'; '.join(m)} |" for role, m in moments.items()),
        f"| steps trained | {s['steps']:,} (metrics.jsonl steps 0..{s['steps'] - 1} once each) |",
        f"| samples trained (broker's count) | {s['trained_samples']:,} of {s['expected_samples']:,} "
        f"expected: {s['samples_lost']} lost |",
        f"| final ledger (groups) | issued {ledger['issued']:,} = trained {ledger['trained']:,} + "
        f"complete_waiting {ledger['complete_waiting']} + in_flight {ledger['in_flight']} + "
        f"partial {ledger['partial']} + dropped {dropped} |",
        f"| rejections | {sum((s['rejected'] or {}).values())} {s['rejected'] or ''} |",
        f"| checks | {', '.join(f'{k}: {ok}' for k, ok in s['checks'].items())} |",
        f"| wall time | {s['wall_s']:,.0f} s |",
    ]
    return sourced("soak", rows)


def block_compose() -> str:
    """README's docker-compose figures: the images and each phase of `make compose-test`."""
    r = load("results/compose/compose_test.json")
    if r["outcome"] != "passed":
        raise SystemExit(
            f"results: docs/results/compose holds a run that {r['outcome']}: {r.get('reason', '')}"
        )
    img, run = r["images_mb"], r["run"]
    names = {
        "install_engine": "install Debian's docker.io",
        "base_image": "base image from Debian's packages",
        "wheelhouse": "`make wheelhouse`",
        "build": "build april's image",
        "up": "`up` until every service runs",
        "train": f"{run['steps']} steps of {run['samples_per_step']} samples, {run['workers']} torch workers",
    }
    rows = ["| phase of `make compose-test` | seconds |", "|---|---|"]
    rows += [f"| {names.get(k, k)} | {v:.0f} |" for k, v in r["phases_s"].items()]
    rows.append(f"| all, checks and `down -v` included | {r['total_s']:.0f} |")
    return sourced(
        "compose",
        (
            f"Image `april:cpu` {img['april'] / 1e3:.2f} GB on `{r['base_image']}` ({img['base']:.0f} MB), "
            f"of which torch {img['torch_in_april'] / 1e3:.2f} GB. Workers loaded weights by "
            f"{run['weights_transports']}."
        ),
        rows,
    )


def block_fuzz() -> str:
    f = load("results/fuzz/fuzz.json")
    top = ", ".join(f"{k} {v:,}" for k, v in list(f["outcomes"].items())[:6])
    return (
        f"{f['inputs']:,} mutated inputs (seed {f['seed']}) in {f['wall_s']:.0f} s, only `ProtocolError` "
        "raised; "
        f"outcomes {top}, ... " + source("fuzz")
    )


def block_headline() -> str:
    """The README's summary paragraph: one sentence per artifact, each figure from it."""
    lines = load("results/up-run/metrics.jsonl")
    t0 = started_at("up-run")
    first = statistics.fmean(r["accuracy"] for r in lines[:10])
    last = statistics.fmean(r["accuracy"] for r in lines[-10:])
    off = statistics.fmean(r["offpolicy_token_frac"] for r in lines[1:])
    paper = load("bench/paper-sim/bench.json")
    speed = {label: f["speedup"] for label, f in paper["modes"].items()}
    wasted = sum(f["wasted_tokens"] for f in paper["modes"].values())
    error = max(abs(e) for e in paper["prediction_error"].values())
    agentic = load("bench/agentic-sim/bench.json")
    agentic_error = max(abs(e) for e in agentic["prediction_error"].values())
    acc = load("results/accuracy/accuracy.json")
    finals = ", ".join(f"{m} {s['final_train_accuracy']['mean']:.3f}" for m, s in acc["modes"].items())
    soak = load("results/soak/soak.json")
    minutes = (lines[-1]["time"] - t0) / 60
    aborted = statistics.fmean(r["aborted"] for r in lines)
    seeds = len(next(iter(acc["modes"].values()))["seeds"])
    rg = load("results/word-sequence-reversal-run/learning_run.json")
    rg_after = [rg["held_out"][m]["sampled"]["solved"] for m in rg["modes"]]
    return (
        f"`make up` lifts the tiny model's sampled training accuracy from {first:.2f} (steps 0-9) to "
        f"{last:.2f} (the last 10 of {len(lines)} steps) in {minutes:.1f} minutes, with {aborted:.0f} "
        f"samples aborted and resumed per step on average and {off:.0%} of the trained tokens off-policy. "
        "`april bench` with real broker, worker and learner processes on the sim engine at paper scale "
        f"(GPU-like cost, 8 engines): april trains {x(speed['april'])} and async {x(speed['async-eta1'])} "
        f"({x(speed['async-eta2'])} at `max_staleness` 2) the samples/s of sync, with {wasted} tokens "
        f"wasted; the simulator predicted those runs within {error:.1%}, and runs of agentic episodes "
        f"(tool calls of median 1 s and p99 30 s) within {agentic_error:.1%}. Over {seeds} seeds x "
        f"{acc['steps']} steps on the built-in task, mean training accuracy over the last "
        f"{acc['final_window']} steps: {finals}. On reasoning-gym's `word_sequence_reversal`, a task no "
        "one here wrote, each mode raised the solve rate at T=1 on held-out questions from "
        f"{rg['held_out']['v0']['sampled']['solved']:.3f} to {min(rg_after):.3f}-{max(rg_after):.3f} "
        f"in {rg['runs'][rg['modes'][0]]['final_version']} steps. "
        f"A {soak['duration_s'] / 60:.0f}-minute soak with "
        f"{sum(soak['kills'].values())} random SIGKILLs of workers, learner and broker lost "
        f"{soak['samples_lost']} samples."
    )


def block_scheduling() -> str:
    doc = load("results/scheduling/scheduling.json")
    settings = list(dict.fromkeys((r["workload"], r["prompt_corr"]) for r in doc["results"]))
    head = (
        "| run | "
        + " | ".join(f"{w}{', lengths follow the prompt' if c else ''}" for w, c in settings)
        + " | example command (math-long-tail; add --seed S) |"
    )
    rows = [head, "|---" * (len(settings) + 2) + "|"]
    for label in dict.fromkeys(r["run"] for r in doc["results"]):
        cells = []
        for w, c in settings:
            (r,) = [r for r in doc["results"] if (r["run"], r["workload"], r["prompt_corr"]) == (label, w, c)]
            cells.append(f"{x(r['speedup_mean'])} (stale {r['staleness_mean']:.2f}/{r['staleness_max']})")
        example = next(r["command"] for r in doc["results"] if r["run"] == label)
        rows.append(f"| {label} | " + " | ".join(cells) + f" | `{example}` |")
    p = doc["params"]
    seeds = ", ".join(map(str, p["seeds"]))
    note = (
        f"Samples/s over the same seed's sync run, mean over seeds {seeds}; stale: mean/max staleness of "
        f"trained samples. {p['steps']} learner steps each; correlated lengths: prompt_corr "
        f"{p['correlated'][0]:g}, {p['correlated'][1]} prompts. Min-max over seeds and slot utilisation per "
        "run are in the JSON."
    )
    return sourced("scheduling", rows, note)


def gathered_row(pair: dict[str, Any], plain: dict[str, Any]) -> str:
    """The row of a gathered scenario (`streamed-gathered`, `flood-gathered`) set against its plain pair."""
    return (
        f"| the same, each worker sending what it owes within {pair['result_hold_ms']:g} ms as one message "
        f"(`{pair['scenario']}`, `worker.result_hold_ms`): {pair['messages_per_sample']:.2f} messages a "
        f"sample against {plain['messages_per_sample']:.2f}, {pair['broker_cpu_us_per_sample']:,.0f} us of "
        f"broker CPU per sample against {plain['broker_cpu_us_per_sample']:,.0f}, p50 / p99 from a sample's "
        f"finish to its slot's next lease {pair['latency_ms_p50']:.1f} / {pair['latency_ms_p99']:.1f} ms "
        f"against {plain['latency_ms_p50']:.1f} / {plain['latency_ms_p99']:.1f} | "
        f"{pair['samples_per_s']:,.0f} |"
    )


def block_cluster_load() -> str:
    sim = load("results/cluster-load/simulate.json")
    (fig,) = sim["modes"].values()
    broker = {r["scenario"]: r for r in load("results/broker-throughput/broker_throughput.json")["results"]}
    s = sim["setting"]
    rows = [
        "| what | samples/s |",
        "|---|---|",
        f"| asked of the broker by {s['engines']:,} engines x {s['slots']} slots "
        f"({s['rollout_batch_size']:,} x {s['n_samples_per_prompt']} samples a step, async), "
        "mean over the run | "
        f"{fig['broker_arrivals_per_s_mean']:,.0f} |",
        f"| the same, busiest second | {fig['broker_arrivals_per_s_peak']:,.0f} |",
        f"| one broker process on this machine, `steady` (no admission bound) | "
        f"{broker['steady']['samples_per_s']:,.0f} |",
        f"| one broker process on this machine, `bounded` (async with a staleness bound) | "
        f"{broker['bounded']['samples_per_s']:,.0f} |",
    ]
    ceiling = broker.get("ceiling")
    if ceiling is not None:  # artifacts from before the scenario existed have none
        rows.append(
            "| what this machine carries through one Python broker process that keeps no books (`ceiling`: "
            "steady's workers against an echo broker), samples/s returned | "
            f"{ceiling['generated_per_s']:,.0f} |"
        )
    streamed = broker.get("streamed")
    if streamed is not None:  # artifacts from before the scenario existed have none
        rows.append(
            "| one broker process on this machine, `streamed` (one sample a message, as engines return "
            f"them, {streamed['generated_per_s']:,.0f} samples/s offered): p50 / p99 from a result to its "
            f"lease {streamed['latency_ms_p50']:.1f} / {streamed['latency_ms_p99']:.1f} ms"
            f"{latency_floor(broker.get('floor'))}, "
            f"{streamed['broker_cpu_us_per_sample']:,.0f} us of broker CPU per sample | "
            f"{streamed['samples_per_s']:,.0f} |"
        )
        if (pair := broker.get("streamed-gathered")) is not None:
            rows.append(gathered_row(pair, streamed))
    flood, flood_ceiling = broker.get("flood"), broker.get("flood-ceiling")
    if flood is not None and flood_ceiling is not None:  # artifacts from before the scenarios have none
        rows.append(
            "| one broker process on this machine, `flood` (one sample a message, as engines return them, "
            f"offered far above capacity: its workers returned {flood['generated_per_s']:,.0f} samples/s; "
            f"against an echo broker, `flood-ceiling`, {flood_ceiling['generated_per_s']:,.0f}), trained | "
            f"{flood['samples_per_s']:,.0f} |"
        )
    gathered = broker.get("flood-gathered")
    if flood is not None and gathered is not None:  # artifacts from before the scenario have none
        rows.append(gathered_row(gathered, flood))
    crowd = broker.get("flood-crowd")
    if crowd is not None:  # artifacts from before the scenario existed have none
        rows.append(
            f"| the same with {crowd['workers_alive_at_end']:,} workers registered (`flood-crowd`: flood's "
            f"{crowd['workers_alive_at_end'] - crowd['crowd']} and {crowd['crowd']:,} more, each busy with a "
            f"one-sample lease and sending a heartbeat a second), trained | {crowd['samples_per_s']:,.0f} |"
        )
    return "\n".join([*rows, "", source("cluster-load"), "", source("broker-throughput")])


GPU_CHECK = "results/gpu-check"  # made on a lent GPU machine by `make gpu-check`, never by `run`


def block_agentic() -> str:
    """The modes on multi-turn episodes, with tool calls that an abort kills (repeatable) or waits for,
    and with tools that answer at once; the setting, and what the latency costs each mode."""
    tools, instant = load("results/agentic/simulate.json"), load("results/agentic-no-latency/simulate.json")
    runs = [
        ("repeatable" if p["point"]["worker.sim_tool_repeatable"] else "waited for", p["modes"])
        for p in tools["sweep"]
    ]
    runs.append(("no latency", instant["modes"]))
    head = "| tool calls | mode | samples/s | vs sync | slot util | bubble | off-policy | stale mean/max |"
    rows = [head + " aborted | re-prefill |", "|---" * 10 + "|"]
    for label, modes in runs:
        for mode, f in modes.items():
            cells = (
                f"{f['samples_per_s']:.3f}",
                x(f["speedup"]),
                num(f["slot_utilization"]),
                num(f["bubble_frac"]),
                num(f["offpolicy_token_frac"]),
                f"{f['staleness_mean']:.2f}/{f['staleness_max']}",
                str(f["aborted"]),
                num(f["reprefill_frac"]),
            )
            rows.append(f"| {label} | {mode} | " + " | ".join(cells) + " |")
    costs = ", ".join(
        f"{mode} {1 - f['samples_per_s'] / instant['modes'][mode]['samples_per_s']:.0%}"
        for mode, f in runs[0][1].items()
    )
    s, e = tools["setting"], tools["setting"]["episodes"]
    ratio = s["over_sampling_batch_size"] / s["rollout_batch_size"]
    setting = (
        f"{s['rollout_batch_size']} x {s['n_samples_per_prompt']} samples a step, over-sampling "
        f"{s['over_sampling_batch_size']} groups ({ratio:g}x the batch), max_staleness {s['max_staleness']}, "
        f"{s['engines']} engines x {s['slots']} slots, learner {s['learner_step_s']:g} s a step, "
        f"{s['steps']} steps. Episodes of `{e['turns']}` model turns of `{s['lengths']}` tokens (at most "
        f"{e['max_turn_tokens']}), a tool call between two turns of "
        f"`{e['tool_ms']}` ms answering `{e['observation_tokens']}` tokens, {s['max_new_tokens']} tokens an "
        f"episode (model and answers)."
    )
    return "\n".join(
        [
            *rows,
            "",
            setting,
            f"Samples/s the tool latency costs (repeatable calls against none): {costs}.",
            "",
            source("agentic"),
            "",
            source("agentic-no-latency"),
        ]
    )


def block_agentic_sim() -> str:
    """The agentic episodes as real processes, each run against the simulator's prediction of it."""
    error = max(abs(e) for e in load("bench/agentic-sim/bench.json")["prediction_error"].values())
    return bench_table(
        "agentic-sim",
        f"Every run's samples/s is within {error:.1%} of what `april simulate` predicted for it.",
    )


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def pct(value: Any) -> str:
    return "-" if value is None else f"{value:.1%}"


def gpu_device_line(a: dict[str, Any]) -> str:
    d, libs = a["device"], a["device"].get("libraries", {})
    spec = d.get("dense_bf16_tflops_spec")
    matmul = d.get("matmul") or {}
    peak = (
        f"dense bf16 peak {spec:,.0f} TFLOP/s (NVIDIA's data sheet)" if spec else "no data-sheet peak for it"
    )
    measured = (
        f"a {matmul['n']:,}-cube {matmul['dtype']} matmul ran at {matmul['tflops']:,.1f} TFLOP/s in this run"
        if matmul
        else "no matmul measured"
    )
    memory = f"{d['memory_gib']:.1f} GiB, " if d.get("memory_gib") else ""
    return (
        f"On {d.get('name')} ({memory}driver {d.get('driver') or '-'}, compute capability "
        f"{d.get('capability') or '-'}), torch {libs.get('torch')} (CUDA {d.get('torch_cuda') or '-'}), "
        f"transformers {libs.get('transformers')}, DeepSpeed {libs.get('deepspeed')}: {peak}; {measured}. "
        f"The check took {a['wall_s']:.0f} s of its {a['budget_s']:.0f} s budget."
    )


def gpu_phase_rows(phases: dict[str, Any]) -> list[str]:
    rows = ["| phase | status | seconds | errors, or why skipped |", "|---|---|---|---|"]
    for name, e in phases.items():
        why = "; ".join(e.get("errors") or []) or e.get("reason", "")
        rows.append(f"| {name} | {e['status']} | {e['wall_s']:.0f} | {why.replace('|', '/')} |")
    return rows


def gpu_learner_rows(phases: dict[str, Any], comparison: list[dict[str, Any]]) -> list[str]:
    learners = {
        n: e for n, e in phases.items() if n.startswith("learner-") and e.get("result", {}).get("sizes")
    }
    if not learners:
        return []
    model = next(iter(learners.values()))["result"]["model"]
    rows = [
        f"Learner step, {model['shape']} shape ({count(model['parameters'])} parameters, "
        f"{model['dtype']}, random weights), `learner.step.train_step` with DeepSpeed and the default "
        "layout; model-FLOPs utilisation against the data sheet's peak / the matmul measured above:",
        "",
        "| optimizer | samples x (prompt + response) | micro-batches | step s | tokens/s (all) | MFU "
        "| MFU with attention | peak GiB | model built, engine set up (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in learners.values():
        r = e["result"]
        opt = f"{r['engine']['adam_impl']} ({' > '.join(r['engine']['optimizer'])})"
        for z in r["sizes"]:
            mfu = {
                k: f"{pct(z['mfu']['spec'][k])} / {pct(z['mfu']['measured'][k])}" for k in z["mfu"]["spec"]
            }
            peak = "-" if z["peak_allocated_gib"] is None else f"{z['peak_allocated_gib']:.1f}"
            size = f"{z['samples']} x ({z['prompt_len']} + {z['response_len']:,})"
            rows.append(
                f"| {opt} | {size} | {z['micro_batches']} | {z['median_s']:.2f} | {z['tokens_per_s']:,.0f} | "
                f"{mfu['weights']} | {mfu['with_attention']} | {peak} | "
                f"{r['model']['build_s']:.0f}, {r['engine']['setup_s']:.0f} |"
            )
    rows.append("")
    if comparison:
        said = [
            f"at {c['size']} "
            + ", ".join(f"{impl} {sec:.2f} s" for impl, sec in c["median_s"].items())
            + f" ({c['fastest']} the faster)"
            for c in comparison
        ]
        rows += ["Optimizers, median step: " + "; ".join(said) + ".", ""]
    return rows


def gpu_up_line(phases: dict[str, Any]) -> list[str]:
    r = phases.get("up", {}).get("result", {})
    run = r.get("run")
    if not run or run.get("first_step_s") is None:
        return []
    return [
        f"`{r['command']}`: the first trained step {run['first_step_s']:.0f} s after the launch, "
        f"steps trained {run['steps']}, the exit at {run['wall_s']:.0f} s; "
        f"{num(run['samples_per_s'], '.1f')} samples/s (summary.json's: trained samples over the steps' "
        "time).",
        "",
    ]


def gpu_engine_rows(phases: dict[str, Any]) -> list[str]:
    r = phases.get("engine", {}).get("result", {})
    decode, rows = r.get("decode", {}), []
    if decode:
        counts = sorted({int(k) for d in decode.values() for k in d["ms_at"]})
        shown = [c for c in counts if c in (1, 16, 64)] or counts
        rows += [
            f"| torch engine, model | decode ms a step, rows {' / '.join(map(str, shown))} | how it ran |",
            "|---|---|---|",
            *(
                f"| {name} | {' / '.join(num(d['ms_at'].get(str(c)), '.2f') for c in shown)} | "
                f"{d.get('placement', '-')}, {d.get('captured_graphs', 0)} graphs |"
                for name, d in decode.items()
            ),
            "",
        ]
        prompt = next(iter(decode.values()))["prompt"]
        options = r.get("engine_options") or "none"
        rows += [f"Decode after a {prompt}-token prompt per row; engine options {options}.", ""]
    b = r.get("batching")
    if b:
        rows += [
            f"Continuous batching on {b['model']}, {b['n']} prompts at {b['slots']} slots, lengths median "
            f"{b['lengths']['median']:.0f}, p99 {b['lengths']['p99']:.0f}, max {b['lengths']['max']}: "
            f"{b['continuous']['tokens_per_s']:,.0f} useful tokens/s against HF `generate`'s "
            f"{b['static_generate']['tokens_per_s']:,.0f} on static batches ({b['ratio']:.2f}x).",
            "",
        ]
    return rows


def gpu_tests_line(phases: dict[str, Any]) -> list[str]:
    r = phases.get("gpu-tests", {}).get("result", {})
    if "counts" not in r:
        return []
    counts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in r["counts"].items() if n)
    reasons = sorted({t["message"] for t in r["tests"] if t["outcome"] == "skipped"})
    return [
        f"`pytest -m gpu`: {counts or 'nothing collected'}"
        + (f" (skipped: {'; '.join(reasons)})" if reasons else "")
        + ".",
        "",
    ]


def block_gpu_check(folder: Path | None = None) -> str:
    """docs/bench.md's "On a GPU": the committed GPU check, or how to make one where none is."""
    folder = folder or DOCS / GPU_CHECK
    if not (folder / "gpu_check.json").exists():
        return (
            "No GPU run has been committed yet. A session lent a GPU machine makes one with the commands "
            "above and commits what comes back as `docs/results/gpu-check/`."
        )
    a = json.loads((folder / "gpu_check.json").read_text())
    p = json.loads((folder / "provenance.json").read_text())
    targets = ["| target | limit | measured | met |", "|---|---|---|---|"] + [
        f"| {t['target']} | {t['limit']} | {num(t['measured'], '.2f')} | "
        f"{ {True: 'yes', False: '**no**', None: 'not measured'}[t['met']] } |"
        for t in a["targets"]
    ]
    dirty = " (with uncommitted changes)" if p["dirty"] else ""
    return "\n".join(
        [
            gpu_device_line(a),
            "",
            *gpu_phase_rows(a["phases"]),
            "",
            *gpu_learner_rows(a["phases"], a.get("optimizers", [])),
            *gpu_up_line(a["phases"]),
            *gpu_engine_rows(a["phases"]),
            *targets,
            "",
            *gpu_tests_line(a["phases"]),
            f"Source: [`docs/{GPU_CHECK}/`]({{root}}{GPU_CHECK}/), made by `{p['command']}` at commit "
            f"`{p['commit'][:10]}`{dirty} on {p['date'][:10]}, {p['wall_s'] / 60:.0f} min.",
        ]
    )


BLOCKS: dict[str, Callable[[], str]] = {
    "cluster-load": block_cluster_load,
    "agentic": block_agentic,
    "scheduling": block_scheduling,
    "headline": block_headline,
    "up-run": block_up_run,
    "calculator-run": lambda: block_up_run("calculator-run"),
    "calculator-held-out": block_calculator_held_out,
    "sft-calculator": block_sft_calculator,
    "sft-word-sequence-reversal": lambda: block_sft_reasoning_gym("sft-word-sequence-reversal"),
    "word-sequence-reversal-run": lambda: block_reasoning_gym_run(
        "word-sequence-reversal-run", "models/tiny-word-sequence-reversal"
    ),
    "sft-spell-backward": lambda: block_sft_reasoning_gym("sft-spell-backward"),
    "spell-backward-run": lambda: block_reasoning_gym_run("spell-backward-run", "models/tiny-spell-backward"),
    "simulate": block_simulate,
    "paper-config": block_paper_config,
    "paper-config-gain": block_paper_config_gain,
    "paper-sim": lambda: bench_table("paper-sim"),
    "saturated-sim": lambda: bench_table("saturated-sim"),
    "agentic-sim": block_agentic_sim,
    "torch-tiny": lambda: bench_table("torch-tiny"),
    "scheduling-paper": lambda: bench_table("scheduling-paper"),
    "scheduling-short": lambda: bench_table("scheduling-short"),
    "result-hold": lambda: bench_table("result-hold"),
    "components": block_components,
    "learner-memory": block_learner_memory,
    "weight-sync": block_weight_sync,
    "weight-sync-sglang": block_weight_sync_sglang,
    "accuracy": block_accuracy,
    "accuracy-summary": block_accuracy_summary,
    "soak": block_soak,
    "soak-table": block_soak_table,
    "fuzz": block_fuzz,
    "compose": block_compose,
    "gpu-check": block_gpu_check,
}
MARKER = re.compile(r"<!-- measured:([\w-]+) -->(.*?)<!-- /measured:\1 -->", re.S)


def render_text(text: str, root: str) -> tuple[str, list[str]]:
    """`text` with every measured block rendered afresh (links relative to the page: `root` is the path
    from the page to docs/); the names of the blocks whose text changed."""
    changed: list[str] = []

    def fill(match: re.Match[str]) -> str:
        name, old = match.group(1), match.group(2)
        if name not in BLOCKS:
            raise SystemExit(f"results: unknown measured block {name!r} (known: {', '.join(BLOCKS)})")
        inline = "\n" not in old
        body = BLOCKS[name]().replace("{root}", root)
        new = f" {body} " if inline else f"\n{body}\n"
        if new != old:
            changed.append(name)
        return f"<!-- measured:{name} -->{new}<!-- /measured:{name} -->"

    return MARKER.sub(fill, text), changed


def pages() -> list[tuple[Path, str]]:
    return [(REPO / "README.md", "docs/"), *((p, "") for p in sorted(DOCS.glob("*.md")))]


def render(check: bool) -> int:
    stale = []
    for page, root in pages():
        text = page.read_text(encoding="utf-8")
        new, changed = render_text(text, root)
        if changed and check:
            stale += [f"{page.relative_to(REPO)}: {name}" for name in changed]
        elif changed:
            page.write_text(new, encoding="utf-8")
            print(f"results: rendered {', '.join(changed)} in {page.relative_to(REPO)}", file=sys.stderr)
    if stale:
        print(
            "stale measured blocks (python benchmarks/results.py render):\n" + "\n".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv_: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run", help="rerun the measurements into docs/")
    r.add_argument("--only", default="", help="comma-separated step names (default: all)")
    r.add_argument("--list", action="store_true", help="print the plan and exit")
    r.add_argument("--smoke", action="store_true", help="the cheap steps at tiny sizes, into --out")
    r.add_argument("--out", type=Path, default=None, help="with --smoke: where the artifacts go")
    g = sub.add_parser("render", help="render the measured blocks of README.md and docs/*.md")
    g.add_argument("--check", action="store_true", help="exit 1 if a block is stale; write nothing")
    args = p.parse_args(argv_)
    if args.verb == "render":
        return render(args.check)
    steps = [s for s in STEPS if s.smoke] if args.smoke else list(STEPS)
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = wanted - {s.name for s in STEPS}
        if unknown:
            p.error(f"--only: unknown step(s) {', '.join(sorted(unknown))}")
        steps = [s for s in steps if s.name in wanted]
    if args.list:
        for s in steps:
            print(f"{s.name:18} {s.minutes:5.0f} min  docs/{s.dest}/  {s.command}")
        print(f"{'total':18} {sum(s.minutes for s in steps):5.0f} min")
        return 0
    if args.smoke and args.out is None:
        p.error("--smoke needs --out (the smoke run never writes docs/)")
    docs = args.out if args.smoke else DOCS
    for s in steps:
        run_step(s, docs, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
