"""Evaluation on held-out prompts: the held-out split of every prompt source, the broker's evaluation
books driven directly, and whole runs (a real broker with scripted or real `april worker` processes)
where evaluation leases are greedy, use only held-out prompts, report in the batches and leave the ledger
and the exactly-N contract untouched."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_for
from sglang_server import FakeSGLangServer

from april.config import ConfigError, load_config
from april.data import FilePromptSource, PromptSource, SyntheticPromptSource
from april.records import FinishReason, Sample
from april.status import BrokerStatus
from broker.evaluation import EVAL_GROUP_BASE, Evaluations
from broker.heldout import auto_eval_size, open_prompts, split_held_out
from broker.state import ResultRejected
from cli.up_cmd import UpOptions, resolve

# ------------------------------------------------------------------------------------------ held-out split


def _indices(source: PromptSource, cursors: range) -> list[int]:
    return [source.get(c).prompt_index for c in cursors]


@pytest.mark.parametrize("shuffle", [True, False])
def test_training_view_never_yields_a_held_out_prompt(shuffle: bool) -> None:
    source = SyntheticPromptSource(size=50, seed=3, shuffle=shuffle)
    train, held = split_held_out(source, 7)
    held_ids = {r.prompt_index for r in held}
    assert len(held) == len(held_ids) == 7 and len(train) == 43
    assert [r.prompt_index for r in held] == _indices(source, range(7))  # the source's first draws
    if not shuffle:
        assert held_ids == set(range(7))
    for epoch in range(3):  # every epoch: each kept prompt exactly once, no held-out one
        drawn = _indices(train, range(epoch * 43, (epoch + 1) * 43))
        assert sorted(drawn) == sorted(set(range(50)) - held_ids)
    # random access (a restored cursor, a fresh view) gives the same records as drawing in order
    again, _ = split_held_out(SyntheticPromptSource(size=50, seed=3, shuffle=shuffle), 7)
    assert _indices(again, range(100, 60, -1)) == _indices(train, range(100, 60, -1))
    assert train.get(61).text == source.get(_cursor_of(source, train.get(61).prompt_index, 61 // 43)).text


def _cursor_of(source: PromptSource, index: int, epoch: int) -> int:
    n = len(source)
    return next(c for c in range(epoch * n, (epoch + 1) * n) if source.get(c).prompt_index == index)


def test_jsonl_held_out_is_the_first_lines_without_shuffle(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    train, held = split_held_out(FilePromptSource(path, shuffle=False), 3)
    assert [r.text for r in held] == ["q0", "q1", "q2"]
    assert [train.get(c).text for c in range(8)] == [f"q{i}" for i in (3, 4, 5, 6, 7, 8, 9, 3)]
    assert "without 3 held-out prompts" in train.describe()


def test_task_source_gets_the_same_split() -> None:
    task = pytest.importorskip("april.task")
    source = task.TaskPromptSource(size=100, seed=0)
    train, held = split_held_out(source, 5)
    assert {r.prompt_index for r in held} == set(range(5))
    assert set(_indices(train, range(200))).isdisjoint(range(5))


@pytest.mark.parametrize("size", [0, 50, 51])
def test_eval_size_must_leave_training_prompts(size: int) -> None:
    with pytest.raises(ConfigError, match=rf"data.eval_size = {size}: must be in 1..49"):
        split_held_out(SyntheticPromptSource(size=50), size)


def _prompts_file(path: Path, n: int, stem: str = "q") -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{stem}{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize(("prompts", "held"), [(1, 0), (2, 1), (64, 6), (639, 63), (5000, 64)])
def test_the_default_eval_size_leaves_most_prompts_for_training(prompts: int, held: int) -> None:
    assert auto_eval_size(prompts) == held


def test_april_up_on_a_64_prompt_dataset_holds_a_tenth_out(tmp_path: Path) -> None:
    """Found by a user: the built-in run (`april up` without --config) held 64 prompts out whatever the
    dataset, so a 64-prompt file stopped it with "data.eval_size = 64: must be in 1..63"."""
    data = _prompts_file(tmp_path / "small.jsonl", 64)
    config, _, _ = resolve(UpOptions(sets=(f"data.source={data}",), run_dir=tmp_path / "run"))
    train, held = open_prompts(config)
    assert config.run.eval_every > 0 and (len(train), len(held)) == (58, 6)
    builtin = resolve(UpOptions(run_dir=tmp_path / "run"))[0]
    assert len(open_prompts(builtin)[1]) == 64  # the built-in task keeps its 64 held-out prompts
    named = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_size=64))
    with pytest.raises(ConfigError, match=r"data.eval_size = 64: must be in 1..63 .*data.eval_source"):
        open_prompts(named)  # asked for in so many words: refused, with the ways out


def test_eval_source_is_a_dataset_of_its_own(tmp_path: Path) -> None:
    train_path, eval_path = (
        _prompts_file(tmp_path / "t.jsonl", 20),
        _prompts_file(tmp_path / "e.jsonl", 5, "e"),
    )
    config = load_config(
        overrides={"run.eval_every": 1, "data.source": str(train_path), "data.eval_source": str(eval_path)}
    )
    train, held = open_prompts(config)
    assert len(train) == 20 and [r.text for r in held] == [f"e{i}" for i in range(5)]  # all, in order
    three = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_size=3))
    assert [r.text for r in open_prompts(three)[1]] == ["e0", "e1", "e2"]
    six = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_size=6))
    with pytest.raises(
        ConfigError, match=r"data.eval_size = 6: must be in 1..5, the prompts of data.eval_source"
    ):
        open_prompts(six)
    task = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_source="task"))
    with pytest.raises(ConfigError, match=r"data.eval_source = 'task': expected a dataset path"):
        open_prompts(task)


# ------------------------------------------------------------------------------------------ evaluation books


def _evaluations(n: int = 4, every: int = 2, final: int = 5) -> Evaluations:
    _, held = split_held_out(SyntheticPromptSource(size=40, seed=0, prompt_len_min=3, prompt_len_max=5), n)
    return Evaluations(held, every=every, final_version=final, max_new_tokens=8)


def _answer(s: Sample, version: int, reward: float, k: int = 2, abort: bool = False) -> Sample:
    out = s.extend([7] * k, [-0.5] * k, version, FinishReason.ABORT if abort else FinishReason.STOP)
    return out if abort else out.scored(reward)


def test_evaluation_falls_due_at_multiples_and_the_final_version() -> None:
    evals = _evaluations(every=2, final=5)
    started = []
    for v in range(1, 6):
        evals.on_version(v)
        if evals.run is not None:
            started.append(evals.run.version)
            evals.run = None
    assert started == [2, 4, 5]
    off = Evaluations((), every=2, final_version=5, max_new_tokens=8)
    off.on_version(2)
    assert off.run is None and off.status() is None


def test_evaluation_resumes_interrupted_samples_and_reports_accuracy() -> None:
    evals = _evaluations(n=4, every=1)
    ids = count(100)
    evals.on_version(1)
    work = evals.take_work("w0", 3, new_lease_id=lambda: next(ids))
    assert [s.key for _, _, s in work] == [(EVAL_GROUP_BASE + i, 0) for i in range(3)]
    assert all(budget == 8 for _, budget, _ in work)
    (l0, _, s0), (l1, _, s1), (l2, _, _) = work
    evals.accept_result("w0", l0, _answer(s0, 1, 1.0), broker_version=1)
    evals.accept_result("w0", l1, _answer(s1, 1, 0.0, abort=True), broker_version=1)  # an abort hit it
    evals.reclaim(l2)  # its worker died
    with pytest.raises(ResultRejected, match="not held"):
        evals.accept_result("w1", l0, _answer(s0, 1, 1.0), broker_version=1)
    evals.on_version(2)  # due while the evaluation at v1 runs: starts when it finishes
    rest = evals.take_work("w1", 8, new_lease_id=lambda: next(ids))
    assert sorted(s.key[0] - EVAL_GROUP_BASE for _, _, s in rest) == [1, 2, 3]
    resumed = next(s for _, _, s in rest if s.key[0] == EVAL_GROUP_BASE + 1)
    assert resumed.response_len == 2 and resumed.resumes == 1  # kept its tokens
    for lease_id, _, s in rest:
        reward = 1.0 if s.key[0] == EVAL_GROUP_BASE + 2 else 0.0
        evals.accept_result("w1", lease_id, _answer(s, 2, reward), broker_version=2)
    assert evals.latest is not None
    assert (evals.latest.version, evals.latest.accuracy, evals.latest.n) == (1, 0.5, 4)
    assert (evals.latest.oldest_version, evals.latest.newest_version) == (1, 2)
    assert evals.batch_stats() == {"eval_accuracy": 0.5, "eval_reward_mean": 0.5, "eval_version": 1.0}
    assert evals.run is not None and evals.run.version == 2  # the one that fell due meanwhile
    status = evals.status()
    assert status is not None and status.completed == 1
    assert status.running is not None and status.running.of == 4 and status.running.version == 2
    assert (status.version, status.accuracy, status.n, status.failed) == (1, 0.5, 4, 0)


# ------------------------------------------------------------------------------------------ whole runs


def eval_version(c: Cluster) -> int | None:
    """The weights version of the broker's latest evaluation (None: none yet, or evaluation is off)."""
    evaluation = c.status().eval
    return None if evaluation is None else evaluation.version


