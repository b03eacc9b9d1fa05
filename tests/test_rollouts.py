"""Rollout records (april/rollouts.py, april/rollout_writer.py, learner/step_records.py) and their viewer
(`april rollouts`, cli/rollouts_cmd.py), on samples built through the records API and the broker's
lease spans: what a row holds, how the files are written (whole, once, bounded, read by pandas, pyarrow
and `datasets`), what a resumed learner keeps, and what the viewer shows. Whole runs: test_rollouts_run.py.
"""

from __future__ import annotations

import io
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

from april.config import Config, RunConfig
from april.records import FinishReason, Sample
from april.rollout_writer import RolloutWriter
from april.rollouts import (
    Context,
    Piece,
    abort_cuts,
    eval_dir,
    eval_file,
    eval_table,
    open_decoder,
    pieces,
    schemas,
    step_file,
    train_dir,
    train_steps,
    train_table,
)
from april.sim.byte_tokenizer import BYTE_OFFSET
from cli.main import app
from cli.rollouts_cmd import render_samples, render_steps, render_transcript, select, step_summaries
from learner.step_records import StepRecords, forget_steps_from, samples_table


def ids(text: str) -> list[int]:
    """`text` as the byte tokenizer's ids (what the sim engine's workers tokenize with, no model)."""
    return [b + BYTE_OFFSET for b in text.encode()]


def episode(group_id: int = 7, index: int = 1, reward: float = 1.0) -> Sample:
    """Turn "abc" on w0 (v0), aborted there; resumed on w1 under v0 again: "d" (the same segment);
    the observation "<obs>"; the last turn "ok" under v1; finished on w1."""
    s = Sample(
        group_id,
        index,
        np.array(ids("add"), np.int32),
        prompt_text="add",
        metadata={"answer": "3", "prompt_index": "12"},
    ).resumed()
    s = s.extend(ids("abc"), [-0.5] * 3, 0, FinishReason.NONE).extend([], [], 0, FinishReason.ABORT)
    s = s.returned_by("w0", s.leases).resumed()
    s = s.extend(ids("d"), [-0.25], 0, FinishReason.NONE).observed(ids("<obs>"))
    s = s.extend(ids("ok"), [-1.0, -1.0], 1, FinishReason.STOP).scored(reward)
    return s.returned_by("w1", s.leases)


def context(version: int = 2) -> Context:
    return Context("task", version, open_decoder("", ""))  # no worker model: the byte tokenizer


def test_pieces_split_where_a_lease_ended_and_name_the_worker() -> None:
    s = episode()
    assert [tuple(seg) for seg in s.segments] == [(0, 0, 4), (1, 9, 11)]  # "abc" + "d": one v0 segment
    assert pieces(s) == [
        Piece("model", 0, 3, 0, "w0"),
        Piece("model", 3, 4, 0, "w1"),
        Piece("observation", 4, 9, -1, "w1"),
        Piece("model", 9, 11, 1, "w1"),
    ]
    assert abort_cuts(s) == [3]
    running = s.resumed()  # an unsettled sample: every lease span so far ended in an interruption
    assert abort_cuts(running) == [3, 11]


