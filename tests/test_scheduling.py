"""Scheduling beyond the paper's fixed setting (issue 17): the length history, the prompt order drawn from
it, `over_sampling = "auto"` (broker/round_plan.py) and prompt-correlated simulated lengths
(april/sim/sample_draw.py `LengthDraw`), driven directly and through the broker's books and the simulator."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from sim_setup import sim_config

from actors.engine import GenerationRequest
from actors.engines.sim_engine import SampleIdentity, SimEngine
from actors.lengths import LengthSpec
from april.config import AlgoConfig, ConfigError, Mode, OverSampling, PromptOrder, load_config
from april.records import new_group_samples
from april.sim.sample_draw import LengthDraw, draw_length, prompt_key, sample_key
from broker import length_history, policy, snapshot
from broker.length_history import RECENT, LengthHistory
from broker.round_plan import (
    MIN_OBSERVED,
    CarriedGroup,
    candidate_targets,
    plan_round_target,
    predict_round_steps,
)
from broker.sim.model import WAIT_CAUSES, SampleLengths, Simulation, simulate
from broker.state import BrokerState
from tests.test_broker_state import Driver, assert_same_books, source

LONG_TAIL = LengthSpec.parse(
    "mixture:0.8*lognormal:median=300,sigma=0.7,cap=2000+0.2*lognormal:median=900,sigma=0.6,cap=2000"
)

# ------------------------------------------------------------------------------------------ length history


def test_the_history_predicts_a_prompts_geometric_moving_average() -> None:
    h = LengthHistory()
    assert h.predict(7) is None and h.seen(7) == 0
    h.record(7, 100)
    assert h.predict(7) == pytest.approx(100)
    h.record(7, 400)  # EMA of logs with weight 1/2: sqrt(100 x 400)
    assert h.predict(7) == pytest.approx(200)
    h.record(3, 0)  # an empty response counts as length 1 (log scale), not as a crash
    assert h.predict(3) == pytest.approx(1) and h.seen(7) == 2 and len(h) == 2
    assert h.recent().tolist() == [100, 400, 0]


def test_the_recent_lengths_are_bounded_and_the_history_round_trips() -> None:
    h = LengthHistory()
    for i in range(RECENT + 10):
        h.record(i % 5, i)
    assert h.recent().shape == (RECENT,) and int(h.recent()[0]) == 10
    back = LengthHistory.from_wire(h.to_wire())
    assert back.recent().tolist() == h.recent().tolist()
    assert all(back.predict(p) == h.predict(p) and back.seen(p) == h.seen(p) for p in range(5))
    short = LengthHistory()  # restored from fewer than RECENT, then filled past RECENT: the same window
    for i in range(3):
        short.record(0, i)
    short = LengthHistory.from_wire(short.to_wire())
    for history in (h, back, short):
        for i in range(RECENT):
            history.record(1, 7 * i)
    assert h.recent().tolist() == back.recent().tolist() == short.recent().tolist()
    assert h.recent().tolist() == [7 * i for i in range(RECENT)]
    wire = h.to_wire()
    with pytest.raises(ValueError, match="length history"):
        LengthHistory.from_wire(dataclasses.replace(wire, seen=wire.seen[:2]))


def test_the_history_on_the_wire_pairs_each_prompt_with_its_own_average_and_count() -> None:
    """The wire holds every prompt index up to the largest seen, with its own average and count (0: never
    seen); a restored history predicts, counts and goes on recording as the original does."""
    h = LengthHistory()
    for prompt, length in [(1, 10), (2, 20), (5, 30), (1, 40), (9, 50), (-1, 60)]:
        h.record(prompt, length)
    wire = h.to_wire()
    assert wire.prompts.tolist() == list(range(10))
    assert wire.seen.tolist() == [h.seen(p) for p in range(10)] == [0, 2, 1, 0, 0, 1, 0, 0, 0, 1]
    seen = wire.seen > 0
    assert np.exp(wire.log_mean[seen]).tolist() == pytest.approx([h.predict(p) for p in (1, 2, 5, 9)])
    assert len(h) == 4 and h.predict(-1) is None and h.seen(-1) == 0  # an unknown position: recent only
    assert h.recent().tolist() == [10, 20, 30, 40, 50, 60]
    back = LengthHistory.from_wire(wire)
    assert len(back) == 4 and all(back.predict(p) == h.predict(p) for p in range(12))
    for history in (back, h):
        history.record(2, 80)
        history.record(20, 5)
    assert back.to_wire().seen.tolist() == h.to_wire().seen.tolist()
    assert back.to_wire().log_mean.tolist() == h.to_wire().log_mean.tolist()


def test_a_history_saved_by_an_older_broker_is_restored() -> None:
    """Older snapshots hold only the prompts seen, in recency order: each keeps its own average and count;
    a wire naming a prompt twice or a negative one is refused."""
    wire = length_history.HistoryWire(
        prompts=np.array([7, 2, 4], dtype=np.int64),
        log_mean=np.log(np.array([70.0, 20.0, 40.0])),
        seen=np.array([3, 1, 2], dtype=np.int64),
        recent=np.array([20, 40, 70], dtype=np.int64),
    )
    h = LengthHistory.from_wire(wire)
    assert len(h) == 3 and [h.seen(p) for p in (7, 2, 4, 3)] == [3, 1, 2, 0]
    assert [h.predict(p) for p in (7, 2, 4)] == pytest.approx([70.0, 20.0, 40.0]) and h.predict(3) is None
    assert h.recent().tolist() == [20, 40, 70]
    for bad in (np.array([7, 2, 7]), np.array([7, -2, 4])):
        with pytest.raises(ValueError, match="length history"):
            LengthHistory.from_wire(dataclasses.replace(wire, prompts=bad.astype(np.int64)))


# ------------------------------------------------------------------------------------------- prompt order


def test_pick_prompt_follows_the_order_and_never_delays_a_prompt_past_its_window() -> None:
    waiting = [(0, 500.0), (1, None), (2, 100.0), (3, 900.0)]  # (issued when drawn, predicted length)
    assert policy.pick_prompt(waiting, 4, PromptOrder.ISSUE, 64) == 0
    assert policy.pick_prompt(waiting, 4, PromptOrder.SHORTEST_FIRST, 64) == 2
    assert policy.pick_prompt(waiting, 4, PromptOrder.LONGEST_FIRST, 64) == 3
    # a prompt never seen counts as the median of those seen (500): between 100 and 900
    assert policy.pick_prompt([(0, 900.0), (1, None), (2, 100.0)], 3, PromptOrder.LONGEST_FIRST, 64) == 0
    assert policy.pick_prompt([(0, 900.0), (1, None)], 2, PromptOrder.SHORTEST_FIRST, 64) == 0  # tie: first
    # the oldest drawn prompt has waited a whole window: it goes first, whatever its prediction
    assert policy.pick_prompt(waiting, 64, PromptOrder.SHORTEST_FIRST, 64) == 0


def _run_with_order(order: PromptOrder, window: int, lengths: dict[int, int], steps: int) -> BrokerState:
    """april rounds on the broker's books, each sample of a prompt as long as `lengths` says."""
    algo = AlgoConfig(
        rollout_batch_size=2,
        over_sampling_batch_size=4,
        n_samples_per_prompt=2,
        max_new_tokens=64,
        prompt_order=order,
        prompt_window=window,
    )
    state = BrokerState(Mode.APRIL, algo, source())
    d = Driver(state)
    for step in range(steps):
        for lease_id, _, sample in d.take():
            d.finish(lease_id, tokens=lengths[state.groups[sample.group_id].prompt_index])
        d.end_round()
        d.train(step)
    return state