def _leases(c: Cluster, workers: list[str]) -> list[dict[str, Any]]:
    return [e for w in workers for e in c.read(w) if e["kind"] == "lease"]


def _check_books(c: Cluster, steps: int) -> BrokerStatus:
    batches = c.batches()
    assert len(batches) == steps and all(b["ok"] for b in batches), "a batch was not exactly N samples"
    assert all(g < EVAL_GROUP_BASE for b in batches for g, _ in b["keys"]), "an eval sample was trained"
    status = c.status()
    ledger = status.ledger
    assert status.ledger_balanced and ledger.trained == steps * c.config["algo"]["rollout_batch_size"]
    assert ledger.issued == status.cursor  # groups issued = training prompts drawn, no eval in it
    return status


@pytest.mark.parametrize("mode", ["april", "async"])
def test_eval_leases_are_greedy_held_out_and_reported(cluster: Callable[..., Cluster], mode: str) -> None:
    c = cluster(run={"mode": mode, "eval_every": 1, "steps": 3}, data={"eval_size": 4})
    c.start_broker()
    c.start_peer("worker", "w0", slots=6, tail_every=3)
    c.start_peer("worker", "w1", slots=6, tail_every=3)
    c.start_learner(steps=3, train_s=0.1)
    c.wait_exit("learner", 90)
    done = wait_for(lambda: eval_version(c) == 3, 60, "the final evaluation")
    assert done
    status = _check_books(c, 3)
    leases = _leases(c, ["w0", "w1"])
    greedy = [e for e in leases if e["greedy"]]
    train = [e for e in leases if not e["greedy"]]
    assert greedy and all(e["g"] >= EVAL_GROUP_BASE and e["i"] == 0 for e in greedy)
    assert all(e["g"] < EVAL_GROUP_BASE for e in train)
    held_out = {e["prompt"] for e in greedy}
    assert len(held_out) == 4 and held_out.isdisjoint({e["prompt"] for e in train})
    # the v0 baseline runs on the starting weights, the later evaluations on relayed ones
    assert 0 in {e["version"] for e in greedy} and max(e["version"] for e in greedy) >= 1
    evaluation = status.eval
    assert evaluation is not None
    assert evaluation.oldest_version == 3  # the final evaluation ran on the final weights
    # the scripted worker's reward is (group_id + index) % 2: prompts 1 and 3 of 4 are right
    assert evaluation.accuracy == 0.5 and evaluation.n == 4 and evaluation.running is None
    assert evaluation.completed >= 2  # v3 at least, v1 and v2 unless one fell due while another ran
    reported = [b["stats"] for b in c.batches() if "eval_accuracy" in b["stats"]]
    assert reported and all(s["eval_accuracy"] == 0.5 and s["eval_version"] >= 0 for s in reported)
    logged = [json.loads(x) for x in (c.run_dir / "eval.jsonl").read_text().splitlines()]
    assert logged[-1]["version"] == 3 and logged[-1]["accuracy"] == 0.5  # the final one, after the last step
    assert len(logged) == evaluation.completed


