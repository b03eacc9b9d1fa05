"""The learner's side of the protocol: register, wait for a batch, publish weights, ack.

Owns the DEALER connection to the broker's learner port, heartbeats while waiting (a batch can take
minutes to form), reconnection with backoff when the broker goes silent (re-announcing the latest weights
and phase, which a restored broker may have lost), and the idempotent-ack rule: every BatchRequest names
the last batch trained, and a batch already trained is acked again, never trained twice. Knows nothing of
torch.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable

import zmq

from april import protocol
from april.codec import ProtocolError
from april.keys import ClientKeys
from april.records import SampleStatus
from april.transport import dealer, recv, send

log = logging.getLogger("april.learner")
LIVENESS = 3
BACKOFF_MAX_S = 32.0


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
        self.address = address
        self.curve = curve  # CurveZMQ client keys when the broker requires them
        self.learner_id = learner_id or f"learner-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.version = version
        self.last_batch_id = last_batch_id
        self.latest_weights: protocol.WeightsReady | None = None
        self.latest_phase: protocol.LearnerPhaseReport | None = None
        self.interval = 1.0
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = dealer(self.ctx, self.address, self.learner_id, curve=self.curve)
        send(sock, protocol.LearnerHello(self.learner_id, self.version, os.getpid()))
        self._announce(sock)
        return sock

    def _announce(self, sock: zmq.Socket[bytes]) -> None:
        """After a hello: what a restored or restarted broker may have lost, the latest weights and phase."""
        for msg in (self.latest_weights, self.latest_phase):
            if msg is not None:
                send(sock, msg)

    def next_batch(self, step: int, should_stop: Callable[[], bool]) -> protocol.Batch | None:
        """Block (with heartbeats and reconnects) until the batch for `step` arrives; None if stopped."""
        send(self.sock, protocol.BatchRequest(step, self.last_batch_id))
        last_heard = last_sent = time.monotonic()
        backoff = 1.0
        while not should_stop():
            try:
                msg = recv(self.sock, 100)
            except ProtocolError as exc:
                log.warning("malformed message from the broker dropped: %s", exc)
                continue
            now = time.monotonic()
            if msg is not None:
                last_heard, backoff = now, 1.0
            match msg:
                case protocol.Batch() if msg.batch_id == self.last_batch_id:
                    # trained already; only the ack was lost
                    send(self.sock, protocol.BatchAck(msg.batch_id, {}))
                case protocol.Batch():
                    return msg
                case protocol.Welcome():
                    self.interval = msg.heartbeat_interval_s
                case protocol.Error(code="not_registered"):
                    # a restarted broker that this socket reconnected to by itself: it answers, so it is
                    # never silent, but it knows this learner only after a new hello (docs/protocol.md)
                    log.warning("the broker does not know this learner (restarted?): saying hello again")
                    send(self.sock, protocol.LearnerHello(self.learner_id, self.version, os.getpid()))
                    self._announce(self.sock)
                    send(self.sock, protocol.BatchRequest(step, self.last_batch_id))
                case protocol.Error(code=code, detail=detail):
                    log.warning("broker error %s: %s", code, detail)
            if now - last_sent >= self.interval:
                send(self.sock, protocol.Heartbeat())
                last_sent = now
            if now - last_heard > max(LIVENESS * self.interval, backoff):
                log.warning("broker silent for %.0fs: reconnecting", now - last_heard)
                self.sock.close(linger=0)
                self.sock = self._connect()
                send(self.sock, protocol.BatchRequest(step, self.last_batch_id))
                last_heard, backoff = now, min(backoff * 2, BACKOFF_MAX_S)
        return None

    def publish(self, version: int, uri: str, sha256: str) -> None:
        self.latest_weights = protocol.WeightsReady(version, uri, sha256)
        self.version = version
        send(self.sock, self.latest_weights)

    def report_phase(self, phase: protocol.LearnerPhase, detail: str) -> None:
        """Tell the broker what the learner does from now on (shown in its status)."""
        self.latest_phase = protocol.LearnerPhaseReport(phase, detail[: protocol.MAX_PHASE_DETAIL])
        send(self.sock, self.latest_phase)

    def ack(self, batch_id: int, metrics: dict[str, float]) -> None:
        """Ack a trained batch; `metrics` (the step's figures) go to the broker's status feed."""
        self.last_batch_id = batch_id
        send(self.sock, protocol.BatchAck(batch_id, metrics))

    def close(self) -> None:
        send(self.sock, protocol.Disconnect("done"))
        self.sock.close(linger=1000)
        self.ctx.term()


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
