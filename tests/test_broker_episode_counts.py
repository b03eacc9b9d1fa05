"""What the broker counts for an episode: model tokens as generated, every response token as budget.

An episode's response holds the model's turns and the environment's observations. The broker's
`tokens_generated` (per worker, in total, per batch, per evaluation), the batch's `offpolicy_token_frac`
and the tokens it holds count the model's tokens only (the segments': what is trained and what an engine
generated), while a lease's budget and the length history count the whole response (the context is the
limit). A partial episode returned with no new token but a new episode state has changed, and is kept.
"""

from __future__ import annotations

from itertools import count

import numpy as np
import pytest
from test_broker_core import core_of, hello
from test_broker_state import make_state

from april.config import Mode
from april.data import SyntheticPromptSource
from april.records import FinishReason, Sample, SampleStatus
from broker.decisions import LeaseOut
from broker.evaluation import Evaluations
from broker.heldout import split_held_out


def episode(leased: Sample, first: int, second: int, reward: float = 1.0) -> Sample:
    """Two model turns (2 tokens under version `first`, 2 under `second`) around a 3-token observation:
    7 response tokens, 4 of them the model's."""
    turn = leased.extend([5, 6], [-0.5, -0.5], first, FinishReason.NONE).observed([7, 8, 9])
    return (
        turn.with_episode(b'{"turns": 1}')
        .extend([10, 11], [-0.25, -0.25], second, FinishReason.STOP)
        .scored(reward)
    )


def test_the_books_count_model_tokens_and_budget_every_response_token() -> None:
    state = make_state(Mode.SYNC, b=1, over=1, n=2, max_new=16)
    work = state.take_work("w0", 2)
    assert state.set_weights(1, "v1", "sha")  # the second turns are generated under version 1
    for (lease_id, _, leased), reward in zip(work, (0.0, 1.0), strict=True):
        assert state.accept_result("w0", lease_id, episode(leased, 0, 1, reward)) == 4
    assert state.totals.tokens_generated == state.round.tokens_generated == 8  # not 14
    assert state.buffered_tokens() == 8
    batch = state.form_batch(0)
    assert batch is not None and batch.version == 1
    assert batch.stats["tokens_generated"] == 8.0
    assert batch.stats["offpolicy_token_frac"] == 0.5  # 4 tokens of version 0 among 8 model tokens
    assert state.history.recent().tolist() == [7, 7]  # lengths: every response token


def test_a_partial_episodes_lease_budgets_its_observations() -> None:
    state = make_state(Mode.ASYNC, b=1, over=1, n=1, max_new=16)
    [(lease_id, budget, leased)] = state.take_work("w0", 1)
    partial = leased.extend([5], [-0.5], 0, FinishReason.NONE).observed([7, 8, 9])
    assert state.accept_result("w0", lease_id, partial.extend([], [], 0, FinishReason.ABORT)) == 1
    [(_, budget, again)] = state.take_work("w0", 1)
    assert again.response_len == 4 and budget == 12


@pytest.mark.parametrize("moved_on", [False, True], ids=["as-leased", "new-state"])
def test_a_partial_episode_back_with_no_token_is_kept_only_if_its_state_moved_on(moved_on: bool) -> None:
    """A partial returned with nothing new goes back as leased and is no abort; one whose episode state
    changed (a tool step ran and its observation was empty) is an interrupted result like any other:
    requeued as leased, the step would run again."""
    state = make_state(Mode.ASYNC, b=1, over=1, n=1, max_new=16)
    [(lease_id, _, leased)] = state.take_work("w0", 1)
    owed = leased.extend([5], [-0.5], 0, FinishReason.NONE).with_episode(b"tool step owed")
    assert state.accept_result("w0", lease_id, owed.extend([], [], 0, FinishReason.ABORT)) == 1
    aborted = state.totals.aborted
    [(lease_id, _, leased)] = state.take_work("w0", 1)
    back = leased.with_episode(b"tool step done") if moved_on else leased
    assert state.accept_result("w0", lease_id, back.extend([], [], 0, FinishReason.ABORT)) == 0
    [kept] = state.groups[0].samples
    assert kept.episode == (b"tool step done" if moved_on else b"tool step owed")
    assert kept.status == SampleStatus.INTERRUPTED and kept.resumes == int(moved_on)
    assert state.totals.aborted == aborted + moved_on
    state.check_ledger()


def test_each_worker_is_credited_its_model_tokens() -> None:
    core = core_of(Mode.ASYNC, n_samples_per_prompt=2, max_new_tokens=16)
    core.on_hello(hello("w0", 2), 0.0)
    [out] = [d for d in core.tick(0.1) if isinstance(d, LeaseOut)]
    ids = [lease_id for lease_id, _, _ in out.work]
    core.on_samples(
        "w0", ids, [episode(s, 0, 0, r) for (_, _, s), r in zip(out.work, (0.0, 1.0), strict=True)], 2, 0.2
    )
    assert core.workers.peers["w0"].tokens_generated == 8
    assert core.run_totals()["tokens_generated"] == core.run_totals()["buffered_tokens"] == 8


def test_an_evaluation_counts_model_tokens() -> None:
    source = SyntheticPromptSource(size=40, seed=0, prompt_len_min=3, prompt_len_max=5)
    _, held = split_held_out(source, 2)
    evals = Evaluations(held, every=1, final_version=3, max_new_tokens=16)
    evals.on_version(1)
    ids = count(100)
    for lease_id, _, leased in evals.take_work("w0", 2, new_lease_id=lambda: next(ids)):
        assert evals.accept_result("w0", lease_id, episode(leased, 1, 1), broker_version=1) == 4
    assert evals.tokens_generated == 8 and evals.completed == 1
    assert np.isclose(evals.latest.accuracy if evals.latest else 0.0, 1.0)