def test_eval_with_real_workers_and_the_sim_engine(cluster: Callable[..., Cluster]) -> None:
    c = cluster(run={"mode": "april", "eval_every": 2, "steps": 4}, data={"eval_size": 6})
    c.start_broker()
    c.start_worker("w0")
    c.start_worker("w1")
    c.start_learner(steps=4, train_s=0.05)
    c.wait_exit("learner", 90)
    wait_for(lambda: eval_version(c) == 4, 60, "the evaluation at v4")
    status = _check_books(c, 4)
    evaluation = status.eval
    assert evaluation is not None and evaluation.accuracy is not None
    assert evaluation.n == 6 and evaluation.failed == 0 and 0.0 <= evaluation.accuracy <= 1.0
    assert evaluation.tokens_generated > 0
    stats = [b["stats"] for b in c.batches()]
    assert all(s.get("eval_version", 0.0) == 0.0 for s in stats[:2])  # before v2: at most the v0 baseline
    reported = [s for s in stats[2:] if s.get("eval_version", 0.0) > 0]
    assert all(s["eval_version"] == 2.0 and not math.isnan(s["eval_accuracy"]) for s in reported)
    assert json.loads((c.run_dir / "eval.jsonl").read_text().splitlines()[0])["version"] == 0
    assert Counter(w.id for w in status.workers) == {"w0": 1, "w1": 1}