def test_shortest_first_issues_every_prompt_of_the_window_and_learns_their_lengths() -> None:
    lengths = {i: 1 + (i * 7) % 60 for i in range(500)}
    issue = _run_with_order(PromptOrder.ISSUE, 8, lengths, 40)
    short = _run_with_order(PromptOrder.SHORTEST_FIRST, 8, lengths, 40)
    assert issue.waiting == [] and len(short.waiting) == 8 - 1  # topped up to the window, then one issued
    # each prompt's group was issued from its own cursor, at most a window after its turn
    for state in (issue, short):
        for g in state.groups.values():
            assert source().get(g.cursor).prompt_index == g.prompt_index
    issued = short.issued
    drawn = issued + len(short.waiting)
    assert short.cursor == drawn  # every prompt drawn is issued or waiting: none skipped, none twice
    assert {w.cursor for w in short.waiting} <= set(range(drawn - 2 * 8, drawn))
    assert short.history.predict(short.groups[max(short.groups)].prompt_index) is not None


def test_the_prompt_window_and_the_history_survive_a_snapshot(tmp_path: Path) -> None:
    lengths = {i: 1 + (i * 13) % 50 for i in range(500)}
    old = _run_with_order(PromptOrder.SHORTEST_FIRST, 6, lengths, 7)
    d = Driver(old)
    d.take(credit=3)  # something leased, something queued
    snapshot.write(snapshot.capture(old), tmp_path)
    new = snapshot.restore(snapshot.read(tmp_path), old.mode, old.algo, source())
    assert_same_books(old, new)
    assert new.waiting == old.waiting
    assert {g: e.cursor for g, e in new.groups.items()} == {g: e.cursor for g, e in old.groups.items()}
    assert {g: e.prompt_index for g, e in new.groups.items()} == {
        g: e.prompt_index for g, e in old.groups.items()
    }
    assert new.history.recent().tolist() == old.history.recent().tolist()
    assert new.planned_target is None  # fixed over-sampling plans nothing
    assert [new._next_prompt()[0] for _ in range(5)] == [old._next_prompt()[0] for _ in range(5)]