def test_a_row_holds_the_sample_its_text_and_its_figures() -> None:
    s = episode()
    table = train_table(5, 2, 9, [s], context(), {s.key: (0.5, -0.75, 1.25)})
    assert table.schema == schemas()[0]
    (row,) = table.to_pylist()
    assert (row["step"], row["learner_version"], row["batch_id"], row["group_id"], row["sample_index"]) == (
        5, 2, 9, 7, 1,
    )  # fmt: skip
    assert (row["source"], row["prompt_index"], row["answer"]) == ("task", 12, "3")
    assert json.loads(row["metadata"]) == {"answer": "3", "prompt_index": "12"}
    assert (row["prompt_text"], row["prompt_rendered"], row["prompt_ids"]) == ("add", "add", ids("add"))
    assert row["response_text"] == "abcd<obs>ok" and row["response_ids"] == ids("abcd<obs>ok")
    assert [p["text"] for p in row["pieces"]] == ["abc", "d", "<obs>", "ok"]
    assert [(p["kind"], p["version"], p["worker"]) for p in row["pieces"]] == [
        ("model", 0, "w0"), ("model", 0, "w1"), ("observation", -1, "w1"), ("model", 1, "w1"),
    ]  # fmt: skip
    assert (row["response_tokens"], row["model_tokens"], row["turns"]) == (11, 6, 2)
    assert (row["abort_cuts"], row["aborts"], row["resumes"]) == ([3], 1, 1)
    assert (row["staleness"], row["oldest_version"], row["newest_version"]) == (2, 0, 1)
    assert (row["status"], row["finish_reason"], row["reward"], row["error"]) == ("finished", "stop", 1.0, "")
    assert row["behaviour_logprob_mean"] == pytest.approx((3 * -0.5 - 0.25 - 2.0) / 6)
    assert (row["advantage"], row["learner_logprob_mean"], row["ratio_max"]) == (0.5, -0.75, 1.25)
    (bare,) = train_table(5, 2, 9, [s], Context("task", 2, None), None).to_pylist()  # no decoder, no figures
    assert bare["response_text"] == "" and bare["response_ids"] == ids("abcd<obs>ok")
    assert math.isnan(bare["advantage"]) and math.isnan(bare["learner_logprob_mean"])


def test_an_evaluation_row_keeps_a_failed_samples_error() -> None:
    failed = Sample(3, 0, np.array(ids("x"), np.int32)).resumed().failed("environment raised ValueError: no")
    table = eval_table(4, [episode(), failed.returned_by("w0", ())], context(4))
    assert table.schema == schemas()[1]
    rows = table.to_pylist()
    assert [(r["eval_version"], r["status"], r["error"]) for r in rows] == [
        (4, "finished", ""), (4, "failed", "environment raised ValueError: no"),
    ]  # fmt: skip


def test_the_decoder_is_the_workers_tokenizer(tmp_path: Path) -> None:
    """The byte tokenizer without a worker model; the model's tokenizer.json with one (the learner's model
    on a host that lacks the worker's); none, said once, when neither has one."""
    from tokenizers import Tokenizer

    from april.hf import TINY_MODEL

    assert open_decoder("", "")([np.array(ids("hé"), np.int32)]) == ["hé"]
    decode = open_decoder(str(tmp_path / "elsewhere"), str(TINY_MODEL))
    hi = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json")).encode("hi", add_special_tokens=False).ids
    assert decode is not None and decode([np.array([1, *hi], np.int32)]) == ["<|bos|>hi"]
    assert open_decoder(str(tmp_path), str(tmp_path)) is None


# ---------------------------------------------------------------------------------------------- files


def write_steps(run_dir: Path, steps: int, per_step: int = 2) -> list[Sample]:
    writer = RolloutWriter(train_dir(run_dir))
    samples = []
    for step in range(steps):
        batch = [episode(group_id=10 * step + g, reward=float(g)) for g in range(per_step)]
        samples += batch
        writer.submit(step_file(step), lambda b=batch, s=step: train_table(s, s, s, b, context(), None))
    writer.close()
    return samples


def test_the_files_read_back_whole_with_pandas_pyarrow_and_datasets(tmp_path: Path) -> None:
    """A crash mid-write leaves a temporary file: every reader skips it."""
    pd = pytest.importorskip("pandas")
    datasets = pytest.importorskip("datasets")
    run_dir = tmp_path / "run"
    write_steps(run_dir, 3)
    (train_dir(run_dir) / f".{step_file(3)}.tmp").write_bytes(b"PAR1 half a file")
    frame = pd.read_parquet(train_dir(run_dir))
    assert sorted(frame["step"].tolist()) == [0, 0, 1, 1, 2, 2]
    assert ds.dataset(train_dir(run_dir), format="parquet").to_table().num_rows == 6
    files = sorted(str(p) for p in train_dir(run_dir).glob("*.parquet"))
    loaded = datasets.Dataset.from_parquet(files, cache_dir=str(tmp_path / "cache"))
    assert loaded.num_rows == 6 and loaded[0]["pieces"][0]["worker"] == "w0"
    assert loaded[0]["response_text"] == "abcd<obs>ok"


