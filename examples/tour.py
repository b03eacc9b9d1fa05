"""A tour of april in one process: the broker core, a worker on the torch engine, one learner step.

Read this first. In a run these are separate processes speaking `april.protocol` over ZeroMQ (docs/
design.md); here the same messages and the broker core's decisions are handed from one object to the
next, in the order the processes would see them. No sockets, no child processes, models/tiny on the CPU:
`python -m examples.tour` from the checkout (tests/test_tour.py keeps it working).

1. The broker core (`broker/core.py`) takes events with their time and returns decisions: leases, an
   abort, the batch for the learner. `broker/server.py` drives the same core from sockets.
2. The worker: there is no separate worker core yet. `actors/worker.py`'s loop owns its sockets, so the
   `TourWorker` below does the loop's job with the worker's own pieces: the tokenizer, the torch engine,
   `apply_output`, the reward function (scored here in-process; a worker scores in a killable child,
   `actors/reward_runner.py`). In mode april a formed batch aborts what is still generating: those
   samples go back as partials and resume later, as any worker leases them again.
3. The learner: one step on the batch (`learner/step.py`), the new weights published as a file and
   loaded by the worker's engine as version 1 (`learner/loop.py` does this for every step).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from actors.engine import GenerationRequest, SamplingParams
from actors.engines.torch_engine import TorchEngine
from actors.tokenizer import HFTokenizer
from actors.worker import apply_output
from april import protocol
from april.config import load_config
from april.hf import load_model
from april.records import Sample
from april.sources import open_source
from april.weights_uri import WeightsLocation
from broker.core import BrokerCore
from broker.decisions import BatchFormed, Decision, LeaseOut, Send, Work
from broker.state import BrokerState, PendingBatch
from learner.batching import build_train_batch
from learner.engine import TrainEngine, TrainSettings
from learner.losses import LossConfig
from learner.step import train_step
from learner.weights import publish

MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny"
SETTINGS = {  # a run small enough for a CPU: 2 prompts of 2 samples a batch, 24 tokens each
    "run.mode": "april", "algo.rollout_batch_size": 2, "algo.over_sampling_batch_size": 3,
    "algo.n_samples_per_prompt": 2, "algo.max_new_tokens": 24, "data.source": "task",
    "worker.model": str(MODEL), "learner.backend": "torch", "learner.lr": 1e-4,
}  # fmt: skip


def digit_share(response: str, answer: str, metadata: dict[str, str]) -> float:
    """A reward, as `worker.reward = "module:function"` names one: the share of digits in the response.
    A random tiny model never earns the built-in "exact" reward, and equal rewards teach nothing."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


class TourWorker:
    """What `actors.worker.Worker` does with a lease, an engine step and an abort, minus the sockets."""

    def __init__(self, welcome: protocol.Welcome, slots: int, seed: int) -> None:
        self.tokenizer = HFTokenizer(MODEL)
        sampling = SamplingParams(welcome.temperature, welcome.top_p, welcome.top_k,
                                  self.tokenizer.eos_token_ids, seed)  # fmt: skip
        self.engine = TorchEngine(MODEL, slots, sampling)
        self.held: dict[int, Sample] = {}  # lease id -> the sample as leased, while the engine has it

    def on_lease(self, work: Work) -> None:
        for lease_id, budget, sample in work:  # a text prompt is tokenized once; a partial resumes
            if sample.prompt_ids.shape[0] == 0:
                ids = self.tokenizer.encode_prompt(sample.prompt_text, sample.metadata)
                sample = dataclasses.replace(sample, prompt_ids=ids)
            self.held[lease_id] = sample
            self.engine.add([GenerationRequest(lease_id, sample.resume_input(), budget)])

    def step(self) -> list[tuple[int, Sample]]:
        """One engine step; the samples that finished, scored."""
        done = []
        for out in self.engine.step():
            sample = apply_output(self.held.pop(out.request_id), out)
            text = self.tokenizer.decode(sample.response_ids)
            value = digit_share(text, sample.metadata.get("answer", ""), sample.metadata)
            done.append((out.request_id, sample.scored(value)))
        return done

    def abort(self) -> list[tuple[int, Sample]]:
        """Everything generating goes back unfinished (INTERRUPTED), with the tokens it has so far."""
        return [
            (out.request_id, apply_output(self.held.pop(out.request_id), out)) for out in self.engine.abort()
        ]