# ------------------------------------------------------------------------------------------- round plan


def test_candidate_targets_span_the_batch_to_the_cap() -> None:
    assert candidate_targets(32, 32) == [32]
    c = candidate_targets(32, 128)
    assert c[0] == 32 and c[-1] == 128 and c == sorted(set(c)) and len(c) <= 9


def test_a_replayed_round_lasts_until_the_needed_groups_finish() -> None:
    rng = np.random.default_rng(0)
    fixed = np.full(100, 10, dtype=np.int64)
    # 2 groups x 2 samples of 10 tokens on 2 slots: the first group at 10 steps, the second at 20
    assert predict_round_steps([], 2, 2, 1, 2, fixed, rng) == 10
    assert predict_round_steps([], 2, 2, 2, 2, fixed, rng) == 20
    # a carried group with 7 of its 10 tokens done needs 3 more; its partner sample none (it finished)
    assert predict_round_steps([CarriedGroup((7,))], 1, 2, 1, 4, fixed, rng) == 3
    assert predict_round_steps([], 1, 2, 2, 4, fixed, rng) == float("inf")  # fewer groups than needed
    assert predict_round_steps([], 3, 2, 0, 4, fixed, rng) == 0


def test_the_plan_keeps_the_cap_until_lengths_are_seen_then_stops_at_the_knee() -> None:
    few = np.full(MIN_OBSERVED - 1, 100, dtype=np.int64)
    assert plan_round_target(32, 128, 0, [], 8, 512, few, seed=0) == 128
    # equal lengths: any target finishes the round at the same step, so the batch itself is enough
    equal = np.full(1000, 100, dtype=np.int64)
    assert plan_round_target(32, 128, 0, [], 8, 4096, equal, seed=0) == 32
    # a long tail with room in the slots: more groups in flight end the round sooner
    tail = np.asarray(LONG_TAIL.sample(np.random.default_rng(1), 4000), dtype=np.int64)
    roomy = plan_round_target(32, 128, 0, [], 8, 4096, tail, seed=0)
    assert 32 < roomy <= 128
    # one slot per sample of a batch: extra groups only queue behind it, so they do not help
    assert plan_round_target(32, 128, 0, [], 8, 8, tail, seed=0) < roomy
    # deterministic for a seed; and it never goes below the live groups
    assert plan_round_target(32, 128, 0, [], 8, 4096, tail, seed=0) == roomy
    carried = [CarriedGroup((50,))] * 100
    assert plan_round_target(32, 64, 0, carried, 8, 4096, tail, seed=3) >= 100


