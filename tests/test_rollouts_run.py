"""Rollout records of real `april up --headless` runs (broker, workers, learner as processes): every
trained prompt, response and reward of every step reads back with pandas, pyarrow and `datasets` and
agrees with metrics.jsonl; an episode's transcript shows its turns, observations and abort cuts in
`april rollouts`; a learner killed with SIGKILL mid-run leaves no half file and no step twice once it
resumed; with the records off nothing is written.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_up import REPO, check_run, child_pids, free_port_set, run_up

from april.rollouts import ROLLOUTS_DIR, eval_dir, train_dir

pd = pytest.importorskip("pandas")

TINY = REPO / "models" / "tiny"
N = 4  # samples a step: 2 groups of 2


def episode_config(tmp_path: Path) -> Path:
    """april mode (a round's end aborts what is still running), the sim engine playing CountingEnv's
    episodes (three turns, an observation after each of the first two) on the tiny model's tokenizer, the
    torch learner training the tiny model, and an evaluation at the start and at the end."""
    cfg = tmp_path / "episodes.toml"
    cfg.write_text(
        '[run]\nmode = "april"\neval_every = 4\n'
        "[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 4\nn_samples_per_prompt = 2\n"
        "max_new_tokens = 256\n"
        '[data]\nsource = "task"\neval_size = 4\n'
        '[env]\nname = "episode_envs:CountingEnv"\nmax_turns = 8\nmax_turn_tokens = 8\n'
        # two slots a worker: the groups past the batch start as the first ones' samples finish, and are
        # still running when the round's end aborts them
        f'[worker]\nengine = "sim"\nslots = 2\nmodel = "{TINY}"\n'
        # the sim engine's length counts the observations: ~110 tokens for three turns of 8 and two replies
        'sim_lengths = "lognormal:median=150,sigma=0.2,cap=200"\nsim_time_scale = 0.1\n'
        f'[learner]\nmodel = "{TINY}"\nbackend = "torch"\nlr = 1e-3\ncheckpoint_every = 2\n'
    )
    return cfg


def env_with_tests() -> dict[str, str]:
    """The environment of `april up` with tests/ on the path: its workers import the env from there."""
    tests = str(REPO / "tests")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH"))))}


def metrics_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_records(run_dir: Path, steps: int) -> Any:
    """The step files read with pandas: every step's exactly-N samples, in complete groups, each trained
    sample once in the run, rewards those metrics.jsonl reports; nothing else in the folder."""
    lines = check_run(run_dir, steps, samples=N)
    names = sorted(p.name for p in train_dir(run_dir).iterdir())
    assert names == [f"step_{s:08d}.parquet" for s in range(steps)]  # no temporary file left either
    frame = pd.read_parquet(train_dir(run_dir))
    assert frame.groupby("step").size().to_dict() == dict.fromkeys(range(steps), N)
    assert not frame.duplicated(["group_id", "sample_index"]).any()
    for line in lines:
        rows = frame[frame["step"] == line["step"]]
        assert rows.groupby("group_id")["sample_index"].apply(sorted).tolist() == [[0, 1]] * 2
        assert rows["reward"].mean() == pytest.approx(line["reward_mean"])
        assert rows["response_tokens"].mean() == pytest.approx(line["response_len_mean"])
        assert rows["model_tokens"].sum() == line["tokens_trained"]
        assert set(rows["learner_version"]) == {line["version"] - 1}
    return frame


def test_an_episode_runs_records_read_back_and_show_their_abort_cuts(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    import pyarrow.dataset as ds

    run_dir = tmp_path / "run"
    args = ["--config", str(episode_config(tmp_path)), "--run-dir", str(run_dir), "--steps", "4"]
    code, out, _ = run_up(args, timeout=600, env=env_with_tests())
    assert code == 0, out
    frame = check_records(run_dir, 4)
    assert ds.dataset(train_dir(run_dir), format="parquet").count_rows() == 4 * N
    files = sorted(str(p) for p in train_dir(run_dir).glob("*.parquet"))
    assert datasets.Dataset.from_parquet(files, cache_dir=str(tmp_path / "hf")).num_rows == 4 * N

    for row in frame.to_dict("records"):
        spans = [(p["start"], p["end"]) for p in row["pieces"]]
        assert spans[0][0] == 0 and spans[-1][1] == row["response_tokens"]  # the pieces tile the response
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert row["prompt_text"] and row["prompt_rendered"] and row["response_text"]
        assert row["answer"] and row["prompt_index"] >= 0 and row["source"] == "task"
        assert all(p["worker"] in ("calculator-w0", "april-w0", "april-w1") for p in row["pieces"])
        assert all(p["version"] >= 0 for p in row["pieces"] if p["kind"] == "model")
        assert row["turns"] >= 1 and pd.notna(row["advantage"]) and pd.notna(row["learner_logprob_mean"])
        assert set(row["abort_cuts"]) <= {p["end"] for p in row["pieces"]} | {0}
    assert (frame["turns"] > 1).any()  # episodes with observations between their turns
    assert frame["pieces"].apply(lambda ps: any(p["kind"] == "observation" for p in ps)).any()
    assert frame["aborts"].sum() > 0  # april mode: rounds end with aborts, partials are trained later

    evals = {p.name: pd.read_parquet(p) for p in eval_dir(run_dir).glob("*.parquet")}
    assert sorted(evals) == ["v000000.parquet", "v000004.parquet"] and all(
        len(e) == 4 for e in evals.values()
    )

    cut = frame[frame["abort_cuts"].apply(len) > 0].iloc[0]
    sample = f"{cut['group_id']}/{cut['sample_index']}"
    view = rollouts(run_dir, "--sample", sample)
    assert view.returncode == 0, view.stderr
    assert "✂ abort" in view.stdout and f"sample {sample}" in view.stdout and "[v" in view.stdout
    observed = frame[frame["turns"] > 1].iloc[0]
    view = rollouts(run_dir, "--sample", f"{observed['group_id']}/{observed['sample_index']}")
    assert "[observation]" in view.stdout
    listed = json.loads(rollouts(run_dir, "--sort", "most-aborted", "--limit", "3", "--json").stdout)
    assert [r["aborts"] for r in listed] == sorted(frame["aborts"], reverse=True)[:3]


def rollouts(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "rollouts", str(run_dir), *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


SIM = [
    "--set=worker.engine=sim", "--set=learner.backend=sim", "--set=learner.sim_step_s=0.2",
    "--set=worker.sim_time_scale=0.02", "--set=algo.rollout_batch_size=2",
    "--set=algo.n_samples_per_prompt=2", "--set=algo.over_sampling_batch_size=4",
    "--set=algo.max_new_tokens=32", "--set=data.eval_size=4", "--set=learner.checkpoint_every=2",
]  # fmt: skip


def test_a_learner_killed_mid_run_leaves_no_half_file_and_no_step_twice(tmp_path: Path) -> None:
    """SIGKILL the learner after its third step, wherever it is (training, writing records, between
    checkpoint and ack): `april up` restarts it with --resume, from its checkpoint, and the run's records
    end with every step once, whole."""
    run_dir, steps = tmp_path / "run", 8
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import main; main()", "up", "--headless",
         "--run-dir", str(run_dir), "--steps", str(steps), "--workers", "1", *SIM, *free_port_set()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    argv = {
        pid: Path(f"/proc/{pid}/cmdline").read_text(errors="replace").split("\0")
        for pid in child_pids(proc.pid)
    }
    (learner,) = [pid for pid, args in argv.items() if args[3] == "learner"]  # python -c CODE ROLE ...
    os.kill(learner, signal.SIGKILL)
    out = proc.communicate(timeout=600)[0].decode(errors="replace")
    assert proc.returncode == 0, out
    assert "exited -9: restarted (1/3)" in out
    check_records(run_dir, steps)


def test_with_the_records_off_nothing_is_written(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), "--steps", "2", "--workers", "1", *SIM]
    code, out, _ = run_up([*args, "--set=run.rollout_records=false", "--set=run.eval_every=1"], timeout=300)
    assert code == 0, out
    assert (run_dir / "eval.jsonl").exists() and len(metrics_lines(run_dir)) == 2  # it trained and evaluated
    assert not (run_dir / ROLLOUTS_DIR).exists()