def test_greedy_flag_reaches_the_engine_through_a_real_worker(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A real `april worker` on the SGLang adapter (against the fake SGLang server): the held-out prompts,
    and only they, are generated with SGLang's greedy setting (top_k 1)."""
    weights = tmp_path / "v000001.safetensors"
    weights.write_bytes(b"weights")
    with FakeSGLangServer(max_running_requests=8, token_delay_s=0.001) as server:
        c = cluster(
            run={"mode": "april", "eval_every": 1, "steps": 2},
            algo={"max_new_tokens": 8},
            data={"eval_size": 3},
            worker={"engine": "sglang", "sglang_urls": server.url, "slots": 8},
        )
        c.start_broker()
        c.start_worker("sw0")
        c.start_learner(steps=2, train_s=0.05, weights_file=str(weights))
        c.wait_exit("learner", 90)
        wait_for(lambda: eval_version(c) == 2, 60, "the evaluation at v2")
        _check_books(c, 2)
        posts = list(server.rt.generate_bodies)
    data = c.config["data"]
    source = SyntheticPromptSource(
        seed=0,
        prompt_len_min=data["synthetic_prompt_len_min"],
        prompt_len_max=data["synthetic_prompt_len_max"],
    )
    _, held = split_held_out(source, 3)
    held_prompts = {tuple(r.prompt_ids.tolist()) for r in held}

    def prompt_of(body: dict[str, Any]) -> tuple[int, ...]:
        ids = body["input_ids"]
        return next(p for p in [*held_prompts, tuple(ids)] if tuple(ids[: len(p)]) == p)

    greedy = {prompt_of(b) for b in posts if b["sampling_params"]["top_k"] == 1}
    sampled = {prompt_of(b) for b in posts if b["sampling_params"]["top_k"] != 1}
    assert greedy == held_prompts and not sampled & held_prompts
