"""Supervised warm start: a tiny Llama-style model taught a built-in task's demonstrations.

Owns `SftSettings`, `SftTask` (what the demonstrations are: the built-in task's worked chains, the
calculator task's tool-calling episodes, or a reasoning-gym generator's own question -> answer entries,
from generator seeds `RG_SEED_BASE + seed` on, far from any RL run's training and held-out seeds),
the token encoding of examples for training, the
length-bucketed batch order and `train_sft`, which writes a random tiny model with
`april.hf.make_tiny_model`, loads it back through `april.hf.load_model` (the path every HF checkpoint
takes), trains it with plain torch AdamW on next-token cross-entropy over the model's own tokens (a
chain's response; an episode's turns, never its prompt or observations, which are context only), and
saves it as an HF directory (safetensors, `save_dtype`) with its tokenizer.

The demonstrations are imperfect on purpose (`slip_rate`, see `april.task.demonstration`): a quarter of
the sums are slightly off and the chain carries the slip to a wrong answer. The model learns the
arithmetic (greedy decoding is mostly right) and the demonstrator's slip rate along with it, so sampling
at temperature 1.0 slips too and gets roughly 40% of the answers right: the room RL has to improve, by
learning from the reward not to slip, which is the sharpening RL does on real LLMs, and which a
tiny model learns in minutes (an undertrained model instead has fragile circuits that RL noise breaks).

Deterministic: the same settings give the same weights, bit for bit, on the same machine and thread
count (2 by default, whatever the core count): the init is seeded by `seed`, the examples and their slips
come from task seed `data_seed(seed)`, the batch order from a numpy generator seeded by `seed`, and
nothing else is random.

Does not evaluate the model (`cli.sft_cmd` does, with the rollout engine) nor know anything of RL.
Heavy imports (torch, transformers) happen inside functions.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from april.chat import chat_format
from april.envs import calculator, reasoning_gym
from april.hf import TINY_CALCULATOR_MODEL, TINY_MODEL
from april.task import TaskSpec, demonstration, make_example

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100  # label of positions that carry no loss (prompt, observations and padding)
DATA_SEED_OFFSET = 1000  # SFT examples come from task seed 1000 + seed: never the RL prompts of seed 0
DEFAULT_STEPS = 900
DEFAULT_LR = 3e-3
DEFAULT_SLIP_RATE = 0.25
DEFAULT_THREADS = 2  # fixed, not the core count: another thread count may change the last bits
# reasoning-gym demonstrations: generator seeds RG_SEED_BASE + seed + i, i < RG_SIZE. An RL run's training
# entries use seeds [data.seed, data.seed + data.size) and its held-out ones the seeds just past them, so
# runs with data.seed + data.size + eval_size < RG_SEED_BASE never meet a demonstrated entry's seed
RG_SEED_BASE = 1_000_000
RG_SIZE = 1_000_000


class SftTask(enum.StrEnum):
    """What the model is taught (`april sft --task`)."""

    TASK = "task"  # the built-in task's worked chains (april.task): models/tiny
    CALCULATOR = "calculator"  # the calculator task's episodes (april.envs.calculator)
    REASONING_GYM = "reasoning_gym"  # a reasoning-gym generator's entries (`SftSettings.source`)

    @property
    def context(self) -> int:
        """The positions the model is given: the longest demonstrations fit."""
        return calculator.CONTEXT if self is SftTask.CALCULATOR else 1024

    @property
    def words(self) -> tuple[str, ...]:
        """The model's tokenizer beyond bytes (`april.hf.make_tiny_tokenizer`): digit groups and these
        whole words when not empty. The calculator's has them, so that a number the model copies is one
        token a few tokens from where it goes (a byte-level model did not learn to copy across its
        40-byte calls); the built-in task's is byte-level."""
        return calculator.WORDS if self is SftTask.CALCULATOR else ()


def parse_task(text: str) -> tuple[SftTask, str]:
    """`april sft --task`: "task", "calculator" or "reasoning_gym:TASK[,TASK...]" -> (kind, source);
    source is "" but for reasoning-gym. ValueError (one line) otherwise."""
    if reasoning_gym.is_reasoning_gym(text):
        return SftTask.REASONING_GYM, text
    if text in (SftTask.TASK, SftTask.CALCULATOR):
        return SftTask(text), ""
    raise ValueError(f"--task: got {text!r}, expected task, calculator or reasoning_gym:TASK[,TASK...]")