def test_auto_over_sampling_in_the_simulator_plans_each_round_within_bounds() -> None:
    algo = AlgoConfig(
        rollout_batch_size=8,
        over_sampling_batch_size=32,
        n_samples_per_prompt=4,
        max_new_tokens=2000,
        over_sampling=OverSampling.AUTO,
    )
    sim = Simulation(
        sim_config(Mode.APRIL, algo, engines=2, slots=32, steps=12, check_ledger_every_event=True), LONG_TAIL
    )
    plans: list[int | None] = []
    plan = sim.core.state.plan_round

    def record(slots: int, seed: int) -> None:
        assert slots == 64
        plan(slots, seed)
        plans.append(sim.core.state.planned_target)

    sim.core.state.plan_round = record  # type: ignore[method-assign]
    result = sim.run()
    assert result.ledger.trained == 12 * 8 and result.figures.wasted_tokens == 0
    assert len(plans) == 12 and all(p is not None and 8 <= p <= 32 for p in plans)
    assert len(set(plans)) > 1  # planned from what each round saw, not a constant


def test_a_fixed_over_sampling_plans_nothing() -> None:
    state = BrokerState(Mode.APRIL, AlgoConfig(), source())
    state.plan_round(64, seed=0)
    assert state.planned_target is None
    sync = BrokerState(Mode.SYNC, AlgoConfig(over_sampling=OverSampling.AUTO), source())
    sync.plan_round(64, seed=0)
    assert sync.planned_target is None


def test_the_new_options_are_config_fields_with_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[algo]\nover_sampling = "auto"\nprompt_order = "shortest_first"\nprompt_window = 16\n')
    cfg = load_config(path)
    assert cfg.algo.over_sampling == OverSampling.AUTO and cfg.algo.prompt_order == PromptOrder.SHORTEST_FIRST
    path.write_text('[algo]\nover_sampling = "sometimes"\n')
    with pytest.raises(ConfigError, match="over_sampling"):
        load_config(path)
    path.write_text("[algo]\nprompt_window = 0\n")
    with pytest.raises(ConfigError, match="prompt_window"):
        load_config(path)
    path.write_text("[worker]\nsim_prompt_corr = 1.0\n")
    with pytest.raises(ConfigError, match="sim_prompt_corr"):
        load_config(path)


# ------------------------------------------------------------------------------ prompt-correlated lengths


def test_without_correlation_the_draw_is_the_independent_one() -> None:
    draw = LengthDraw(LONG_TAIL, seed=5)
    assert [draw(sample_key(g, 0), 123) for g in range(20)] == [
        draw_length(LONG_TAIL, 5, sample_key(g, 0)) for g in range(20)
    ]
    with pytest.raises(ValueError, match="prompt_corr"):
        LengthDraw(LONG_TAIL, 0, prompt_corr=1.0)


def test_correlated_lengths_keep_the_distribution_and_follow_their_prompt() -> None:
    draw = LengthDraw(LONG_TAIL, seed=0, prompt_corr=0.8)
    prompts = 400
    first = np.array([draw(sample_key(p, 0), p) for p in range(prompts)])
    second = np.array(
        [draw(sample_key(p + prompts, 1), p) for p in range(prompts)]
    )  # same prompt, later epoch
    other = np.array([draw(sample_key(p, 2), p + 10_000) for p in range(prompts)])
    reference = np.asarray(LONG_TAIL.sample(np.random.default_rng(9), 20_000))
    for q in (0.1, 0.5, 0.9):  # the spec's quantiles, within sampling error
        assert np.quantile(first, q) == pytest.approx(np.quantile(reference, q), rel=0.2)

    def rank_corr(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])

    assert rank_corr(first, second) > 0.4  # latent correlation 0.64
    assert abs(rank_corr(first, other)) < 0.2


def test_the_sim_engine_and_the_simulator_draw_the_same_correlated_lengths() -> None:
    prompt_ids = source().get(3).prompt_ids
    samples = new_group_samples(9, 4, prompt_ids, "", {})
    engine = SimEngine(
        LONG_TAIL,
        slots=8,
        seed=4,
        sleep=False,
        prompt_corr=0.7,
        identify=lambda r: SampleIdentity.of_sample(9, r.request_id, len(prompt_ids), prompt_key(prompt_ids)),
    )
    simulator = SampleLengths(LONG_TAIL, 4, prompt_corr=0.7)
    engine.add([GenerationRequest(s.index, prompt_ids, 4000) for s in samples])
    drawn = {r.identity.key: r.drawn_len for r in engine._running.values()}
    assert drawn == {sample_key(9, s.index): simulator(s) for s in samples}


