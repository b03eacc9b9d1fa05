"""reasoning-gym as a prompt source and a reward (april/envs/reasoning_gym.py), against the real package:
records are the package's entries, the `reasoning_gym` reward is the task's own `score_answer` on the
same transcript, the held-out questions come from generator seeds no training question uses, and a real
`april up` (sim engine, the tiny model's tokenizer) trains through APRIL's aborts with every recorded
reward equal to what the package computes for the recorded response."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer
from test_up import check_run, run_up, wait_all_exited

from actors.rewards import RewardError, extract_final_answer, load_reward
from april.config import Config, DataConfig, RunConfig
from april.envs.reasoning_gym import KEY, Coordinates, ReasoningGymError, ReasoningGymSource
from april.sources import open_source
from broker.heldout import open_prompts

TASKS = "reasoning_gym:basic_arithmetic,chain_sum"


def package_score(response: str, metadata: dict[str, str]) -> float:
    """The package's own scoring of `response` for the entry `metadata` names, built here from scratch."""
    c = json.loads(metadata[KEY])
    ds = reasoning_gym.create_dataset(c["task"], seed=c["seed"], size=c["size"], **c["options"])
    tagged = extract_answer(response)
    return float(
        ds.score_answer(extract_final_answer(response) if tagged is None else tagged, ds[c["index"]])
    )


def test_records_are_the_packages_entries_interleaved_by_task() -> None:
    source = open_source(
        DataConfig(source=TASKS, size=20, seed=7, options='{"chain_sum": {"max_terms": 3}}'), 0
    )
    assert len(source) == 40
    arithmetic = reasoning_gym.create_dataset("basic_arithmetic", seed=7, size=20)
    chain = reasoning_gym.create_dataset("chain_sum", seed=7, size=20, max_terms=3)
    for cursor in range(6):
        record = source.get(cursor)
        entry = (arithmetic if cursor % 2 == 0 else chain)[cursor // 2]
        assert (record.text, record.metadata["answer"]) == (entry["question"], entry["answer"])
        again = source.get(cursor + 40)  # the next epoch
        assert record.prompt_index == again.prompt_index == cursor and again.metadata == record.metadata
    assert json.loads(source.get(1).metadata[KEY])["options"] == {"max_terms": 3}


def test_the_reward_is_the_tasks_own_score_answer() -> None:
    reward = load_reward("reasoning_gym")
    source = ReasoningGymSource("reasoning_gym:basic_arithmetic,word_sorting,chain_sum", 10, 3)
    for cursor in range(9):
        record = source.get(cursor)
        gold = record.metadata["answer"]
        for response in (
            f"thinking...\n<answer>{gold}</answer>",
            f"<answer>{gold} and more</answer>",  # the default score_answer gives partial credit
            f"Answer: {gold}",  # no tags: april's final-answer rule
            "<answer>wrong</answer>",
            "",
        ):
            assert reward(response, gold, record.metadata) == package_score(response, record.metadata)
        assert reward(f"<answer>{gold}</answer>", gold, record.metadata) == 1.0
    assert 0 < reward(f"<answer>{gold} x</answer>", gold, record.metadata) < 1


def test_held_out_questions_come_from_seeds_training_never_uses() -> None:
    config = Config(
        data=DataConfig(source=TASKS, size=30, seed=5, eval_size=7),
        run=dataclasses.replace(RunConfig(), eval_every=1),
    )
    train, held = open_prompts(config)
    assert len(train) == 60 and len(held) == 7  # nothing split off: all 30 a task still train
    trained = {
        (c.task, c.seed + c.index)
        for c in (Coordinates.from_json(train.get(i).metadata[KEY]) for i in range(60))
    }
    for record in held:
        c = Coordinates.from_json(record.metadata[KEY])
        assert c.seed + c.index >= 35 and (c.task, c.seed + c.index) not in trained
        entry = reasoning_gym.create_dataset(c.task, seed=c.seed, size=c.size)[c.index]
        assert record.text == entry["question"]


@pytest.mark.parametrize(
    ("source", "options", "expected"),
    [
        ("reasoning_gym:no_such_task", "", "no reasoning-gym task 'no_such_task'"),
        ("reasoning_gym:", "", "expected 'reasoning_gym:TASK[,TASK...]'"),
        (TASKS, '{"chain_sum": {"no_such_option": 1}}', "data.options for 'chain_sum': TypeError"),
        (TASKS, '{"leg_counting": {}}', "data.options names 'leg_counting', expected one of the tasks"),
        (TASKS, '{"chain_sum": {"seed": 1}}', "chain_sum.seed is set by data.seed"),
        (TASKS, "[1]", "expected an object of task name -> options object"),
    ],
)
def test_bad_specs_are_one_line(source: str, options: str, expected: str) -> None:
    with pytest.raises(ReasoningGymError) as info:
        open_source(DataConfig(source=source, options=options), 0)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as when it is not installed
    with pytest.raises(ReasoningGymError, match=r"install it: pip install 'april-rl\[reasoning-gym\]'"):
        open_source(DataConfig(source=TASKS), 0)
    with pytest.raises(RewardError, match=r"reward 'reasoning_gym': reasoning-gym is not installed"):
        load_reward("reasoning_gym")


def test_april_up_trains_reasoning_gym_questions_through_aborts(tmp_path: Path) -> None:
    from april.hf import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    run_dir = tmp_path / "run"
    cfg = tmp_path / "rg.toml"
    cfg.write_text(
        '[run]\nmode = "april"\neval_every = 3\n'
        "[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 8\nn_samples_per_prompt = 4\n"
        f'max_new_tokens = 64\n[data]\nsource = "{TASKS}"\nsize = 50\neval_size = 4\n'
        f'[worker]\nengine = "sim"\nslots = 4\nmodel = "{model}"\nreward = "reasoning_gym"\n'
        'sim_lengths = "lognormal:median=40,sigma=0.8,cap=64"\nsim_time_scale = 1.0\nsim_decode_ms = 15.0\n'
        '[learner]\nbackend = "sim"\nsim_step_s = 0.2\n'
    )
    code, out, children = run_up(
        ["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "4"], timeout=300
    )
    assert code == 0, out
    lines = check_run(run_dir, 4, samples=8)  # books balanced at every step
    assert sum(x["aborted"] for x in lines) > 0, lines
    train = [
        r
        for f in sorted((run_dir / "rollouts" / "train").glob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    held = [
        r
        for f in sorted((run_dir / "rollouts" / "eval").glob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    assert len(train) == 4 * 8 and any(r["resumes"] > 0 for r in train)
    assert held and all(Coordinates.from_json(json.loads(r["metadata"])[KEY]).seed == 50 for r in held)
    rows = train + held
    for row in rows:
        metadata = json.loads(row["metadata"])
        assert row["status"] != "failed", row["error"]
        assert row["reward"] == package_score(row["response_text"], metadata), row["response_text"]
    assert not wait_all_exited(children)