def default_model_dir(task: SftTask, source: str = "") -> Path:
    """Where `april sft --task` writes by default: the shipped model of the task; for reasoning-gym
    models/tiny-<tasks>, underscores and commas as hyphens (models/tiny-spell-backward)."""
    if task is SftTask.REASONING_GYM:
        name = source.removeprefix(reasoning_gym.PREFIX).replace("_", "-").replace(",", "-")
        return TINY_MODEL.with_name(f"tiny-{name}")
    return TINY_CALCULATOR_MODEL if task is SftTask.CALCULATOR else TINY_MODEL


Row = tuple[list[int], list[bool]]  # a demonstration's token ids and its loss mask (True: trained on)


def data_seed(seed: int) -> int:
    """The task seed of the SFT training examples for run `seed`."""
    return DATA_SEED_OFFSET + seed


@dataclass(frozen=True, slots=True)
class SftSettings:
    """Model shape and training schedule. The defaults produce the shipped `models/tiny`."""

    seed: int = 0
    task: SftTask = SftTask.TASK
    steps: int = DEFAULT_STEPS  # optimizer steps
    lr: float = DEFAULT_LR  # peak learning rate (linear warm-up, then cosine decay to lr_final_ratio * lr)
    lr_final_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_tokens: int = 4096  # padded tokens (rows x longest row) per optimizer step, at most
    pool_size: int = 2048  # examples sorted by length together to form batches of similar lengths
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 384
    max_positions: int = 0  # the model's context; 0: the task's (`SftTask.context`)
    threads: int = DEFAULT_THREADS  # torch intra-op threads; 0: every core
    save_dtype: str = "bfloat16"  # on-disk dtype; `load_model` upcasts to float32 on CPU
    slip_rate: float = DEFAULT_SLIP_RATE  # chance that a demonstrated sum is off (a chain's or a call's)
    spec: TaskSpec = field(default_factory=TaskSpec)  # the built-in task's shape (task `task` only)
    source: str = ""  # task `reasoning_gym`: "reasoning_gym:TASK[,TASK...]", as data.source
    options: str = ""  # task `reasoning_gym`: the generators' options, as data.options (JSON)

    def __post_init__(self) -> None:
        for name in ("steps", "lr", "batch_tokens", "pool_size", "hidden", "layers", "heads"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SftSettings.{name} = {getattr(self, name)!r}, expected > 0")
        if not isinstance(self.task, SftTask):
            raise ValueError(f"SftSettings.task = {self.task!r}, expected one of {', '.join(SftTask)}")
        if (self.task is SftTask.REASONING_GYM) != bool(self.source):
            raise ValueError(
                f"SftSettings.source = {self.source!r}: expected a reasoning_gym: source exactly when "
                f"task is reasoning_gym (task {self.task})"
            )
        if self.save_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"SftSettings.save_dtype = {self.save_dtype!r}, expected float32 or bfloat16")


@dataclass(frozen=True, slots=True)
class SftResult:
    model_dir: Path
    steps: int
    final_loss: float  # mean cross-entropy (nats) of the trained tokens over the last 10% of steps
    train_tokens: int  # real (unpadded) tokens trained on
    wall_s: float
    parameters: int


def encode(tokenizer: Any, prompt: str, response: str, eos_id: int) -> tuple[list[int], int]:
    """(prompt ids ++ response ids ++ [eos], prompt length). The prompt is encoded exactly as the
    worker's `HFTokenizer.encode_prompt` encodes a text prompt."""
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    return prompt_ids + response_ids + [eos_id], len(prompt_ids)


