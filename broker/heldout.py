"""The held-out evaluation prompts: a fixed set, never issued for training, split off the prompt source
or read from a dataset of its own (`data.eval_source`, as verl's `val_files`).

One rule for every `PromptSource` (synthetic, JSONL, the built-in task), through the protocol alone: the
held-out set is the first `size` distinct records the source yields (cursors 0, 1, ... of its first
epoch, so a seeded random subset when the source shuffles, the first `size` entries when it does not),
identified by `PromptRecord.prompt_index`. `TrainingView` is the same source with those entries taken out
of every epoch: training cursor t is the t-th record, in the source's own order, that is not held out.
The split is a pure function of the source (its seed and data), so a resumed run finds the same set.
`data.eval_size = -1` (the default) sizes it to the source (`auto_eval_size`), so a small dataset
still leaves prompts to train on; an `eval_source` is read in its own order, all of it by default. A
reasoning-gym source splits nothing off: its held-out questions come from generator seeds past the
training ones (`ReasoningGymSource.held_out`).

It relies on the source's contract that each epoch (cursors `e * len .. (e + 1) * len - 1`) yields
every `prompt_index` exactly once. Owns no cursor and no I/O.
"""

from __future__ import annotations

import dataclasses

from april.config import Config, ConfigError
from april.data import PromptRecord, PromptSource
from april.envs.reasoning_gym import ReasoningGymSource
from april.sources import is_generated, open_source

AUTO_EVAL_MAX = 64  # data.eval_size = -1 holds out a tenth of the source's prompts, at most this many


class TrainingView:
    """A `PromptSource`: `source` without the held-out entries, `len(source) - len(held_out)` per epoch.

    Random access by scanning the source's epoch in order and remembering where the kept records sit, so
    drawing cursors in order (the broker's way) costs O(1) `source.get` calls each, amortised; a jump
    into an epoch (a restored cursor) scans that epoch once up to the cursor."""

    def __init__(self, source: PromptSource, held_out: frozenset[int]) -> None:
        self.source = source
        self.held_out = held_out
        self._size = len(source) - len(held_out)
        self._epoch = -1
        self._kept: list[int] = []  # positions (within the epoch) of the kept records scanned so far
        self._scanned = 0

    def __len__(self) -> int:
        return self._size

    def get(self, cursor: int) -> PromptRecord:
        if cursor < 0:
            raise ValueError(f"prompt cursor must be >= 0, got {cursor}")
        epoch, position = divmod(cursor, self._size)
        if epoch != self._epoch:
            self._epoch, self._kept, self._scanned = epoch, [], 0
        base = epoch * len(self.source)
        while len(self._kept) <= position:
            if self._scanned >= len(self.source):
                raise RuntimeError(
                    f"epoch {epoch} of {self.source.describe()} holds fewer than {self._size} prompts "
                    "outside the held-out set: a source must yield every prompt_index once per epoch"
                )
            if self.source.get(base + self._scanned).prompt_index not in self.held_out:
                self._kept.append(self._scanned)
            self._scanned += 1
        return self.source.get(base + self._kept[position])

    def describe(self) -> str:
        return f"{self.source.describe()} without {len(self.held_out)} held-out prompts"


def split_held_out(source: PromptSource, size: int) -> tuple[TrainingView, tuple[PromptRecord, ...]]:
    """(the training view, the `size` held-out records in a fixed order). ConfigError (naming
    `data.eval_size`) when the source cannot spare `size` prompts and keep at least one for training."""
    if not 0 < size < len(source):
        raise ConfigError(
            f"data.eval_size = {size}: must be in 1..{len(source) - 1} to hold prompts out of "
            f"{source.describe()} and keep some for training (-1 sizes it to the data; data.eval_source "
            "names a dataset of held-out prompts)"
        )
    held: dict[int, PromptRecord] = {}
    for cursor in range(len(source)):
        if len(held) == size:
            break
        record = source.get(cursor)
        held.setdefault(record.prompt_index, record)
    return TrainingView(source, frozenset(held)), tuple(held.values())


def auto_eval_size(prompts: int) -> int:
    """`data.eval_size = -1` for a source of `prompts`: a tenth of them, at least 1 and at most
    `AUTO_EVAL_MAX`, so that most stay for training; 0 for a source of one prompt (nothing to spare)."""
    return 0 if prompts < 2 else min(AUTO_EVAL_MAX, max(1, prompts // 10))


def open_prompts(config: Config) -> tuple[PromptSource, tuple[PromptRecord, ...]]:
    """The run's training prompts and its held-out ones (none when it does not evaluate); a bad dataset
    or held-out size raises DatasetError / ConfigError (`april up` calls this before starting anything)."""
    data = config.data
    source = open_source(data, config.run.seed, config.env)
    if config.run.eval_every == 0 or data.eval_size == 0:
        return source, ()
    if data.eval_source:  # a dataset of its own: training keeps every prompt of `source`
        if is_generated(data.eval_source):
            raise ConfigError(
                f"data.eval_source = {data.eval_source!r}: expected a dataset path (a generated source draws "
                "the training prompts again under the run's seed; leave it empty to hold prompts out)"
            )
        held = open_source(dataclasses.replace(data, source=data.eval_source, shuffle=False), config.run.seed)
        size = len(held) if data.eval_size == -1 else data.eval_size
        if size > len(held):
            raise ConfigError(
                f"data.eval_size = {size}: must be in 1..{len(held)}, the prompts of data.eval_source "
                f"{held.describe()}"
            )
        return source, tuple(held.get(i) for i in range(size))
    size = auto_eval_size(len(source)) if data.eval_size == -1 else data.eval_size
    if size == 0:
        return source, ()
    if isinstance(source, ReasoningGymSource):  # fresh questions, from generator seeds training never uses
        held = source.held_out(-(-size // len(source.tasks)))
        return source, tuple(held.get(i) for i in range(size))
    return split_held_out(source, size)  # training never sees them
