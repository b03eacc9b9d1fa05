"""Evaluation on the held-out prompts: when the broker evaluates, the evaluation leases and the result.

An evaluation runs the fixed held-out prompts (`broker.heldout`) once each, greedily, under the weights
version that triggered it: the starting weights (v0) when a run starts, after the learner publishes version
v with `v % run.eval_every == 0`, and after the final version `run.steps`. One evaluation runs at a time;
one that falls due meanwhile starts when it finishes, at the broker's version then. Its samples live here,
never in the books of `broker.state`: no group, no ledger entry, no partial buffer, never in a batch. They
have group ids from `EVAL_GROUP_BASE` up (one sample, index 0, per held-out prompt) and take lease ids from
the same counter as training leases.

An evaluation sample that comes back INTERRUPTED (an abort hit its worker) keeps its tokens and is
resumed, as training partials are, but only for this evaluation: greedy decoding continued under the same
weights gives the response it would have given uninterrupted. Evaluation leases go to any worker: the
broker relays a version before it leases anything after it, so a worker generates them on the
evaluation's weights unless it failed to load them; gating on the reported version instead would stall
the evaluation for good when every load fails. The result says which versions its tokens really came
from (`oldest_version`, `newest_version`: a version published mid-evaluation may end some responses).
Accuracy is the fraction of held-out prompts whose response FINISHED with reward > 0 (the learner's
`accuracy` rule; a FAILED sample counts as wrong).

No sockets, no clocks: the broker core calls `on_version`, `take_work`, `accept_result` and `reclaim`.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from april.data import PromptRecord
from april.records import Sample, SampleStatus, new_group_samples
from april.status import EvalProgress, EvalStatus
from broker.result_check import ResultRejected, check_continues

log = logging.getLogger("april.broker")
EVAL_GROUP_BASE = 1 << 48  # evaluation group ids: disjoint from training groups (counted from 0)


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One finished evaluation."""

    version: int  # the weights version it was issued at
    accuracy: float  # fraction of held-out prompts answered with reward > 0
    reward_mean: float  # mean reward of the scored (FINISHED) samples; NaN if none
    n: int  # held-out prompts
    failed: int  # samples that FAILED (counted as wrong)
    oldest_version: int  # oldest weights version among its response tokens (< version: a load failed)
    newest_version: int  # newest weights version among its response tokens (> version: one was published)
    samples: tuple[Sample, ...] = field(default=(), repr=False, compare=False)  # held-out prompt i's is i-th

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "accuracy": self.accuracy,
            "reward_mean": None if math.isnan(self.reward_mean) else self.reward_mean,
            "n": self.n,
            "failed": self.failed,
            "oldest_version": self.oldest_version,
            "newest_version": self.newest_version,
        }

    def batch_stats(self) -> dict[str, float]:
        """What every later `Batch.stats` carries (readers see a new evaluation as a new eval_version)."""
        return {
            "eval_accuracy": self.accuracy,
            "eval_reward_mean": self.reward_mean,
            "eval_version": float(self.version),
        }


@dataclass(slots=True)
class EvalRun:
    """An evaluation in progress: sample i answers held-out prompt i."""

    version: int
    samples: list[Sample]
    queue: deque[int] = field(default_factory=deque)  # positions waiting for a lease
    leases: dict[int, tuple[str, Sample]] = field(default_factory=dict)  # lease -> (worker, as leased)
    done: int = 0  # FINISHED or FAILED samples