def test_a_simulated_dataset_recurs_and_its_prompts_keep_their_lengths() -> None:
    algo = AlgoConfig(
        rollout_batch_size=4, over_sampling_batch_size=8, n_samples_per_prompt=2, max_new_tokens=2000
    )
    cfg = sim_config(
        Mode.SYNC,
        algo,
        engines=1,
        slots=16,
        steps=6,
        dataset_size=8,
        prompt_corr=0.9,
        per_sample_lengths=True,
    )
    sim = Simulation(cfg, LONG_TAIL)
    sim.run()
    seen = Counter(g.prompt_index for g in sim.core.state.groups.values())
    assert set(seen) <= set(range(8))
    h = sim.core.state.history
    assert len(h) == 8 and all(h.seen(p) >= 2 for p in range(8))  # 24 groups over an 8-prompt dataset
    with pytest.raises(ConfigError, match=r"worker\.sim_prompt_corr"):
        sim_config(Mode.SYNC, algo, prompt_corr=1.5)


def test_every_prompt_order_runs_the_simulator_to_a_balanced_ledger() -> None:
    for order in PromptOrder:
        algo = AlgoConfig(
            rollout_batch_size=4,
            over_sampling_batch_size=8,
            n_samples_per_prompt=2,
            max_new_tokens=2000,
            prompt_order=order,
            prompt_window=8,
        )
        for mode in Mode:
            cfg = sim_config(mode, algo, engines=1, slots=8, steps=5, dataset_size=16, prompt_corr=0.5)
            result = simulate(cfg, LONG_TAIL)
            assert result.ledger.trained == 20 and result.figures.wasted_tokens == 0


def test_the_learners_wait_is_split_by_what_held_its_batch() -> None:
    algo = AlgoConfig(
        rollout_batch_size=4, over_sampling_batch_size=8, n_samples_per_prompt=4, max_new_tokens=2000
    )
    for mode in Mode:
        result = simulate(sim_config(mode, algo, engines=2, slots=16, steps=8), LONG_TAIL)
        assert set(result.waits) == set(WAIT_CAUSES)
        assert sum(result.waits.values()) == pytest.approx(result.figures.rollout_s)
        if (
            mode != Mode.ASYNC
        ):  # rounds: only generation holds a batch (no admission bound, no staleness rule)
            assert result.waits["admission"] == result.waits["staleness"] == 0 < result.waits["generation"]
        else:  # a long tail against a bound of (1 + 1) batches: the bound is what holds async
            assert result.waits["admission"] > 0


def test_a_planned_round_target_survives_a_snapshot(tmp_path: Path) -> None:
    algo = AlgoConfig(
        rollout_batch_size=2,
        over_sampling_batch_size=8,
        n_samples_per_prompt=2,
        max_new_tokens=64,
        over_sampling=OverSampling.AUTO,
    )
    state = BrokerState(Mode.APRIL, algo, source())
    for i in range(MIN_OBSERVED):
        state.history.record(i, 5 + (i * 37) % 60)
    state.plan_round(slots=64, seed=1)
    assert state.planned_target is not None and 2 <= state.planned_target <= 8
    snapshot.write(snapshot.capture(state), tmp_path)
    new = snapshot.restore(snapshot.read(tmp_path), state.mode, state.algo, source())
    assert new.planned_target == state.planned_target
    assert new.leasable_samples() == state.leasable_samples()  # the same round target, so the same work


def test_prompts_drawn_ahead_go_first_in_draw_order_once_the_order_is_issue_again() -> None:
    """A run restarted with `prompt_order = "issue"` after drawing ahead under another order: the drawn
    prompts are issued first, in the order drawn, and nothing more is drawn ahead."""
    lengths = {i: 1 + (i * 7) % 60 for i in range(500)}
    state = _run_with_order(PromptOrder.SHORTEST_FIRST, 8, lengths, 3)
    drawn = [w.cursor for w in state.waiting]
    assert len(drawn) == 7
    state.algo = dataclasses.replace(state.algo, prompt_order=PromptOrder.ISSUE)
    cursor = state.cursor
    assert [state._next_prompt()[0] for _ in range(9)] == [*drawn, cursor, cursor + 1]
    assert state.waiting == [] and state.cursor == cursor + 2
