"""Slot utilisation and bubble: the worker's meter (actors.slot_meter) and the broker's split of its
reports over rollout phases (broker.usage), against hand-computed integrals."""

from __future__ import annotations

import math

import pytest

from actors.slot_meter import SlotMeter
from april.config import WorkerConfig
from april.protocol import EngineUsage
from broker.usage import SlotUsage

BUSY_REPORT_S = WorkerConfig().usage_report_s  # the default report period while sequences run


def test_the_meter_integrates_the_count_held_since_the_last_observation() -> None:
    m = SlotMeter(slots=4, now=0.0, busy_period_s=BUSY_REPORT_S)
    m.observe(1.0, 4)  # idle for 1 s, then 4 running
    m.observe(3.0, 1)  # 4 running for 2 s, then 1
    r = m.report(4.0)  # 1 running for 1 s
    assert (r.busy_slot_s, r.slot_s, r.free_slot_s, r.elapsed_s) == pytest.approx((9.0, 16.0, 2.0, 4.0))


def test_a_longer_busy_period_reports_less_often_while_busy_and_still_at_once_on_going_idle() -> None:
    """worker.usage_report_s: fewer messages from a generating worker; reports are cumulative: none lost."""
    m = SlotMeter(slots=2, now=0.0, busy_period_s=1.0)
    m.observe(0.0, 2)
    assert not m.due(0.5, idle_period_s=5.0) and not m.due(0.99, idle_period_s=5.0)
    assert m.due(1.0, idle_period_s=5.0)
    m.report(1.0)
    m.observe(1.1, 0)
    assert m.due(1.1, idle_period_s=5.0)
    r = m.report(1.1)
    assert (r.busy_slot_s, r.slot_s) == pytest.approx((2.2, 2.2))


def test_reports_are_due_often_while_busy_at_once_on_going_idle_and_rarely_while_idle() -> None:
    m = SlotMeter(slots=2, now=0.0, busy_period_s=BUSY_REPORT_S)
    assert not m.due(0.5, idle_period_s=1.0)
    assert m.due(1.0, idle_period_s=1.0)
    m.report(1.0)
    m.observe(1.0, 2)
    assert not m.due(1.0 + BUSY_REPORT_S / 2, idle_period_s=1.0)
    assert m.due(1.0 + BUSY_REPORT_S, idle_period_s=1.0)
    m.report(1.2)
    m.observe(1.25, 0)  # went idle: report now, not a second later
    assert m.due(1.25, idle_period_s=1.0)
    m.report(1.25)
    assert not m.due(1.3, idle_period_s=1.0)


def usage(busy: float, slots: float, free: float, elapsed: float) -> EngineUsage:
    return EngineUsage(busy, slots, free, elapsed)


def test_nothing_counts_before_the_first_lease_and_reports_split_over_phases() -> None:
    u = SlotUsage(now=0.0)
    u.report("w", usage(0.0, 8.0, 1.0, 1.0), now=1.0)  # before generation: a baseline only
    u.start(2.0)
    # [1, 3]: half of it after the start; 8 slots, 4 busy throughout
    u.report("w", usage(8.0, 24.0, 3.0, 3.0), now=3.0)
    u.set_phase(4.0, False)  # batch formed at t=4; learner trains until 5
    u.set_phase(5.0, True)
    u.report("w", usage(16.0, 40.0, 5.0, 5.0), now=5.0)  # [3, 5]: half of it in phase
    stats = u.take_window()
    # busy in phase: 4 x 1 (from [1,3]) + 8 x 0.5 (from [3,5]); slot-s in phase: 8 x 1 + 16 x 0.5
    assert stats["busy_phase_slot_s"] == pytest.approx(4.0 + 4.0)
    assert stats["phase_slot_s"] == pytest.approx(8.0 + 8.0)
    assert stats["slot_utilization"] == pytest.approx(0.5)
    assert stats["engine_s"] == pytest.approx(1.0 + 2.0)
    assert stats["bubble_frac"] == pytest.approx((1.0 + 2.0) / 3.0)
    empty = u.take_window()
    assert math.isnan(empty["slot_utilization"]) and math.isnan(empty["bubble_frac"])
    assert u.total.engine_s == pytest.approx(3.0)


def test_a_restarted_worker_process_starts_a_new_baseline() -> None:
    u = SlotUsage(now=0.0)
    u.start(0.0)
    u.report("w", usage(4.0, 8.0, 0.0, 1.0), now=1.0)
    u.report("w", usage(2.0, 4.0, 0.0, 0.5), now=2.0)  # counters went back: a new process, 0.5 s old
    assert u.total.busy_phase_slot_s == pytest.approx(4.0 + 2.0)
    assert u.total.engine_s == pytest.approx(1.0 + 0.5)


def test_nothing_counts_after_the_run_stopped() -> None:
    u = SlotUsage(now=0.0)
    u.start(0.0)
    u.stop(1.0)  # the last step was trained at t=1
    u.set_phase(1.5, True)  # a round opening after the end changes nothing
    u.report("w", usage(4.0, 8.0, 2.0, 2.0), now=2.0)  # [0, 2]: half of it in the run
    assert u.total.busy_phase_slot_s == pytest.approx(2.0)
    assert u.total.engine_s == pytest.approx(1.0)


def test_a_cost_modelled_engine_reports_its_reprefill_and_stale_kv_counters() -> None:
    """The sim engine's own counters ride on EngineUsage; the broker differences them like the rest, over
    the run (after the first lease); an engine without a cost model reports zeros."""
    from actors.engines.sim_engine import SimEngine

    engine = SimEngine("fixed:4", slots=2, sleep=False)
    engine.elapsed_s, engine.reprefill_s, engine.stale_kv_tokens = 2.0, 0.5, 7
    m = SlotMeter(slots=2, now=0.0, busy_period_s=BUSY_REPORT_S)
    r = m.report(1.0, engine)
    assert (r.model_busy_s, r.reprefill_s, r.stale_kv_tokens) == (2.0, 0.5, 7)
    assert (m.report(1.0, object()).model_busy_s, m.report(1.0).reprefill_s) == (0.0, 0.0)
    u = SlotUsage(now=0.0)
    u.report("w", r, now=1.0)  # before generation: a baseline only
    u.start(1.0)
    later = EngineUsage(0.0, 4.0, 2.0, 2.0, model_busy_s=6.0, reprefill_s=1.5, stale_kv_tokens=10)
    u.report("w", later, now=2.0)
    stats = u.take_window()
    assert (stats["model_busy_s"], stats["reprefill_s"], stats["stale_kv_tokens"]) == (4.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="reprefill_s"):
        EngineUsage(0.0, 1.0, 0.0, 1.0, model_busy_s=1.0, reprefill_s=2.0).validate()
