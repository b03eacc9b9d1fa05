"""The SFT warm start: batching and labels against plain references, a tiny run reproducible bit for bit and
loadable as any HF checkpoint, the `april sft` / `april task export` commands, and the shipped model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from actors.rewards import reasoning_gym_reward
from actors.tokenizer import HFTokenizer
from april.chat import chat_format
from april.config import DataConfig
from april.data import FilePromptSource
from april.envs import calculator
from april.episode import Message, Role, ToolCall
from april.hf import load_model, load_tokenizer, make_tiny_tokenizer
from april.task import TaskPromptSource, TaskSpec, make_example
from cli.main import app
from cli.sft_cmd import MAX_TURNS, demonstration_seeds, evaluate_episodes, reasoning_held_out
from learner.sft import (
    IGNORE_INDEX,
    RG_SEED_BASE,
    SftSettings,
    SftTask,
    batch_order,
    collate,
    data_seed,
    default_model_dir,
    demonstrations,
    encode,
    lr_factor,
    parse_task,
    reasoning_demonstrations,
    train_sft,
)

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "tiny"
SHIPPED_CALCULATOR = SHIPPED.with_name("tiny-calculator")
SHIPPED_SPELL_BACKWARD = SHIPPED.with_name("tiny-spell-backward")
SHIPPED_WORD_SEQUENCE_REVERSAL = SHIPPED.with_name("tiny-word-sequence-reversal")
WORD_SEQUENCE_REVERSAL = (
    '{"word_sequence_reversal": {"min_words": 2, "max_words": 2}}'  # configs/word_sequence_reversal.toml
)
SPELL_BACKWARD = '{"spell_backward": {"min_word_len": 3, "max_word_len": 8}}'
TINY = SftSettings(
    steps=3,
    warmup_steps=1,
    batch_tokens=512,
    pool_size=32,
    threads=1,
    hidden=32,
    layers=2,
    heads=2,
    intermediate=64,
)


def quiet(_: str) -> None:
    pass


def test_encode_matches_the_worker_tokenization() -> None:
    tok = make_tiny_tokenizer()
    ex = make_example(0, 0)
    ids, plen = encode(tok, ex.prompt, ex.response, 2)
    worker_prompt = HFTokenizer.__new__(HFTokenizer)
    worker_prompt.tok = tok
    assert ids[:plen] == worker_prompt.encode_prompt(ex.prompt, {}).tolist()
    assert ids[-1] == 2
    assert len(ids) == len(ex.prompt.encode()) + len(ex.response.encode()) + 1  # byte-level: 1 token/byte
    assert tok.decode(ids[plen:-1]) == ex.response


def test_batch_order_covers_each_row_once_within_the_budget() -> None:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(5, 300, size=500)] + [5000]
    order = batch_order(lengths, 1024, np.random.default_rng(1))
    assert sorted(i for b in order for i in b) == list(range(len(lengths)))
    for rows in order:
        assert len(rows) * max(lengths[i] for i in rows) <= 1024 or len(rows) == 1
    assert order == batch_order(lengths, 1024, np.random.default_rng(1))


def test_collate_labels_only_the_masked_tokens() -> None:
    batch = collate([([5, 6, 7, 8], [False, False, True, True]), ([9, 10], [False, True])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [[x, x, 7, 8], [x, 10, x, x]]


def test_lr_schedule_warms_up_then_decays() -> None:
    s = SftSettings(steps=100, warmup_steps=10, lr_final_ratio=0.1)
    assert lr_factor(0, s) == pytest.approx(0.1)
    assert lr_factor(9, s) == pytest.approx(1.0)
    assert lr_factor(10, s) == pytest.approx(1.0)
    assert lr_factor(100, s) == pytest.approx(0.1)
    assert all(lr_factor(i, s) >= lr_factor(i + 1, s) for i in range(10, 100))


def test_tiny_sft_run_is_reproducible_and_loads_back(tmp_path: Path) -> None:
    settings = replace(TINY, seed=3)
    first = train_sft(tmp_path / "a", settings, log=quiet)
    second = train_sft(tmp_path / "b", settings, log=quiet)
    assert first.steps == 3 and first.train_tokens > 0 and np.isfinite(first.final_loss)
    a, b = load_model(first.model_dir), load_model(second.model_dir)
    assert a.config.model_type == "llama"
    init = load_model(first.model_dir).state_dict()  # sanity: loading twice gives the same tensors
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
        assert torch.equal(tensor, init[name]), name
    other = train_sft(tmp_path / "c", replace(settings, seed=4), log=quiet)
    c = load_model(other.model_dir).state_dict()
    assert any(not torch.equal(t, c[n]) for n, t in a.state_dict().items())
    assert load_tokenizer(first.model_dir).eos_token_id == 2


def test_calculator_demonstrations_train_on_the_model_turns_only() -> None:
    tok = load_tokenizer(SHIPPED)
    settings = SftSettings(task=SftTask.CALCULATOR)
    row = demonstrations(tok, settings, 2)
    seed = data_seed(settings.seed)
    chat = chat_format(tok)
    for index in range(3):
        example = calculator.make_example(seed, index)
        expected = calculator.transcript(
            example, chat, settings.slip_rate, np.random.default_rng((seed, index, 1))
        )
        assert row(index) == (expected.ids, expected.loss_mask)
    ids, mask = row(0)
    labels = collate([(ids, mask)], pad_id=0)["labels"][0].tolist()
    assert [label != IGNORE_INDEX for label in labels] == mask
    trained = str(tok.decode([t for t in labels if t != IGNORE_INDEX]))
    context = str(tok.decode([t for t, m in zip(ids, mask, strict=True) if not m]))
    numbers = calculator.make_example(seed, 0).numbers
    assert trained.count("<tool_call>") == len(numbers) - 1 and "Answer: " in trained
    for observed in ("Sum: ", "next ", "all added", "<tool_response>"):  # the prompt and observations
        assert observed in context and observed not in trained


def test_a_tiny_calculator_run_writes_a_model_that_plays_episodes(tmp_path: Path) -> None:
    settings = replace(TINY, task=SftTask.CALCULATOR, steps=2, pool_size=8, batch_tokens=1024)
    result = train_sft(tmp_path / "calc", settings, log=quiet)
    assert result.steps == 2 and result.train_tokens > 0 and np.isfinite(result.final_loss)
    model = load_model(result.model_dir)
    assert model.config.max_position_embeddings == calculator.CONTEXT
    played = evaluate_episodes(result.model_dir, 3, greedy=True)
    counts = [len(calculator.make_example(0, i).numbers) for i in range(3)]
    assert played.samples == 3 and sum(n for _, n in played.by_numbers.values()) == 3
    assert sorted(played.by_numbers) == sorted(set(counts))
    assert 1 <= played.mean_turns <= MAX_TURNS and 0.0 <= played.accuracy <= 1.0


def test_sft_command_names_a_wrong_task_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["sft", "--out", str(tmp_path / "m"), "--task", "calculater"])
    assert result.exit_code == 2 and not (tmp_path / "m").exists()
    assert result.output.strip().splitlines() == [
        "april: error: Invalid value: --task: got 'calculater', expected task, calculator or "
        "reasoning_gym:TASK[,TASK...]"
    ]
    bad = ["--task", "reasoning_gym:spell_backward", "--options", '{"spell_backward": {"max_word_lenn": 2}}']
    result = CliRunner().invoke(app, ["sft", "--out", str(tmp_path / "m"), *bad])
    assert result.exit_code == 2 and not (tmp_path / "m").exists()
    (line,) = result.output.strip().splitlines()
    assert "data.options for 'spell_backward'" in line and "max_word_lenn" in line
    with pytest.raises(
        ValueError,
        match=r"^SftSettings\.task = 'calculater', expected one of task, calculator, reasoning_gym$",
    ):
        SftSettings(task="calculater")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^SftSettings\.source = '': expected a reasoning_gym: source"):
        SftSettings(task=SftTask.REASONING_GYM)


def test_reasoning_gym_demonstrations_are_the_generators_answers_from_unseen_seeds() -> None:
    """Question -> the entry's own answer and the end token, trained on the answer only; the response scores
    1.0 with the reward an RL run uses; the seeds are none of an RL run's (training or held out)."""
    tok = load_tokenizer(SHIPPED)
    settings = SftSettings(
        task=SftTask.REASONING_GYM, source="reasoning_gym:spell_backward", options=SPELL_BACKWARD
    )
    row = demonstrations(tok, settings, 2)
    source = reasoning_demonstrations(settings)
    assert source.seed == RG_SEED_BASE
    for index in range(5):
        record = source.get(index)
        ids, mask = row(index)
        prompt = sum(not m for m in mask)
        assert ids[:prompt] == HFTokenizer(SHIPPED).encode_prompt(record.text, record.metadata).tolist()
        assert ids[-1] == 2 and all(mask[prompt:])
        response = str(tok.decode(ids[prompt:-1]))
        assert response == record.metadata["answer"] == record.text.rsplit(" ", 1)[1][::-1]
        assert reasoning_gym_reward(response, "", record.metadata) == 1.0
    seeds = demonstration_seeds(settings)
    run = DataConfig()  # an RL run's training seeds [0, size) and held-out seeds from size on
    assert seeds["held_out_seeds_from"] == run.size < seeds["generator_seeds_from"]
    held = reasoning_held_out(settings.source, settings.options, 3)
    assert [json.loads(r.metadata["reasoning_gym"])["seed"] for r in held] == [run.size] * 3
    assert parse_task("reasoning_gym:spell_backward") == (
        SftTask.REASONING_GYM,
        "reasoning_gym:spell_backward",
    )
    assert default_model_dir(SftTask.REASONING_GYM, "reasoning_gym:spell_backward") == SHIPPED_SPELL_BACKWARD


