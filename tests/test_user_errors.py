"""Every command, fed bad input as a user would type it, answers with one readable line and a non-zero exit.

Each case runs `april` in a real subprocess (what a user sees, Python's own traceback printing included)
and asserts: a non-zero exit; stderr, stripped, is exactly one line; no "Traceback" anywhere in stdout or
stderr; and the line names what was wrong. Commands that start long-running processes (up, broker,
worker, learner) must reject the input before anything starts: the subprocess timeout is only a "did not
hang" guard, and the run or output directory ({out}) must not have been created.

Placeholders in the arguments, filled per test: {tmp} (a fresh directory), {out} (a run or output
directory in it, which must not exist afterwards: nothing started), {missing} (a directory that does not
exist), {notok} (a complete model directory without tokenizer files), {file} (a regular file,
for paths that need a directory there), {keys} (a generated CurveZMQ key directory), {prompts} (a JSONL
prompt file), {tiny} (the shipped tiny model).

What does not apply, and why:
  - a model directory without a tokenizer: `simulate`, `status`, `keys`, `task`, `rollouts` and `broker`
    take no model; `sft` builds its model from scratch; the learner trains on token ids and needs no
    tokenizer (a model directory without one is valid for it; it is given one missing entirely instead).
  - a missing config file: `status`, `sft`, `keys`, `task` and `rollouts` read no config file.
  - a malformed --set / an unknown config key / a device of a bad form: only the commands that take
    `--set` (up, simulate, bench, generate, broker, worker, learner, data inspect).
  - a device torch does not see (this machine has no GPU: "cuda", "cuda:N"): only the commands that run
    something on a device (up, generate, worker, learner); the broker runs on none.
  - `data inspect` reads the {prompts} file with training's keys, which need an answer: its model cases
    set `data.answer_key=` (no answers) so that the model, not the dataset, is what is wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

from april.hf import TOKENIZER_FILES
from april.keys import generate as generate_keys

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
TIMEOUT_S = 120  # "did not hang": every case fails long before this


@dataclass(frozen=True, slots=True)
class Case:
    command: str
    wrong: str  # what is wrong with the input
    args: str  # the command line after `april`, split on spaces; placeholders as in the module docstring
    names: tuple[str, ...]  # what the error line must name (each a substring of it)


def case(command: str, wrong: str, args: str, *names: str) -> Case:
    return Case(command, wrong, args, names)


NO_TOKENIZER = "has no tokenizer"
NOT_FOUND = "does not exist"
NO_GPU = "torch sees no CUDA GPU"
DEVICE_FORMS = "expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
M = "{missing}"

CASES = [
    # command, what is wrong, the command line, what the error line names
    case("up", "missing config", f"up --headless --config {M}/a.toml", "--config", "a.toml"),
    case("up", "missing resume dir", f"up --headless --resume {M}/run", "--resume", "config.toml"),
    case("up", "missing model dir", f"up --headless --run-dir {{out}} --set worker.model={M}/m", f"{M}/m",
         NOT_FOUND),
    case("up", "model without tokenizer", "up --headless --run-dir {out} --set learner.model={notok}",
         "{notok}", NO_TOKENIZER),
    case("up", "missing dataset", f"up --headless --run-dir {{out}} --set data.source={M}/d.jsonl",
         f"{M}/d.jsonl"),
    case("up", "bad enum", "up --headless --mode fast", "--mode", "'fast'", "sync"),
    case("up", "unknown env", "up --headless --run-dir {out} --set env.name=nope:Cls", "env.name", "'nope'"),
    case("up", "env without a model", "up --headless --engine sim --run-dir {out} --set env.name=calculator "
         "--set worker.model=", "env.name", "worker.model"),
    case("up", "negative count", "up --headless --workers -1", "--workers", "-1"),
    case("up", "malformed --set", "up --headless --set run.steps", "--set", "run.steps"),
    case("up", "unknown config key", "up --headless --set run.bogus=1", "bogus"),
    case("up", "bad worker device", "up --headless --steps 1 --run-dir {out} --set worker.device=bogus",
         "worker.device", "'bogus'", DEVICE_FORMS),
    case("up", "bad learner device", "up --headless --run-dir {out} --set learner.device=gpu",
         "learner.device", "'gpu'", DEVICE_FORMS),
    case("up", "worker device without a GPU", "up --headless --run-dir {out} --set worker.device=cuda",
         "worker.device", "'cuda'", NO_GPU),
    case("up", "learner device without a GPU", "up --headless --run-dir {out} --set learner.device=cuda:1",
         "learner.device", "'cuda:1'", NO_GPU),

    case("bench", "missing lengths file", f"bench --workload {M}/l.txt --out {{out}}", "--workload",
         f"{M}/l.txt"),
    case("bench", "missing model dir", f"bench --engine torch --model {M}/m --out {{out}}", f"{M}/m",
         NOT_FOUND),
    case("bench", "model without tokenizer", "bench --engine sim --real-learner --model {notok} --out {out}",
         "{notok}", NO_TOKENIZER),
    case("bench", "bad enum", "bench --engine warp --out {out}", "--engine", "'warp'"),
    case("bench", "bad modes", "bench --modes sync,fast --out {out}", "--modes", "'fast'"),
    case("bench", "negative count", "bench --steps -1 --out {out}", "--steps", "-1"),
    case("bench", "missing config", f"bench --config {M}/a.toml --out {{out}}", "--config", "a.toml"),
    case("bench", "malformed --set", "bench --set run.steps --out {out}", "--set", "run.steps"),
    case("bench", "unknown config key", "bench --set algo.bogus=1 --out {out}", "bogus"),
    case("bench", "bad staleness list", "bench --max-staleness 1,x --out {out}", "algo.max_staleness",
         "'x'"),

    case("simulate", "missing lengths file", f"simulate --lengths {M}/l.txt", "--lengths", f"{M}/l.txt"),
    case("simulate", "bad modes", "simulate --modes fast", "--modes", "'fast'"),
    case("simulate", "negative count", "simulate --steps -1", "--steps", "-1"),
    case("simulate", "malformed sweep", "simulate --sweep colour=1", "--sweep", "colour"),
    case("simulate", "bad sweep value", "simulate --sweep algo.max_staleness=1,x", "algo.max_staleness",
         "'x'"),
    case("simulate", "missing config", f"simulate --config {M}/a.toml", "--config", "a.toml"),
    case("simulate", "malformed --set", "simulate --set run.steps", "--set", "run.steps"),
    case("simulate", "unknown config key", "simulate --set run.bogus=1", "bogus"),
    case("simulate", "dynamic sampling", "simulate --set algo.dynamic_sampling=1", "algo.dynamic_sampling"),
    case("simulate", "bad config value", "simulate --set algo.max_staleness=-1", "algo.max_staleness", "-1"),
    case("simulate", "buffer below a batch", "simulate --set broker.max_buffered_samples=100",
         "broker.max_buffered_samples = 100", "256"),

    case("generate", "missing prompts", f"generate --engine sim --prompts {M}/p.jsonl", "--prompts",
         f"{M}/p.jsonl"),
    case("generate", "missing config", f"generate --prompts {{prompts}} --config {M}/a.toml", "--config",
         "a.toml"),
    case("generate", "missing model dir", f"generate --engine torch --model {M}/m --prompts {{prompts}}",
         f"{M}/m", NOT_FOUND),
    case("generate", "model without tokenizer", "generate --engine torch --model {notok} --prompts {prompts}",
         "{notok}", NO_TOKENIZER),
    case("generate", "bad enum", "generate --engine warp --prompts {prompts}", "engine", "'warp'"),
    case("generate", "negative count", "generate --engine sim --n -1 --prompts {prompts}", "--n", "-1"),
    case("generate", "malformed --set", "generate --prompts {prompts} --set worker", "--set", "worker"),
    case("generate", "unknown config key", "generate --prompts {prompts} --set worker.bogus=1", "bogus"),
    case("generate", "bad device", "generate --engine sim --prompts {prompts} --set worker.device=gpu",
         "worker.device", "'gpu'", DEVICE_FORMS),
    case("generate", "device without a GPU",
         "generate --engine torch --model {tiny} --prompts {prompts} --set worker.device=cuda",
         "worker.device", "'cuda'", NO_GPU),

    case("broker", "missing --run-dir", "broker", "--run-dir"),
    case("broker", "missing config", f"broker --run-dir {{out}} --config {M}/a.toml", "--config", "a.toml"),
    case("broker", "missing dataset", f"broker --run-dir {{out}} --set data.source={M}/d.jsonl",
         f"{M}/d.jsonl"),
    case("broker", "bad enum", "broker --run-dir {out} --mode fast", "--mode", "'fast'"),
    case("broker", "negative count", "broker --run-dir {out} --rollout-batch-size -1", "rollout_batch_size",
         "-1"),
    case("broker", "malformed --set", "broker --run-dir {out} --set =3", "--set", "'=3'"),
    case("broker", "unknown config key", "broker --run-dir {out} --set broker.bogus=1", "bogus"),
    case("broker", "bad device", "broker --run-dir {out} --set learner.device=cuda:x", "learner.device",
         "'cuda:x'", DEVICE_FORMS),

    case("worker", "missing config", f"worker --config {M}/a.toml", "--config", "a.toml"),
    case("worker", "missing keys dir", f"worker --engine sim --set broker.curve_keys_dir={M}/keys",
         f"{M}/keys"),
    case("worker", "missing model dir", f"worker --engine torch --model {M}/m", f"{M}/m", NOT_FOUND),
    case("worker", "model without tokenizer", "worker --engine torch --model {notok}", "{notok}",
         NO_TOKENIZER),
    case("worker", "bad enum", "worker --engine warp", "engine", "'warp'"),
    case("worker", "negative count", "worker --engine sim --slots -1", "slots", "-1"),
    case("worker", "malformed --set", "worker --engine sim --set slots=3", "--set", "slots"),
    case("worker", "unknown config key", "worker --engine sim --set worker.bogus=1", "bogus"),
    case("worker", "GPU share out of range", "worker --engine torch --set worker.gpu_memory_fraction=1.5",
         "worker.gpu_memory_fraction", "1.5", "(0, 1]"),
    case("worker", "bad device", "worker --engine torch --model {tiny} --set worker.device=bogus",
         "worker.device", "'bogus'", DEVICE_FORMS),
    case("worker", "device without a GPU", "worker --engine torch --model {tiny} --set worker.device=cuda:0",
         "worker.device", "'cuda:0'", NO_GPU),
    case("worker", "malformed broker address", "worker --engine sim --broker nowhere", "worker.broker",
         "'nowhere'", "tcp://HOST:PORT"),

    case("learner", "missing --run-dir", "learner", "--run-dir"),
    case("learner", "malformed broker address", "learner --run-dir {out} --broker tcp://h", "learner.broker",
         "'tcp://h'"),
    case("learner", "missing config", f"learner --run-dir {{out}} --config {M}/a.toml", "--config", "a.toml"),
    case("learner", "missing model dir", f"learner --run-dir {{tmp}}/run --model {M}/m", f"{M}/m", NOT_FOUND),
    case("learner", "missing keys dir",
         f"learner --run-dir {{tmp}}/run --set learner.backend=sim --set broker.curve_keys_dir={M}/keys",
         f"{M}/keys"),
    case("learner", "bad enum", "learner --run-dir {out} --set learner.backend=warp", "learner.backend",
         "'warp'"),
    case("learner", "negative count", "learner --run-dir {out} --steps -1", "run.steps", "-1"),
    case("learner", "malformed --set", "learner --run-dir {out} --set learner", "--set", "learner"),
    case("learner", "unknown config key", "learner --run-dir {out} --set learner.bogus=1", "bogus"),
    case("learner", "bad device", "learner --run-dir {out} --set learner.device=bogus", "learner.device",
         "'bogus'", DEVICE_FORMS),
    case("learner", "device without a GPU",
         "learner --run-dir {out} --model {tiny} --set learner.device=cuda", "learner.device", "'cuda'",
         NO_GPU),

    case("status", "missing keys dir", f"status --keys {M}/keys", f"{M}/keys"),
    case("status", "bad value", "status --timeout soon", "--timeout", "'soon'"),
    case("status", "negative timeout", "status --timeout -1", "--timeout", "-1"),
    case("status", "malformed address", "status --watch --broker localhost", "--broker", "'localhost'"),
    case("status", "malformed address, one status", "status --broker nowhere", "--broker", "'nowhere'"),
    case("status", "port out of range", "status --broker tcp://127.0.0.1:70000", "--broker", "1..65535"),

    case("rollouts", "missing run dir", f"rollouts {M}/run", f"{M}/run", NOT_FOUND),
    case("rollouts", "no records", "rollouts {tmp}", "{tmp}/rollouts/train", "run.rollout_records"),
    case("rollouts", "malformed --sample", "rollouts {tmp} --sample 3-1", "--sample", "'3-1'", "GROUP/INDEX"),
    case("rollouts", "unknown --sort", "rollouts {tmp} --sort best", "--sort", "'best'", "most-aborted"),
    case("rollouts", "both --step and --eval", "rollouts {tmp} --step 1 --eval 1", "--step", "--eval"),
    case("rollouts", "negative step", "rollouts {tmp} --step -1", "--step", "-1"),
    case("rollouts", "zero limit", "rollouts {tmp} --limit 0", "--limit", "0"),
    case("rollouts", "missing argument", "rollouts", "run_dir"),

    case("sft", "unwritable --out", "sft --out {file}/model --steps 1 --eval-prompts 0", "{file}/model"),
    case("sft", "negative count", "sft --steps -1 --out {out}", "--steps", "-1"),
    case("sft", "bad value", "sft --lr fast --out {out}", "--lr", "'fast'"),

    case("keys", "missing keys dir", f"keys add-client {M}/keys alice", f"{M}/keys"),
    case("keys", "bad client name", "keys add-client {keys} ../alice", "../alice"),
    case("keys", "unwritable dir", "keys generate {file}/keys", "{file}/keys"),
    case("keys", "missing argument", "keys generate", "keys_dir"),
    case("keys", "unknown subcommand", "keys rotate", "'rotate'"),

    case("task", "unwritable --out", f"task export --out {M}/t.jsonl", f"{M}/t.jsonl"),
    case("task", "negative count", "task export --out {out} --count -1", "--count", "-1"),
    case("task", "missing option", "task export", "--out"),
    case("task", "unknown subcommand", "task import", "'import'"),

    case("data", "missing dataset", f"data inspect {M}/d.parquet", f"{M}/d.parquet", "cannot read dataset"),
    case("data", "not a dataset directory", "data inspect {tmp}", "{tmp}", "not a saved dataset"),
    case("data", "bad field", "data inspect {prompts} --set data.prompt_key=question", "{prompts}:1",
         "'question'"),
    case("data", "missing answer", "data inspect {prompts}", "{prompts}:1", "missing answer field 'answer'"),
    case("data", "missing config", f"data inspect {{prompts}} --config {M}/a.toml", "--config", "a.toml"),
    case("data", "malformed --set", "data inspect {prompts} --set data", "--set", "data"),
    case("data", "unknown config key", "data inspect {prompts} --set data.bogus=1", "bogus"),
    case("data", "bad enum", "data inspect {prompts} --set data.answer_format=boxed", "data.answer_format",
         "'boxed'"),
    case("data", "missing model dir", f"data inspect {{prompts}} --set data.answer_key= --model {M}/m",
         f"{M}/m", NOT_FOUND),
    case("data", "model without tokenizer", "data inspect {prompts} --set data.answer_key= --model {notok}",
         "{notok}", NO_TOKENIZER),
    case("data", "negative count", "data inspect {prompts} --sample -1", "--sample", "-1"),
    case("data", "unknown subcommand", "data check", "'check'"),

    case("april", "unknown command", "launch", "'launch'"),
    case("april", "unknown option", "--verbose", "--verbose"),
]  # fmt: skip


class Outcome(NamedTuple):
    result: subprocess.CompletedProcess[str]
    fill: dict[str, str]  # the placeholders' values in this case
    started: bool  # {out} exists afterwards


def april(args: list[str], cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    """`april ARGS` in a subprocess, with this checkout (then `pythonpath`) first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("APRIL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), pythonpath, env.get("PYTHONPATH", "")) if p)
    env["COLUMNS"] = "80"  # rich output as in a terminal
    return subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The shared inputs the placeholders name (made once; no case writes into them)."""
    root = tmp_path_factory.mktemp("inputs")
    notok = root / "no-tokenizer"
    shutil.copytree(TINY, notok)
    for name in TOKENIZER_FILES:
        (notok / name).unlink(missing_ok=True)
    plain = root / "plain-file"
    plain.write_text("not a directory\n")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "12+34="}\n')
    generate_keys(root / "keys", False)
    return {
        "missing": str(root / "missing"),
        "notok": str(notok),
        "file": str(plain),
        "keys": str(root / "keys"),
        "prompts": str(prompts),
        "tiny": str(TINY),
    }


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, inputs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[Case, Outcome]:
    """Every selected case run once, several at a time (each is mostly a Python start-up)."""
    selected = [
        item.callspec.params["case"]  # type: ignore[attr-defined]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_one_readable_line"
    ]

    def run(case: Case) -> Outcome:
        tmp = tmp_path_factory.mktemp("case")
        fill = {**inputs, "tmp": str(tmp), "out": str(tmp / "out")}
        result = april([a.format(**fill) for a in case.args.split()], tmp)
        return Outcome(result, fill, (tmp / "out").exists())

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(selected, pool.map(run, selected), strict=True))


@pytest.mark.parametrize("case", CASES, ids=[f"{c.command}: {c.wrong}" for c in CASES])
def test_one_readable_line(case: Case, outcomes: dict[Case, Outcome]) -> None:
    result, fill, started = outcomes[case]
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("april: error: "), lines[0]
    for name in case.names:
        assert name.format(**fill) in lines[0], (name.format(**fill), lines[0])
    assert not started, "the command created its run or output directory before rejecting the input"


# ---------------------------------------------------------------------------------------------------
# not an error: `april generate` on prompts without an answer (generating needs none; scoring does)

SIM = "--engine sim --n 2 --set worker.sim_lengths=fixed:4 --set worker.sim_time_scale=0"


def test_generate_without_answers_prints_samples_without_reward_and_says_so_once(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "12+34="}\n{"prompt": "5+6="}\n')
    result = april(["generate", "--prompts", str(prompts), "--json", *SIM.split()], tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 4 and all(len(r["response_ids"]) == 4 for r in rows)
    assert not any("reward" in r for r in rows)
    assert result.stderr.strip().splitlines() == [
        f"april generate: no prompt in {prompts} has an answer field 'answer': no reward, no accuracy"
    ]


def test_generate_scores_the_prompts_that_have_an_answer(tmp_path: Path) -> None:
    (tmp_path / "two_reward.py").write_text(  # scores the answer, not the (random) sim tokens
        "def reward(response, answer, metadata):\n    return float(answer == '2')\n"
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "12+34="}\n{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": "5"}\n'
    )
    args = ["generate", "--prompts", str(prompts), *SIM.split(), "--set", "worker.reward=two_reward:reward"]
    rows = [json.loads(x) for x in april([*args, "--json"], tmp_path, str(tmp_path)).stdout.splitlines()]
    assert [r.get("reward") for r in rows] == [None, None, 1.0, 1.0, 0.0, 0.0]
    result = april(args, tmp_path, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("reward:   ") == 4
    assert "accuracy 0.500 over 4 scored samples" in result.stdout.splitlines()[-1]
    assert result.stderr.strip().splitlines() == [
        f"april generate: 1 of 3 prompts in {prompts} have no answer field 'answer': their samples get no "
        "reward and are not in the accuracy"
    ]


# ---------------------------------------------------------------------------------------------------
# help stays typer's: rich, on stdout, exit 0 (asked for) or 2 (a group called without a command)


@pytest.mark.parametrize(
    ("args", "code", "shows"),
    [
        ("", 2, ("Usage: april [OPTIONS] COMMAND", "simulate")),
        ("--help", 0, ("Usage: april [OPTIONS] COMMAND", "simulate")),
        ("keys", 2, ("Usage: april keys [OPTIONS] COMMAND", "add-client")),
        ("task", 2, ("Usage: april task [OPTIONS] COMMAND", "export")),
        ("up --help", 0, ("Usage: april up [OPTIONS]", "--workers")),
        ("keys add-client --help", 0, ("Usage: april keys add-client", "keys_dir")),
    ],
)
def test_help_is_still_rich_help(args: str, code: int, shows: tuple[str, ...], tmp_path: Path) -> None:
    result = april(args.split(), tmp_path)
    assert result.returncode == code and result.stderr == "", result.stderr
    assert "╭─" in result.stdout  # rich panels
    for text in shows:
        assert text in result.stdout, text
