"""The learner's side of the protocol: register, wait for a batch, publish weights, ack.

Owns what the learner says to the broker and what it must say again to a broker that lost it (after a
reconnect, or when the broker answers `not_registered`): its hello, the latest weights and phase (which
a restored broker may have lost; the engine it initialised too, which the broker shows as the learner's
engine once the phase has moved on) and the BatchRequest it is waiting on. Keeps the idempotent-ack
rule: every BatchRequest names the last batch trained, and a batch already trained is acked again, never
trained twice. The connection itself (heartbeats while waiting, as a batch can take minutes to form;
reconnecting with backoff when the broker goes silent) is `april.peer_link`'s. Knows nothing of torch.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable

from april import failures, protocol
from april.keys import ClientKeys
from april.peer_link import PeerLink
from april.records import SampleStatus

log = logging.getLogger("april.learner")


class BatchError(Exception):
    """The broker sent a batch that breaks the contract (not exactly N samples in complete groups)."""


class BrokerClient:
    def __init__(
        self,
        address: str,
        version: int,
        last_batch_id: int = -1,
        learner_id: str = "",
        curve: ClientKeys | None = None,
    ) -> None:
        self.learner_id = learner_id or f"learner-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.version = version
        self.last_batch_id = last_batch_id
        self.latest_weights: protocol.WeightsReady | None = None
        self.latest_phase: protocol.LearnerPhaseReport | None = None
        self.engine_report: protocol.LearnerPhaseReport | None = None  # its INITIALISING_ENGINE report
        self.waiting: protocol.BatchRequest | None = None  # the request next_batch waits on
        # `curve`: CurveZMQ client keys when the broker requires them
        self.link = PeerLink(address, self.learner_id, self._hello, curve)
        self.link.connect()

    def _hello(self) -> list[protocol.Message]:
        """What introduces this learner to a broker that may have lost it."""
        hello: list[protocol.Message] = [protocol.LearnerHello(self.learner_id, self.version, os.getpid())]
        # a restored or restarted broker may have lost the latest announcement, the engine and the phase
        engine = self.engine_report if self.engine_report != self.latest_phase else None
        hello += [msg for msg in (self.latest_weights, engine, self.latest_phase) if msg is not None]
        if self.waiting is not None:
            hello.append(self.waiting)
        return hello

    def next_batch(self, step: int, should_stop: Callable[[], bool]) -> protocol.Batch | None:
        """Block (with heartbeats and reconnects) until the batch for `step` arrives; None if stopped.
        Raises `april.failures.RunFailed` (one line) when the broker stopped the run instead."""
        self.waiting = protocol.BatchRequest(step, self.last_batch_id)
        self.link.send(self.waiting)
        try:
            while not should_stop():
                match self.link.recv(100):
                    case protocol.Batch(batch_id=batch_id) if batch_id == self.last_batch_id:
                        # trained already; only the ack was lost
                        self.link.send(protocol.BatchAck(batch_id, {}))
                    case protocol.Batch() as batch:
                        return batch
                    case protocol.Error(code=failures.RUN_FAILED, detail=detail):
                        raise failures.RunFailed(detail)  # every recent sample failed alike
                    case None | protocol.Welcome():
                        pass
                    case msg:
                        log.warning("unexpected %s from the broker", type(msg).__name__)
                self.link.keep_alive()
            return None
        finally:
            self.waiting = None

    def publish(self, version: int, uri: str, sha256: str) -> None:
        self.latest_weights = protocol.WeightsReady(version, uri, sha256)
        self.version = version
        self.link.send(self.latest_weights)

    def report_phase(self, phase: protocol.LearnerPhase, detail: str) -> None:
        """Tell the broker what the learner does from now on (shown in its status)."""
        self.latest_phase = protocol.LearnerPhaseReport(phase, detail[: protocol.MAX_PHASE_DETAIL])
        if phase == protocol.LearnerPhase.INITIALISING_ENGINE:
            self.engine_report = self.latest_phase
        self.link.send(self.latest_phase)

    def workers_behind(self, version: int, timeout_s: float) -> int | None:
        """Live workers not yet serving `version` (the broker's status); None if it did not answer within
        `timeout_s`. Keeps the link alive meanwhile."""
        self.link.send(protocol.StatusRequest())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.link.recv(50)
            if isinstance(msg, protocol.StatusReply):
                return sum(1 for w in msg.status.workers if w.alive and w.version < version)
            self.link.keep_alive()
        return None

    def ack(self, batch_id: int, metrics: dict[str, float]) -> None:
        """Ack a trained batch; `metrics` (the step's figures) go to the broker's status feed."""
        self.last_batch_id = batch_id
        self.link.send(protocol.BatchAck(batch_id, metrics))

    def close(self) -> None:
        self.link.send(protocol.Disconnect("done"))
        self.link.close(linger_ms=1000)


def check_batch(
    batch: protocol.Batch, samples_per_batch: int, group_size: int, vocab_size: int | None = None
) -> None:
    """Exactly N finished samples in complete groups, with token ids the model knows (when `vocab_size`
    is given), or BatchError naming what is wrong."""
    n = len(batch.samples)
    if n != samples_per_batch:
        raise BatchError(f"batch {batch.batch_id}: {n} samples, expected exactly {samples_per_batch}")
    indices: dict[int, list[int]] = {}
    for gid, idx in zip(batch.samples.group_id.tolist(), batch.samples.index.tolist(), strict=True):
        indices.setdefault(gid, []).append(idx)
    for gid, idx in indices.items():
        if sorted(idx) != list(range(group_size)):
            raise BatchError(
                f"batch {batch.batch_id}: group {gid} has samples {sorted(idx)}, not 0..{group_size - 1}"
            )
    if int((batch.samples.status != SampleStatus.FINISHED).sum()):
        raise BatchError(f"batch {batch.batch_id}: holds samples that are not finished")
    if vocab_size is not None:
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(batch.samples, name)
            if len(ids) and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
                raise BatchError(
                    f"batch {batch.batch_id}: {name} range {int(ids.min())}..{int(ids.max())} is outside the "
                    f"model's vocabulary 0..{vocab_size - 1}: the data or the engine does not match "
                    "learner.model (data.synthetic_vocab_size?)"
                )
