"""configs/qwen3-4b-dapo.toml, the APRIL paper's Qwen3-4B DAPO run for one node of 8 GPUs, checked without its
model or dataset (paths the user provides): it loads with the paper's settings, `april up --plan --gpus 8`
gives every GPU to exactly one role with the split slime's and APRIL's Qwen3-4B scripts use, and the
`april simulate` command that docs/bench.md quotes (the `paper-config` step of benchmarks/results.py) runs it
in sync and april mode.
"""

from __future__ import annotations

import importlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from cli.main import app
from cli.options import resolve_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "qwen3-4b-dapo.toml"
PAPER_STEP = "paper-config"  # benchmarks/results.py's step that measures the prediction


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def plan() -> list[dict[str, Any]]:
    code, out = cli("up", "--plan", "--gpus", "8", "--json", "--config", str(CONFIG))
    assert code == 0, out
    processes: list[dict[str, Any]] = json.loads(out)
    return processes


def test_the_config_holds_the_papers_settings() -> None:
    """docs/ and the TOML cite these from APRIL's run-qwen3-4B-dapo-partial.sh: rollout batch 32 groups,
    over-sampling 64, 8 samples a prompt, 16,384 response tokens, temperature 0.8, lr 1e-6, one optimizer step
    a rollout, clip-higher 0.28, dynamic sampling, a binary math reward, april mode."""
    c = resolve_config(CONFIG, [])
    a, lc = c.algo, c.learner
    assert (c.run.mode.value, a.algorithm.value, a.dynamic_sampling) == ("april", "grpo", True)
    assert (a.rollout_batch_size, a.over_sampling_batch_size, a.n_samples_per_prompt) == (32, 64, 8)
    assert (a.max_new_tokens, a.temperature, a.offpolicy.value) == (16384, 0.8, "none")
    assert (lc.lr, lc.updates_per_batch, lc.eps_high, lc.kl_coef) == (1e-6, 1, 0.28, 0.0)
    assert (c.worker.engine, c.worker.reward, c.worker.model, lc.model) == (
        "sglang",
        "math",
        "models/Qwen3-4B",
        "models/Qwen3-4B",
    )
    assert (c.data.source, c.data.answer_key) == ("data/dapo-math-17k.parquet", "reward_model.ground_truth")


def test_the_plan_for_8_gpus_gives_every_gpu_to_one_role() -> None:
    """The learner on 2 GPUs as 2 ranks (slime's decoupled Qwen3-4B: --actor-num-gpus-per-node 2), three
    SGLang engines of 2 GPUs each (--rollout-num-gpus 6, --rollout-num-gpus-per-engine 2), each engine's
    server and worker on the same GPUs (one engine), the broker on none, and no GPU twice."""
    processes = plan()
    by_name = {p["name"]: p for p in processes}
    assert by_name["broker"]["gpus"] == []
    learner = by_name["learner"]
    assert (len(learner["gpus"]), learner["ranks"]) == (2, 2)
    workers = sorted(n for n in by_name if n.startswith("worker-"))
    assert len(workers) == 3
    engines = []
    for name in workers:
        server = by_name[name.replace("worker-", "sglang-")]  # the SGLang server april up starts for it
        assert server["role"] == "sglang" and server["gpus"] == by_name[name]["gpus"], (server, name)
        assert len(by_name[name]["gpus"]) == 2
        engines.append(by_name[name]["gpus"])
    owned = [g for gpus in (learner["gpus"], *engines) for g in gpus]
    assert sorted(owned) == list(range(8)), owned  # every GPU once: no two roles share one
    code, text = cli("up", "--plan", "--gpus", "8", "--config", str(CONFIG))
    assert code == 0 and "3 x engine sglang, learner 2 ranks" in text, text


def test_the_servers_april_up_would_start_take_the_scripts_flags(tmp_path: Path) -> None:
    """Each engine's SGLang server: the model, --tp-size 2 over its own 2 GPUs, slime's decoupled
    --mem-fraction-static 0.7 (worker.sglang_args), a seed of its own."""
    from april.placement import node_gpus, place
    from cli.up_cmd import plan as children

    config = resolve_config(CONFIG, [])
    specs = children(config, tmp_path / "config.toml", tmp_path, place(config, node_gpus(8, {})), False)
    servers = [s for s in specs if s.name.startswith("sglang-")]
    assert len(servers) == 3
    for i, server in enumerate(servers):
        argv = " ".join(server.argv)
        assert "--model-path models/Qwen3-4B" in argv and "--tp-size 2" in argv, argv
        assert argv.endswith("--mem-fraction-static 0.7"), argv  # the user's flags last: they win
        assert f"--random-seed {config.run.seed + i}" in argv, argv
        assert server.env == {"CUDA_VISIBLE_DEVICES": f"{2 + 2 * i},{3 + 2 * i}"}


def paper_step_command() -> list[str]:
    """The `april simulate` command of the `paper-config` step, as its arguments after `april`."""
    benchmarks = str(REPO / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    results = importlib.import_module("results")
    step = next(s for s in results.STEPS if s.name == PAPER_STEP)
    words: list[str] = shlex.split(step.command)
    assert words[:2] == ["april", "simulate"], words
    return words[1:]


def test_simulate_predicts_the_run_in_sync_and_april_mode() -> None:
    """The documented command, cut to 2 steps: it needs neither the model nor the dataset, simulates as many
    engines as the plan places with the config's batch, budget, slots and lengths, and reports both modes."""
    engines = sum(p["role"] == "worker" for p in plan())
    args = paper_step_command()
    assert args[1:3] == ["--config", "configs/qwen3-4b-dapo.toml"] and args[
        args.index("--engines") + 1
    ] == str(engines)
    args[2] = str(CONFIG)  # the test runs from anywhere
    code, out = cli(*args, "--steps", "2")
    assert code == 0, out
    doc = json.loads(out)
    s = doc["setting"]
    assert (s["engines"], s["slots"], s["steps"]) == (engines, 171, 2)
    assert (s["rollout_batch_size"], s["over_sampling_batch_size"], s["max_new_tokens"]) == (32, 64, 16384)
    assert s["lengths"].startswith("mixture:") and "cap=16384" in s["lengths"]  # workloads/math-long-tail
    sync, april = doc["modes"]["sync"], doc["modes"]["april"]
    assert sync["speedup"] == 1.0 and sync["aborted"] == 0
    assert april["samples_per_s"] > 0 and april["speedup"] is not None and april["wasted_tokens"] == 0