def test_sft_command_trains_and_export_command_writes_jsonl(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "model"
    report = tmp_path / "sft.json"
    args = ["sft", "--out", str(out), "--steps", "1", "--threads", "1", "--eval-prompts", "2"]
    result = runner.invoke(app, [*args, "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert "1 steps" in result.output
    load_model(out)
    figures = json.loads(report.read_text())  # the artifact the README's sft figures come from
    assert figures["steps"] == 1 and figures["parameters"] > 0 and figures["wall_s"] > 0
    assert figures["eval"]["greedy"]["samples"] == 2 and figures["eval"]["sampled"]["samples"] == 8
    assert 0.0 <= figures["eval"]["sampled"]["accuracy"] <= 1.0
    assert figures["provenance"]["command"] and {"commit", "dirty", "machine"} <= set(figures["provenance"])
    path = tmp_path / "task.jsonl"
    result = runner.invoke(app, ["task", "export", "--out", str(path), "--count", "5", "--seed", "2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [make_example(2, i).prompt for i in range(5)]
    assert len(FilePromptSource(path)) == 5


def test_shipped_model_loads_and_its_tokenizer_round_trips() -> None:
    files = {p.name: p.stat().st_size for p in SHIPPED.iterdir()}
    assert "model.safetensors" in files and "config.json" in files
    assert sum(files.values()) < 8 * 2**20
    model = load_model(SHIPPED)
    assert model.config.model_type == "llama"
    assert next(model.parameters()).dtype == torch.float32  # stored bfloat16, computed float32 on CPU
    tok = HFTokenizer(SHIPPED)
    assert tok.eos_token_ids == (2,)
    text = TaskPromptSource(seed=0).get(0).text
    ids = tok.encode_prompt(text, {})
    assert len(ids) == len(text.encode())
    assert tok.decode(ids) == text


def test_shipped_model_has_learned_the_task() -> None:
    """The shipped model puts the reference responses far more likely than an undertrained model does
    (a plain forward over short chains; accuracy itself is measured by `april sft`, not asserted here)."""
    model = load_model(SHIPPED)
    tok = load_tokenizer(SHIPPED)
    spec = TaskSpec(max_steps=8)  # short chains keep the test fast
    rows = [encode(tok, e.prompt, e.response, 2) for e in (make_example(0, i, spec) for i in range(32))]
    batch = collate([(ids, [False] * p + [True] * (len(ids) - p)) for ids, p in rows], pad_id=0)
    with torch.no_grad():
        loss = float(model(**batch).loss)
    assert loss < 0.06, loss  # shipped: 0.032; undertrained (greedy accuracy 25%): 0.12


def test_shipped_calculator_model_has_its_tokenizer_and_context() -> None:
    """Digit groups and the task's words: a call is five tokens and its stop, the number one of them;
    any text round-trips."""
    tok = load_tokenizer(SHIPPED_CALCULATOR)
    chat = chat_format(tok)
    call = chat.turn_ids(Message(Role.ASSISTANT, "", (ToolCall("call_0", "add", {"n": 123}),)))
    assert len(call) == 6 and call[-1] in chat.stop_ids and tok.decode([call[2]]) == "123"
    for text in ("Sum: 1 22 333 4444 55555\nnext 22", "Answer: 0x7f, {'a': [1]} é"):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert [tok.decode([i]) for i in tok("4444 55555", add_special_tokens=False)["input_ids"]] == [
        "444", "4", " ", "555", "55"
    ]  # fmt: skip
    model = load_model(SHIPPED_CALCULATOR)
    assert model.config.vocab_size >= len(tok) and model.config.max_position_embeddings == calculator.CONTEXT


def test_shipped_calculator_model_has_learned_the_task() -> None:
    """On held-out episodes played without slips, the shipped model's greedy next token is the
    demonstrator's on nearly every trained token, the numbers it copies included (a forward pass with
    teacher forcing; episode accuracy is measured by `april sft`, not asserted here)."""
    model = load_model(SHIPPED_CALCULATOR)
    chat = chat_format(load_tokenizer(SHIPPED_CALCULATOR))
    rng = np.random.default_rng(0)
    hits = total = 0
    for i in range(64):
        tr = calculator.transcript(calculator.make_example(0, i), chat, 0.0, rng)
        with torch.no_grad():
            predicted = model(torch.tensor([tr.ids])).logits[0, :-1].argmax(-1).tolist()
        trained = [(p, t) for p, t, m in zip(predicted, tr.ids[1:], tr.loss_mask[1:], strict=True) if m]
        hits += sum(p == t for p, t in trained)
        total += len(trained)
    assert hits / total > 0.95, hits / total


@pytest.mark.parametrize(
    ("model_dir", "task", "options", "least"),
    [
        (SHIPPED_SPELL_BACKWARD, "spell_backward", SPELL_BACKWARD, 0.5),  # shipped: 0.67
        (SHIPPED_WORD_SEQUENCE_REVERSAL, "word_sequence_reversal", WORD_SEQUENCE_REVERSAL, 0.9),  # 0.956
    ],
)
def test_shipped_reasoning_gym_models_have_learned_their_task(
    model_dir: Path, task: str, options: str, least: float
) -> None:
    """On held-out questions (the generator seeds a default run holds out), the shipped model's greedy next
    token is the answer's on most answer tokens (a forward pass with teacher forcing; random init: 0.0; the
    sampled score is measured by `april sft`, not asserted here)."""
    tok = load_tokenizer(model_dir)
    records = reasoning_held_out(f"reasoning_gym:{task}", options, 64)
    rows = [encode(tok, r.text, r.metadata["answer"], 2) for r in records]
    assert sum(p.stat().st_size for p in model_dir.iterdir()) < 8 * 2**20
    model = load_model(model_dir)
    hits = total = 0
    for ids, prompt in rows:
        with torch.no_grad():
            predicted = model(torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
        hits += sum(p == t for p, t in zip(predicted[prompt - 1 :], ids[prompt:], strict=True))
        total += len(ids) - prompt
    assert hits / total > least