def test_a_file_is_written_once_and_partial_files_are_removed(tmp_path: Path) -> None:
    directory = tmp_path / "train"
    directory.mkdir()
    partial = directory / f".{step_file(0)}.tmp"
    partial.write_bytes(b"PAR1")
    writer = RolloutWriter(directory)
    assert not partial.exists()
    one = train_table(0, 0, 0, [episode()], context(), None)
    writer.submit(step_file(0), lambda: one)
    writer.submit(step_file(0), lambda: train_table(0, 0, 0, [episode(), episode(8)], context(), None))
    writer.close()
    assert (writer.written, writer.skipped) == (1, 1)
    assert pq.read_table(directory / step_file(0)).num_rows == 1


def test_a_failed_write_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    def broken() -> pa.Table:
        raise ValueError("no table")

    writer = RolloutWriter(tmp_path)
    writer.submit(step_file(0), broken)
    writer.submit(step_file(1), lambda: train_table(1, 0, 0, [episode()], context(), None))
    writer.close()
    assert (writer.failed, writer.written) == (1, 1)
    assert list(train_steps(tmp_path.parent / "x")) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        step_file(1)
    ]


def test_submit_waits_while_the_queue_is_full(tmp_path: Path) -> None:
    """Bounded: with one table being built and `depth` waiting, the next submit blocks until one is done."""
    release = threading.Event()

    def slow() -> pa.Table:
        release.wait(60)
        return train_table(0, 0, 0, [episode()], context(), None)

    writer = RolloutWriter(tmp_path, depth=1)
    writer.submit(step_file(0), slow)  # taken by the thread, which waits in it
    while writer._queue.qsize():  # the thread has taken it
        time.sleep(0.01)
    writer.submit(step_file(1), slow)  # the one place in the queue
    third = threading.Thread(target=writer.submit, args=(step_file(2), slow))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # blocked: the queue is full
    release.set()
    third.join(60)
    writer.close()
    assert writer.written == 3


def config(groups: int = 0) -> Config:
    return Config(run=RunConfig(rollout_records_groups=groups))


def test_a_resumed_learner_writes_again_only_the_steps_it_trains_again(tmp_path: Path) -> None:
    write_steps(tmp_path, 4)
    records = StepRecords(config(), tmp_path, first_step=2, resume=True)  # from its checkpoint at step 2
    records.close()
    assert list(train_steps(tmp_path)) == [0, 1]
    StepRecords(config(), tmp_path, first_step=0, resume=False).close()  # a fresh start removes nothing
    assert list(train_steps(tmp_path)) == [0, 1]
    forget_steps_from(train_dir(tmp_path), 0)
    assert list(train_steps(tmp_path)) == []


def test_a_sample_of_groups_is_whole_groups_drawn_the_same_per_step(tmp_path: Path) -> None:
    samples = [episode(group_id=g, index=i) for g in range(6) for i in range(2)]
    records = StepRecords(config(groups=2), tmp_path, 0, False)
    chosen = records.chosen(3, samples)
    records.close()
    groups = {s.group_id for s in chosen}
    assert len(groups) == 2 and len(chosen) == 4 and all(s.group_id in groups for s in chosen)
    again = StepRecords(config(groups=2), tmp_path, 0, False)
    assert [s.key for s in again.chosen(3, samples)] == [s.key for s in chosen]  # a step trained again
    again.close()
    every = StepRecords(config(), tmp_path, 0, False)
    assert len(every.chosen(3, samples)) == 12
    every.close()


def test_the_trackers_table_shows_the_best_worst_longest_and_most_aborted() -> None:
    short = Sample(1, 0, np.array(ids("p"), np.int32)).extend(ids("x"), [-1.0], 0, FinishReason.STOP)
    samples = [episode(reward=0.5), short.scored(2.0), episode(group_id=3, reward=-1.0)]
    table = samples_table(samples, context(), None)
    assert [row[:3] for row in table.rows] == [[1, 0, 2.0], [3, 1, -1.0], [7, 1, 0.5]]
    assert table.rows[2][-1] == "abcd<obs>ok" and table.rows[0][-2] == "p"
    assert "| group | index | reward |" in table.markdown()


# ---------------------------------------------------------------------------------------------- viewer