class Evaluations:
    """Decides when to evaluate and keeps the running evaluation's samples and leases."""

    def __init__(
        self,
        prompts: Sequence[PromptRecord],
        every: int,
        final_version: int,
        max_new_tokens: int,
        on_result: Callable[[EvalResult], None] | None = None,
    ) -> None:
        self.on_result = on_result  # told of every finished evaluation (the server appends it to a file)
        self.prompts = tuple(prompts)
        self.every = every
        self.final_version = final_version
        self.max_new_tokens = max_new_tokens
        self.version = 0  # the broker's weights version
        self.run: EvalRun | None = None
        self.due = False  # an evaluation fell due while one was running
        self.latest: EvalResult | None = None
        self.completed = 0
        self.tokens_generated = 0

    @property
    def enabled(self) -> bool:
        return self.every > 0 and bool(self.prompts)

    def on_version(self, version: int) -> None:
        """The broker accepted weights `version`: start an evaluation if one is due."""
        self.version = version
        if not self.enabled or not (version % self.every == 0 or version == self.final_version):
            return
        if self.run is None:
            self._start(version)
        else:
            self.due = True

    def _start(self, version: int) -> None:
        samples = [
            new_group_samples(EVAL_GROUP_BASE + i, 1, p.prompt_ids, p.text, p.metadata)[0]
            for i, p in enumerate(self.prompts)
        ]
        self.run = EvalRun(version, samples, deque(range(len(samples))))
        log.info("evaluation at v%d: %d held-out prompts", version, len(samples))

    def take_work(
        self, worker_id: str, credit: int, new_lease_id: Callable[[], int]
    ) -> list[tuple[int, int, Sample]]:
        """Lease up to `credit` evaluation samples to a worker. Returns (lease_id, budget, leased sample)
        triples."""
        run = self.run
        out: list[tuple[int, int, Sample]] = []
        if run is None:
            return out
        while run.queue and len(out) < credit:
            position = run.queue.popleft()
            before = run.samples[position]
            leased = before.resumed()
            lease_id = new_lease_id()
            run.leases[lease_id] = (worker_id, before)
            run.samples[position] = leased
            out.append((lease_id, leased.budget(self.max_new_tokens), leased))
        return out

    @property
    def queued(self) -> int:
        """Evaluation samples waiting for a lease."""
        return 0 if self.run is None else len(self.run.queue)

    def owns(self, lease_id: int) -> bool:
        return self.run is not None and lease_id in self.run.leases

    def leases_of(self, worker_id: str) -> list[int]:
        if self.run is None:
            return []
        return [lease_id for lease_id, (worker, _) in self.run.leases.items() if worker == worker_id]

    def leases_by_worker(self) -> Counter[str]:
        """Evaluation leases held per worker."""
        return Counter(worker for worker, _ in self.run.leases.values()) if self.run else Counter()

    def reclaim(self, lease_id: int) -> None:
        """Put a leased sample back as it was leased (its worker died, left or kept it past an abort)."""
        assert self.run is not None
        _, before = self.run.leases.pop(lease_id)
        position = before.group_id - EVAL_GROUP_BASE
        self.run.samples[position] = before
        self.run.queue.appendleft(position)

    def accept_result(self, worker_id: str, lease_id: int, sample: Sample, broker_version: int) -> int:
        """Take one returned evaluation sample; returns the new model tokens it brings. Raises
        ResultRejected (as `BrokerState.accept_result` does) when it does not continue what was leased."""
        run = self.run
        held = run.leases.get(lease_id) if run else None
        if run is None or held is None or held[0] != worker_id:
            raise ResultRejected("not_leased", f"lease {lease_id} is not held by {worker_id}")
        before = held[1]
        check_continues(before, sample, self.max_new_tokens, broker_version)
        del run.leases[lease_id]
        unchanged = sample.response_len == before.response_len and sample.episode == before.episode
        if not (sample.status == SampleStatus.INTERRUPTED and unchanged):  # as the books count aborts
            sample = sample.returned_by(worker_id, before.leases)
        position = sample.group_id - EVAL_GROUP_BASE
        run.samples[position] = sample
        new_tokens = sample.model_tokens - before.model_tokens
        self.tokens_generated += new_tokens
        if sample.status == SampleStatus.INTERRUPTED:
            run.queue.append(position)  # resumed later, for this evaluation only
        else:
            run.done += 1
            if run.done == len(run.samples):
                self._finish(run)
        return new_tokens

    def _finish(self, run: EvalRun) -> None:
        scored = [s.reward for s in run.samples if s.status == SampleStatus.FINISHED]
        versions = [seg.version for s in run.samples for seg in s.segments]
        self.latest = EvalResult(
            version=run.version,
            accuracy=sum(1 for r in scored if r > 0) / len(run.samples),
            reward_mean=sum(scored) / len(scored) if scored else float("nan"),
            n=len(run.samples),
            failed=len(run.samples) - len(scored),
            oldest_version=min(versions, default=run.version),
            newest_version=max(versions, default=run.version),
            samples=tuple(run.samples),
        )
        self.completed += 1
        self.run = None
        if self.on_result is not None:
            self.on_result(self.latest)
        log.info(
            "evaluation at v%d done: accuracy %.4f over %d held-out prompts (%d failed)",
            run.version,
            self.latest.accuracy,
            self.latest.n,
            self.latest.failed,
        )
        if self.due:
            self.due = False
            self._start(self.version)

    def batch_stats(self) -> dict[str, float]:
        """The latest result's figures for a new batch's stats; empty before the first evaluation."""
        return self.latest.batch_stats() if self.latest else {}

    def status(self) -> EvalStatus | None:
        """The `eval` record of the broker's status; None when evaluation is off."""
        if not self.enabled:
            return None
        latest, run = self.latest, self.run
        return EvalStatus(
            version=None if latest is None else latest.version,
            accuracy=None if latest is None else latest.accuracy,
            reward_mean=None if latest is None or math.isnan(latest.reward_mean) else latest.reward_mean,
            n=0 if latest is None else latest.n,
            failed=0 if latest is None else latest.failed,
            oldest_version=None if latest is None else latest.oldest_version,
            newest_version=None if latest is None else latest.newest_version,
            every=self.every,
            completed=self.completed,
            tokens_generated=self.tokens_generated,
            running=None
            if run is None
            else EvalProgress(
                version=run.version, done=run.done, leased=len(run.leases), of=len(run.samples)
            ),
        )