def batch_order(lengths: list[int], batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """Rows of a pool grouped into batches of similar length, each with rows x longest <= batch_tokens
    (a row longer than the budget goes alone), in a random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending lengths: the newest row is the longest
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return [batches[k] for k in rng.permutation(len(batches))]


def demonstrations(tokenizer: Any, settings: SftSettings, eos_id: int) -> Callable[[int], Row]:
    """Example `index` of the task, demonstrated, as (ids, loss mask): the one place the task picks the
    data. Examples and slips come from task seed `data_seed(settings.seed)`, slips from their own
    generator per example."""
    seed = data_seed(settings.seed)
    if settings.task is SftTask.CALCULATOR:
        chat = chat_format(tokenizer)

        def episode(index: int) -> Row:
            ex = calculator.make_example(seed, index)
            tr = calculator.transcript(ex, chat, settings.slip_rate, np.random.default_rng((seed, index, 1)))
            return tr.ids, tr.loss_mask

        return episode

    if settings.task is SftTask.REASONING_GYM:
        source = reasoning_demonstrations(settings)

        def entry(index: int) -> Row:
            # the generator's own answer, alone on the response's only line: what the reward reads
            # (`actors.rewards.extract_final_answer`'s last non-empty line; no <answer> tag to spend
            # tokens on). Slips do not apply: the answer is the generator's, right or absent.
            record = source.get(index)
            ids, prompt_len = encode(tokenizer, record.text, record.metadata["answer"], eos_id)
            return ids, [False] * prompt_len + [True] * (len(ids) - prompt_len)

        return entry

    def chain(index: int) -> Row:
        ex = make_example(seed, index, settings.spec)
        response = demonstration(ex, settings.slip_rate, np.random.default_rng((seed, index, 1)))
        ids, prompt_len = encode(tokenizer, ex.prompt, response, eos_id)
        return ids, [False] * prompt_len + [True] * (len(ids) - prompt_len)

    return chain


def reasoning_demonstrations(settings: SftSettings) -> reasoning_gym.ReasoningGymSource:
    """The reasoning-gym entries demonstrated for `settings` (seeds RG_SEED_BASE + seed on)."""
    return reasoning_gym.ReasoningGymSource(
        settings.source, RG_SIZE, RG_SEED_BASE + settings.seed, settings.options
    )


def batches(tokenizer: Any, settings: SftSettings, eos_id: int) -> Iterator[list[Row]]:
    """Endless batches of rows over fresh demonstrations, one pool at a time."""
    rng = np.random.default_rng(settings.seed)
    row = demonstrations(tokenizer, settings, eos_id)
    next_index = 0
    while True:
        pool = [row(index) for index in range(next_index, next_index + settings.pool_size)]
        next_index += settings.pool_size
        for rows in batch_order([len(ids) for ids, _ in pool], settings.batch_tokens, rng):
            yield [pool[r] for r in rows]


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` `[B, T]`; labels are IGNORE_INDEX where
    the loss mask is False and on the padding (the model shifts them by one itself)."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for b, (ids, mask) in enumerate(rows):
        if len(mask) != len(ids):
            raise ValueError(f"row {b}: {len(ids)} ids and {len(mask)} loss mask entries, expected equal")
        row = torch.tensor(ids)
        input_ids[b, : len(ids)] = row
        attention[b, : len(ids)] = 1
        labels[b, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), row, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def lr_factor(step: int, settings: SftSettings) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from 1 to `lr_final_ratio` at the last step."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    span = max(1, settings.steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    return settings.lr_final_ratio + (1 - settings.lr_final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_sft(
    out_dir: Path | str, settings: SftSettings, log: Callable[[str], None] = print, log_every: int = 50
) -> SftResult:
    """Create, train and save the warm-started model in `out_dir` (overwriting a model there)."""
    import torch

    from april.hf import load_model, load_tokenizer, make_tiny_model, set_torch_threads

    started = time.perf_counter()
    set_torch_threads(settings.threads or _cores())
    path = make_tiny_model(
        out_dir,
        settings.seed,
        hidden=settings.hidden,
        layers=settings.layers,
        heads=settings.heads,
        intermediate=settings.intermediate,
        max_positions=settings.max_positions or settings.task.context,
        init_std=0.02,
        digit_groups=bool(settings.task.words),
        words=settings.task.words,
    )
    tokenizer = load_tokenizer(path)
    model = load_model(path, "cpu", "float32")
    model.train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=settings.betas,
    )
    data = batches(tokenizer, settings, int(tokenizer.eos_token_id))
    losses: list[float] = []
    tokens = 0
    for step in range(settings.steps):
        rows = next(data)
        batch = collate(rows, int(tokenizer.pad_token_id))
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * lr_factor(step, settings)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        tokens += sum(len(ids) for ids, _ in rows)
        if log_every and ((step + 1) % log_every == 0 or step + 1 == settings.steps):
            recent = losses[-log_every:]
            log(
                f"sft step {step + 1}/{settings.steps}: loss {sum(recent) / len(recent):.4f}, "
                f"{tokens} tokens, {time.perf_counter() - started:.0f}s"
            )
    model.eval()  # type: ignore[no-untyped-call]
    model.to(getattr(torch, settings.save_dtype))
    model.save_pretrained(path)
    tail = losses[-max(1, settings.steps // 10) :]
    return SftResult(
        path, settings.steps, sum(tail) / len(tail), tokens, time.perf_counter() - started, params
    )


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