def tour(workdir: Path) -> dict[str, float]:
    """Run the tour; returns the learner step's figures (and what the worker served after)."""
    config = load_config(overrides=SETTINGS)
    clock = time.monotonic  # every event reaches the core with its time

    # 1. The broker core: its books over the run's prompt source, no held-out prompts, no sockets. No
    # liveness either: in one process the worker cannot fall silent (a server's core counts heartbeats).
    source = open_source(config.data, config.run.seed, config.env)
    core = BrokerCore(config, BrokerState(config.run.mode, config.algo, source), (), clock(), liveness=False)

    # 2. A worker says hello (its engine, its slots, version 0 loaded) and gets the run's sampling settings.
    slots = 4
    hello = protocol.WorkerHello("worker-0", "torch", slots, 0, os.getpid(), "tour", np.zeros(0, np.int64))
    todo: list[Decision] = core.on_hello(hello, clock())
    welcome = next(d.message for d in todo if isinstance(d, Send) and isinstance(d.message, protocol.Welcome))
    worker = TourWorker(welcome, slots, config.run.seed)
    todo += core.on_learner_hello("learner") + core.on_batch_request(0, -1, clock())  # the learner waits

    # The loop both processes run: carry out the core's decisions, step the engine, report back.
    batch: PendingBatch | None = None
    abort_round: int | None = None
    while batch is None or abort_round is not None:
        for d in todo:
            if isinstance(d, LeaseOut):
                worker.on_lease(d.work)
            elif isinstance(d, Send) and isinstance(d.message, protocol.Abort):
                abort_round = d.message.round_id
            elif isinstance(d, BatchFormed):
                batch = d.batch
        if abort_round is not None:  # april: the batch is formed, the rest goes back as partials
            back = worker.abort()
            todo = core.on_samples("worker-0", [i for i, _ in back], [s for _, s in back], 0, clock())
            todo += core.on_abort_done("worker-0", abort_round, slots, (), clock())
            abort_round = None
        elif done := worker.step():  # finished samples come back with the slots they free (credit)
            todo = core.on_samples("worker-0", [i for i, _ in done], [s for _, s in done], len(done), clock())
        else:
            todo = []
        todo += core.tick(clock())
    assert batch is not None

    # 3. The learner: one step on exactly rollout_batch_size complete groups, then weights version 1.
    learner = TrainEngine(load_model(MODEL), TrainSettings.of(config.learner, "cpu"))
    n = config.algo.n_samples_per_prompt
    figures = train_step(
        learner, build_train_batch(batch.samples, n_samples_per_prompt=n), LossConfig.from_algo(config.algo),
        version=batch.version, temperature=config.algo.temperature, group_size=n,
    )  # fmt: skip
    path, sha256 = publish(learner.state_dict_for_publish(), workdir / "weights", version=1)
    todo = core.on_weights(1, WeightsLocation(1, path=str(path)).uri(), sha256, clock())
    todo += core.on_ack(batch.batch_id, clock(), figures)
    for d in todo:  # the worker loads the relayed version between engine steps, and says so
        if isinstance(d, Send) and isinstance(d.message, protocol.WeightsReady):
            worker.engine.load_weights(path, d.message.version)
            core.on_weights_loaded("worker-0", protocol.WeightsLoaded(d.message.version, True, "", "file"))
    rewards = [s.reward for s in batch.samples]
    return {**figures, "batch_samples": len(batch.samples), "rewards_distinct": len(set(rewards)),
            "worker_version": worker.engine.version}  # fmt: skip


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="april-tour-") as tmp:
        for name, value in tour(Path(tmp)).items():
            print(f"{name:>16} {value:.4g}")
