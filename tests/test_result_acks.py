"""Result acknowledgements against a real `april broker` process at the default snapshot interval
(docs/protocol.md section 11): a worker's result is acknowledged (Lease.acked, ResultAck) only once the
broker has it on disk, and then survives a SIGKILL of the broker; one the broker never acknowledged is
sent again after the worker's hello and taken once; the same result sent twice is a duplicate (counted,
not answered).

The worker is played by the test over a DEALER socket, so it sees every acknowledgement and controls
every resend; the learner is absent (no batch forms, nothing is aborted: the partials stay queued).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable

import numpy as np
import zmq
from harness import Cluster

from april import protocol
from april.config import BrokerConfig
from april.records import FinishReason, Sample
from april.transport import dealer, recv, send
from april.wire_records import SampleBatch

SLOTS = 4


class Worker:
    """A worker's protocol, by hand: hello, leases, results numbered, the acknowledgements it hears."""

    def __init__(self, c: Cluster, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.c, self.ctx = c, ctx
        self.sock = dealer(ctx, c.worker_address, "w0")
        self.acked = 0
        self.errors: list[str] = []
        self.leased: list[tuple[int, Sample]] = []

    def hello(self, held: list[int], credit: int) -> None:
        held_ids = np.array(held, np.int64)
        send(self.sock, protocol.WorkerHello("w0", "sim", SLOTS, 0, 1, "here", held_ids, credit))

    def result(self, seq: int, leases: list[tuple[int, Sample]], credit: int = 0) -> None:
        ids, samples = zip(*leases, strict=True)
        batch = SampleBatch.from_samples(list(samples))
        send(self.sock, protocol.SampleResult(np.array(ids, np.int64), batch, credit, seq))

    def read(self, until: Callable[[], bool], what: str) -> None:
        """Handle the broker's messages until `until()` (a not_registered is only noted: the test says
        hello itself); the leased samples are kept in `leased`."""
        deadline = time.monotonic() + 60
        while not until():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            msg = recv(self.sock, 50)
            if isinstance(msg, protocol.Lease):
                self.acked = max(self.acked, msg.acked)
                self.leased += list(zip(msg.lease_ids.tolist(), msg.samples.to_samples(), strict=True))
            elif isinstance(msg, protocol.ResultAck):
                self.acked = max(self.acked, msg.acked)
            elif isinstance(msg, protocol.Error):
                self.errors.append(msg.code)

    def leases(self, n: int) -> list[tuple[int, Sample]]:
        """The next `n` leased samples."""
        self.read(lambda: len(self.leased) >= n, f"{n} leases")
        out, self.leased = self.leased[:n], self.leased[n:]
        return out


def partial(sample: Sample, tokens: list[int]) -> Sample:
    """The leased sample returned interrupted with `tokens` more (a prompt filled in if it had none)."""
    if sample.prompt_ids.shape[0] == 0:
        sample = dataclasses.replace(sample, prompt_ids=np.array([1, 2, 3], np.int32))
    return sample.extend(tokens, [-0.5] * len(tokens), 0, FinishReason.ABORT)


def test_an_acknowledged_result_survives_a_broker_kill_and_an_unacknowledged_one_is_sent_again(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(
        run={"mode": "async"},
        algo={"rollout_batch_size": 1, "over_sampling_batch_size": 2, "n_samples_per_prompt": 2},
        broker={"snapshot_interval_s": BrokerConfig().snapshot_interval_s, "liveness": 300},
    )
    c.start_broker()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        w = Worker(c, ctx)
        w.hello([], SLOTS)
        (l1, s1), (l2, s2), (l3, s3), (l4, _) = w.leases(SLOTS)
        acked = [(l1, partial(s1, [11, 12, 13])), (l2, partial(s2, [21]))]
        w.result(1, acked)
        w.read(lambda: w.acked >= 1, "the acknowledgement of result 1")
        # the broker frozen: a result it reads no more, so it is never acknowledged; then SIGKILL
        c.procs["broker"].send_signal(signal.SIGSTOP)
        unacked = [(l3, partial(s3, [31, 32]))]
        w.result(2, unacked)
        time.sleep(0.1)
        c.kill("broker")
        assert w.acked == 1
        c.start_broker(resume=True)
        before = c.status()
        assert before.ledger.partial + before.ledger.in_flight > 0 and before.totals.aborted >= 2
        # the worker reconnects: its hello names the lease it still generates and the unacknowledged
        # result's, then sends that result again (and the acknowledged one by mistake: a duplicate)
        w.sock.close(linger=0)
        w.sock = dealer(ctx, c.worker_address, "w0")
        w.hello([l3, l4], SLOTS - 1)
        w.result(2, unacked)
        w.result(1, acked)
        w.read(lambda: w.acked >= 2, "the acknowledgement of result 2, sent again")
        status = c.status()
        assert status.totals.aborted == before.totals.aborted + 1  # taken once, the duplicate not at all
        assert status.rejected.by_peer.get("w0", {}) == {"duplicate": 2}  # the two samples of result 1
        assert "duplicate" not in w.errors  # counted, not answered
        # every partial comes back as it was returned: the acknowledged ones and the one sent again
        want = {s.key: s.response_ids.tolist() for _, s in acked + unacked}
        send(w.sock, protocol.LeaseRequest(SLOTS))  # free slots: what waits is leased
        got = {s.key: s.response_ids.tolist() for _, s in w.leases(len(want))}
        assert {key: got.get(key) for key in want} == want
        assert c.status().ledger_balanced
    finally:
        ctx.destroy(linger=0)
