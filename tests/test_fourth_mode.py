"""A fourth scheduling mode is this one file: a `ModePolicy` put into `broker.modes.MODES` under its name
and chosen by `run.mode`, run through the broker core and `april simulate` with no other file edited.

The mode, `uninterrupted`, is async without the abort on a new weight version: samples keep generating
under the weights they started with (AReaL's non-interruptible generation). The config's `run.mode` lists
the names a user may choose, so the test builds its config past that check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import pytest
from sim_setup import sim_config

from april import protocol
from april.config import AlgoConfig, Config, Mode, RunConfig
from april.data import SyntheticPromptSource
from april.sim.engine_cost import EngineCost
from broker import modes
from broker.core import BrokerCore
from broker.decisions import Send
from broker.modes.asynchronous import Async
from broker.sim.model import SimResult, simulate
from broker.state import BrokerState

NAME = "uninterrupted"


class Uninterrupted(Async):
    """async's admission bound and batch rule; a new weight version aborts nothing."""

    name: ClassVar[str] = NAME
    abort_on_new_version: ClassVar[bool] = False


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(modes.MODES, NAME, Uninterrupted())
    yield


class Pattern:
    """Lengths repeating `pattern` in sample order (group g, index i: pattern[(g * n + i) % len])."""

    def __init__(self, *pattern: int) -> None:
        self.pattern = np.asarray(pattern, dtype=np.int64)

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        return np.resize(self.pattern, n)


def run(mode: str) -> SimResult:
    """b 1, n 2, eta 1, one engine of 4 slots, 1 ms a step: group 0 finishes at 10 ms (v1 is published
    then), group 1 runs 100 tokens."""
    algo = AlgoConfig(
        rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=2, max_staleness=1
    )
    cfg = sim_config(
        mode,  # type: ignore[arg-type]
        algo,
        engines=1,
        slots=4,
        cost=EngineCost(1.0, 0.0, 0.0),
        learner_step_s=0.0,
        steps=3,
        prompt_len=10,
        check_ledger_every_event=True,
    )
    return simulate(cfg, Pattern(10, 10, 100, 100))


def test_the_simulator_runs_a_mode_it_was_never_told_of() -> None:
    asyn, new = run(Mode.ASYNC), run(NAME)
    for r in (asyn, new):
        assert r.ledger.balanced and r.ledger.trained == 3 and r.figures.wasted_tokens == 0
    assert asyn.abort_rounds >= 1 and asyn.figures.aborted > 0  # async interrupts group 1 at v1
    assert (new.abort_rounds, new.figures.aborted, new.figures.resumed) == (0, 0, 0)
    # Why async aborts: the books learn a sample's versions only when it comes back, so group 1, running
    # on under v0, is not known to be due at v1; group 2 (issued at v1) trains first, group 1 at v2.
    assert [s.groups for s in asyn.steps] == [(0,), (1,), (2,)]
    assert [s.groups for s in new.steps] == [(0,), (2,), (1,)]
    assert [s.staleness_max for s in new.steps] == [0, 0, 2]


def test_the_core_welcomes_workers_to_the_new_mode_and_aborts_nothing_on_new_weights() -> None:
    algo = AlgoConfig(rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=2)
    config = Config(run=RunConfig(mode=NAME), algo=algo)  # type: ignore[arg-type]
    core = BrokerCore(config, BrokerState(NAME, algo, SyntheticPromptSource(50)), (), 0.0)
    out = core.on_hello(protocol.WorkerHello("w0", "sim", 4, 0, 1, "node", np.zeros(0, np.int64)), 0.0)
    (welcome,) = (d.message for d in out if isinstance(d, Send))
    assert isinstance(welcome, protocol.Welcome) and welcome.mode == NAME
    assert core.tick(0.0) and core.state.leased_samples == 4
    out = core.on_weights(1, "file:///v1", "0" * 64, 1.0)
    assert [type(d.message) for d in out if isinstance(d, Send)] == [protocol.WeightsReady]
    assert core.abort is None


def test_an_unknown_mode_is_named_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^run\.mode = 'fast': expected one of 'sync', 'april', 'async', "):
        modes.policy_for("fast")