def run_with_records(tmp_path: Path) -> Path:
    """Steps 0 and 1 (two episodes each) and an evaluation at v1 with one failed sample."""
    run_dir = tmp_path / "run"
    write_steps(run_dir, 2)
    failed = (
        Sample(50, 0, np.array(ids("q"), np.int32), prompt_text="q?").resumed().failed("reward timed out")
    )
    writer = RolloutWriter(eval_dir(run_dir))
    writer.submit(
        eval_file(1), lambda: eval_table(1, [episode(60), failed.returned_by("w0", ())], context(1))
    )
    writer.close()
    return run_dir


def text_of(renderable: object, width: int = 100) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_transcript_tells_model_tokens_observations_and_abort_cuts_apart() -> None:
    (row,) = train_table(5, 2, 9, [episode()], context(), {(7, 1): (0.5, -0.75, 1.25)}).to_pylist()
    text = text_of(render_transcript(row))
    assert "step 5 · sample 7/1" in text and "aborted 1, resumed 1" in text and "advantage 0.500" in text
    assert "[v0 w0] abc ✂ abort [v0 w1] d" in text  # the cut, and who went on after it
    assert "[observation] <obs>" in text and "[v1 w1] ok" in text
    assert "source task, record 12" in text


def test_listing_filters_and_sorts(tmp_path: Path) -> None:
    run_dir = run_with_records(tmp_path)
    from cli.rollouts_cmd import TRAIN_LISTED, load

    rows = load(run_dir, False, None, TRAIN_LISTED)
    assert [r["reward"] for r in select(rows, "highest-reward", False, None, 3)] == [1.0, 1.0, 0.0]
    assert [r["reward"] for r in select(rows, "lowest-reward", False, None, 10)] == [0.0, 0.0, 1.0, 1.0]
    assert select(rows, None, True, None, 10) == []  # no trained sample has an error
    assert len(select(rows, None, False, "ADD", 10)) == 4 and select(rows, None, False, "nope", 10) == []
    summaries = step_summaries(rows, "step")
    assert [(s["step"], s["samples"], s["aborted"]) for s in summaries] == [(0, 2, 2), (1, 2, 2)]
    assert "steps" in text_of(render_steps(summaries, []))
    listed = text_of(render_samples(select(rows, "longest", False, None, 2), False))
    assert "0/1" in listed and "1/1" in listed and "finish" in listed


def test_the_command_prints_json_for_scripts(tmp_path: Path) -> None:
    run_dir = run_with_records(tmp_path)
    runner = CliRunner()

    def call(*args: str) -> object:
        result = runner.invoke(app, ["rollouts", str(run_dir), *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    overview = call()
    assert isinstance(overview, dict)
    assert [s["step"] for s in overview["steps"]] == [0, 1]
    assert [(e["eval_version"], e["errors"]) for e in overview["evaluations"]] == [(1, 1)]
    assert [r["group_id"] for r in call("--step", "1")] == [10, 11]  # type: ignore[union-attr]
    failed = call("--eval", "1", "--errors")
    assert [(r["group_id"], r["error"]) for r in failed] == [(50, "reward timed out")]  # type: ignore[union-attr]
    sample = call("--sample", "11/1")
    assert isinstance(sample, dict) and sample["step"] == 1 and sample["abort_cuts"] == [3]
    assert sample["advantage"] is None  # NaN (no figure) is null: strict JSON
    shown = runner.invoke(app, ["rollouts", str(run_dir), "--sample", "11/1"])
    assert shown.exit_code == 0 and "✂ abort" in shown.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--step", "7"], "--step 7: no such records (steps 0-1)"),
        (["--eval", "2"], "--eval 2: no such records (versions 1)"),
        (["--sample", "x"], "--sample 'x': expected GROUP/INDEX"),
        (["--sample", "99/0"], "--sample 99/0: no such sample"),
        (["--sort", "best"], "--sort 'best': expected one of lowest-reward"),
        (["--step", "0", "--eval", "1"], "--step and --eval: give one of them"),
    ],
)
def test_what_is_not_there_is_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    run_dir = run_with_records(tmp_path)
    result = CliRunner().invoke(app, ["rollouts", str(run_dir), *args])
    assert result.exit_code == 2 and says in result.output, result.output
