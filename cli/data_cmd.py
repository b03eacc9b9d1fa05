"""`april data inspect`: what a run will read from its dataset, checked before the run starts.

Opens the source the config names (`data.source`, or SOURCE) with the data.* keys training uses, so a bad
record is the same one line a run would give, and reports: the record count and format, the fields and
their types, the first record's prompt as the model reads it (through the tokenizer's chat template where
it has one, as the worker tokenizes it) with the answer the reward gets, and the prompt lengths in the
model's tokens (p50, p90, p99, max) over every record or a seeded sample of them.

`inspect_dataset` does the work and returns an `Inspection`; `render` writes it; `cli/main.py` holds the
thin command.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import typer

from actors.tokenizer import HFTokenizer
from april.config import Config
from april.data import FilePromptSource, PromptRecord
from april.sources import open_source

PERCENTILES = (50, 90, 99)
SAMPLE = 10_000  # records tokenized for the length percentiles by default (0: every record)
SAMPLE_SEED = 0

data_app = typer.Typer(help="Datasets: check what a run will read from data.source.", no_args_is_help=True)


@dataclass(frozen=True, slots=True)
class Inspection:
    source: str  # the source's own description
    count: int
    fields: tuple[tuple[str, str], ...]  # (field, type); empty for the built-in sources
    model: str
    first: PromptRecord  # the dataset's first record
    rendered: str  # its prompt as the model reads it
    first_tokens: int  # and its length in tokens
    chat: str  # how a chat prompt reaches the model: "chat template", "last user message" or ""
    lengths: tuple[int, ...]  # prompt tokens of each record measured
    sampled: bool  # lengths are of a seeded sample, not of every record


def inspect_dataset(config: Config, model: Path, sample: int = SAMPLE) -> Inspection:
    """Open the configured source in dataset order and measure it with `model`'s tokenizer."""
    source = open_source(dataclasses.replace(config.data, shuffle=False), config.run.seed, config.env)
    fields = tuple(source.rows.fields()) if isinstance(source, FilePromptSource) else ()
    tokenizer = HFTokenizer(model)
    count = len(source)
    if 0 < sample < count:
        rng = np.random.default_rng(SAMPLE_SEED)
        positions = sorted(int(i) for i in rng.choice(count, size=sample, replace=False))
    else:
        positions = list(range(count))

    def encode(record: PromptRecord) -> np.ndarray:
        if record.prompt_ids.shape[0]:
            return record.prompt_ids
        return tokenizer.encode_prompt(record.text, record.metadata)

    first = source.get(0)
    first_ids = encode(first)
    chat = ""
    if "messages" in first.metadata:
        chat = "chat template" if tokenizer.has_chat_template else "last user message"
    return Inspection(
        source=source.describe(),
        count=count,
        fields=fields,
        model=str(model),
        first=first,
        rendered=tokenizer.render(first_ids),
        first_tokens=int(first_ids.shape[0]),
        chat=chat,
        lengths=tuple(int(encode(source.get(p)).shape[0]) for p in positions),
        sampled=len(positions) < count,
    )


def percentiles(lengths: tuple[int, ...]) -> dict[str, int]:
    """p50, p90, p99 (the smallest length at or above that share of the prompts) and max."""
    values = np.asarray(lengths)
    # inverted_cdf: an observed length, never one interpolated between two prompts
    out = {f"p{p}": int(np.percentile(values, p, method="inverted_cdf")) for p in PERCENTILES}
    out["max"] = int(values.max())
    return out


def render(found: Inspection) -> str:
    lines = [f"source: {found.source}", f"records: {found.count}"]
    if found.fields:
        width = max(len(name) for name, _ in found.fields)
        lines.append("fields:")
        lines += [f"  {name.ljust(width)}  {kind}" for name, kind in found.fields]
    first = found.first
    answer = first.metadata.get("answer")
    lines.append("first record:")
    lines.append(f"  answer given to the reward: {answer!r}" if answer is not None else "  no answer")
    how = f", {found.chat}" if found.chat else ""
    lines.append(f"  prompt as {found.model} reads it ({found.first_tokens} tokens{how}):")
    lines += [f"    {line}" if line else "" for line in found.rendered.splitlines() or [""]]
    over = (
        f"a seeded sample of {len(found.lengths)} records" if found.sampled else f"all {found.count} records"
    )
    stats = ", ".join(f"{k} {v}" for k, v in percentiles(found.lengths).items())
    lines.append(f"prompt tokens ({found.model}, {over}): {stats}")
    return "\n".join(lines)
