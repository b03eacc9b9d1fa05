"""Simulated rollout engines for `april simulate`: slots and decode steps in virtual time, vectorised.

Owns the engine side of the simulation: which leased samples each engine is decoding, how many tokens
each has produced, when its next step boundary falls, and the broker messages it has not read yet.

Cost model: `april.engine_cost.EngineCost`, the one the sim engine a worker runs also uses (a decode
step over `active` sequences, plus the prefill of every input token admitted in that step). A fresh
sample's input is its prompt; a resumed partial re-prefills prompt + the response so far (the resume
hand-off cost), less what this engine's prefix cache still holds of it (`april.prefix_cache`, the rule
the sim engine follows too: the same re-prefill for the same events). `busy_s` and `reprefill_tokens`
give the re-prefill share of engine time; `stale_kv_tokens` counts tokens generated while attending to
KV computed under older weights than the loaded ones (what resume_kv "reuse" costs in exactness).

Vectorised: all sequences of an engine advance together, so between two events an engine is an
arithmetic progression of step boundaries (the first step longer by its prefill). It is woken only at a
boundary where a sequence finishes or where a message waits, never once per token. Messages are read
at step boundaries, as the worker reads its socket between decode steps; a lease granted mid-step
joins the next step.

Knows nothing of scheduling: `broker.sim.model` decides what to lease and when to abort.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from april.engine_cost import EngineCost
from april.prefix_cache import PrefixCache
from april.records import FinishReason, Sample
from broker.sim.figures import Meter

LengthOf = Callable[[Sample], int]  # the drawn total response length of a sample
Output = tuple[int, Sample]  # (lease id, the sample as returned to the broker)
_EPS = 1e-9  # float slack when placing a time on the step grid


@dataclass(frozen=True, slots=True)
class Lease:
    """Broker -> engine: (lease id, token budget, leased sample) triples."""

    work: list[tuple[int, int, Sample]]


@dataclass(frozen=True, slots=True)
class Abort:
    """Broker -> engine: return every unfinished sample as a partial, then confirm."""


@dataclass(frozen=True, slots=True)
class Weights:
    """Broker -> engine: load this version between decode steps."""

    version: int


ToEngine = Lease | Abort | Weights


@dataclass(slots=True)
class _Seq:
    lease_id: int
    sample: Sample  # as leased (RUNNING)
    finish: FinishReason  # STOP or LENGTH once its tokens are out
    marks: list[tuple[int, int]]  # (tokens produced in this lease, version from then on)
    cached: int = 0  # input tokens the prefix cache gave back
    kv_version: int = 0  # weights version of the oldest KV it attends to
    prefilled: bool = False  # its first step ran: the KV of its whole input exists


class EngineModel:
    """One simulated engine with `slots` concurrent sequences (see the module docstring)."""

    def __init__(
        self,
        index: int,
        slots: int,
        cost: EngineCost,
        meter: Meter,
        length_of: LengthOf,
        keep_kv_across_updates: bool = False,
    ) -> None:
        self.index = index
        self.worker_id = f"sim-{index}"
        self.slots = slots
        self.cost = cost
        self.meter = meter
        self.length_of = length_of
        self.version = 0
        self.seqs: list[_Seq] = []
        self.produced = np.zeros(0, dtype=np.int64)  # (active,) tokens of each sequence in this lease
        self.remaining = np.zeros(0, dtype=np.int64)  # (active,) tokens until each one finishes
        self.t_base = 0.0  # time (s) of the step boundary the engine was last brought to
        self.prefill = 0  # input tokens paid in the next step
        self.inbox: list[ToEngine] = []
        self.wake: tuple[float, int] | None = None  # the scheduled wake: (time, steps after t_base)
        self.generation = 0  # bumped whenever `wake` is replaced, so stale queue entries are skipped
        self.tokens = 0  # response tokens generated, every lease
        self.busy = False  # inside a wake: new messages are read before it ends
        self.cache = PrefixCache(cost.prefix_cache_tokens, keep_kv_across_updates)
        self.reprefill = 0  # of `prefill`: input tokens of resumed samples the cache missed
        self.admitted = False  # sequences admitted since the last step
        self.reprefill_tokens = 0  # paid, every lease
        self.busy_s = 0.0  # time spent in decode steps
        self.stale_kv_tokens = 0  # tokens generated attending to KV of older weights than the loaded ones
        self.stale_seqs = 0  # running sequences attending to such KV (kept up to date: advance is hot)

    @property
    def active(self) -> int:
        return len(self.seqs)

    @property
    def in_engine_tokens(self) -> int:
        """Tokens generated by running sequences and not yet returned to the broker."""
        return int(self.produced.sum())

    # ------------------------------------------------------------------ the step grid

    def boundary(self, steps: int) -> float:
        """Time of the boundary `steps` (>= 1) decode steps after t_base."""
        first = self.cost.step_s(self.active, self.prefill)
        return self.t_base + first + (steps - 1) * self.cost.step_s(self.active)

    def next_boundary(self, t: float) -> tuple[float, int]:
        """The first moment at or after `t` where the engine reads messages: (time, steps after t_base).
        An idle engine reads at once."""
        if not self.seqs:
            return max(t, self.t_base), 0
        first = self.cost.step_s(self.active, self.prefill)
        if t <= self.t_base + first + _EPS:
            return self.boundary(1), 1
        steps = 1 + math.ceil((t - self.t_base - first) / self.cost.step_s(self.active) - _EPS)
        return self.boundary(steps), steps

    def next_finish(self) -> tuple[float, int] | None:
        """The boundary where the next sequence finishes, or None when idle."""
        if not self.seqs:
            return None
        steps = int(self.remaining.min())
        return self.boundary(steps), steps

    def advance(self, now: float, steps: int) -> None:
        """Bring the engine to `now`, the boundary `steps` steps after t_base (0 for an idle engine)."""
        if steps:
            self.produced += steps
            self.remaining -= steps
            self.tokens += steps * self.active
            self.stale_kv_tokens += steps * self.stale_seqs
            self.busy_s += now - self.t_base
            if self.admitted:  # their first step ran (even one whose whole input was cached)
                for seq in self.seqs:
                    seq.prefilled = True
                self.admitted = False
            self.reprefill_tokens += self.reprefill
            self.prefill = self.reprefill = 0
        self.t_base = now

    # ------------------------------------------------------------------ sequences

    def take_finished(self) -> list[Output]:
        """Sequences that produced their last token: out of their slots, as FINISHED samples."""
        done = np.flatnonzero(self.remaining <= 0)
        if done.shape[0] == 0:
            return []
        out = [
            (self.seqs[i].lease_id, _output(self.seqs[i], int(self.produced[i]), self.seqs[i].finish))
            for i in done
        ]
        self._keep(self.remaining > 0)
        return out

    def admit(self, work: list[tuple[int, int, Sample]]) -> list[Output]:
        """Start leased samples (prefilled in the next step). Returns those with nothing to generate."""
        ready: list[Output] = []
        before = self.active
        produced, remaining = [], []
        for lease_id, budget, sample in work:
            done = sample.response_len
            left = self.length_of(sample) - done
            n = max(0, min(left, budget))
            finish = FinishReason.STOP if left <= budget else FinishReason.LENGTH
            seq = _Seq(lease_id, sample, finish, [(0, self.version)])
            if n == 0:
                ready.append((lease_id, _output(seq, 0, finish if budget else FinishReason.LENGTH)))
                continue
            self.seqs.append(seq)
            produced.append(0)
            remaining.append(n)
            input_len = int(sample.prompt_ids.shape[0]) + done
            hit = self.cache.take(sample.key, input_len)
            seq.cached = hit.tokens
            seq.kv_version = min(hit.kv_version, self.version) if hit.tokens else self.version
            self.prefill += input_len - hit.tokens
            if done:
                self.reprefill += input_len - hit.tokens
            self.stale_seqs += seq.kv_version < self.version
            self.admitted = True
        if produced:
            self.produced = np.concatenate([self.produced, np.asarray(produced, dtype=np.int64)])
            self.remaining = np.concatenate([self.remaining, np.asarray(remaining, dtype=np.int64)])
        self.meter.engine_changed(before, self.active, self.slots)
        return ready

    def abort(self) -> list[Output]:
        """Every running sequence back as an INTERRUPTED partial with the tokens it has."""
        out = []
        for seq, n in zip(self.seqs, self.produced.tolist(), strict=True):
            out.append((seq.lease_id, _output(seq, n, FinishReason.ABORT)))
            # its KV stays on the engine: all of it once prefilled, else only what the cache gave back
            s = seq.sample
            kv = int(s.prompt_ids.shape[0]) + s.response_len + n if seq.prefilled else seq.cached
            self.cache.store(s.key, kv, seq.kv_version)
        self._keep(np.zeros(self.active, dtype=bool))
        self.prefill = self.reprefill = 0
        return out

    def load(self, version: int) -> None:
        """New weights: tokens from the next step on carry `version`."""
        if version <= self.version:
            return
        self.version = version
        self.cache.update(version)
        self.stale_seqs = self.active  # every running sequence's KV predates these weights
        for seq, n in zip(self.seqs, self.produced.tolist(), strict=True):
            if seq.marks[-1][0] == n:
                seq.marks[-1] = (n, version)
            else:
                seq.marks.append((n, version))

    def _keep(self, mask: npt.NDArray[np.bool_]) -> None:
        before = self.active
        self.seqs = [seq for seq, keep in zip(self.seqs, mask.tolist(), strict=True) if keep]
        self.stale_seqs = sum(seq.kv_version < self.version for seq in self.seqs)
        self.produced = self.produced[mask]
        self.remaining = self.remaining[mask]
        self.meter.engine_changed(before, self.active, self.slots)


def _output(seq: _Seq, produced: int, reason: FinishReason) -> Sample:
    """The leased sample extended by `produced` tokens, one segment per weights version (what the worker's
    `apply_output` builds from an engine output); a finished one is scored (reward 0: no task here)."""
    s = seq.sample
    ends = [start for start, _ in seq.marks[1:]] + [produced]
    for (start, version), end in zip(seq.marks, ends, strict=True):
        if end > start:
            s = s.extend(
                np.zeros(end - start, np.int32), np.zeros(end - start, np.float32), version, FinishReason.NONE
            )
    last_version = s.segments[-1].version if s.segments else 0
    s = s.extend([], [], last_version, reason)
    return s if reason == FinishReason.ABORT else s.scored(0.0)
