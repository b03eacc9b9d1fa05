"""The live broker's sockets under attack while a real run goes on (real `april worker` processes on the sim
engine, the scripted learner): garbage and raw TCP junk, wrong protocol versions, unknown kinds, frames too
large for ZeroMQ and messages too large for the codec, and a peer that registers like a worker and then
sends valid frames with out-of-range values (negative credit, NaN log-probs, mismatched lengths, unknown
lease ids, a result for another sample), replays its one good result twice (duplicates: counted, not
answered), and a stranger that sends a good result under a worker id it never registered. The broker keeps
serving the run to its last step, counts every rejection by reason, and the ledger balances (checked after
every message: debug_ledger).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import zmq
from harness import Cluster
from test_broker_integration import throw_garbage

from april import protocol
from april.records import FinishReason, Sample
from april.transport import dealer, recv, send
from april.wire_records import SampleBatch


def result(lease_ids: list[int], samples: list[Sample], credit: int = 0) -> protocol.SampleResult:
    return protocol.SampleResult(
        lease_ids=np.array(lease_ids, np.int64), samples=SampleBatch.from_samples(samples), credit=credit
    )


def finished(sample: Sample, version: int) -> Sample:
    """A valid return of a leased sample: one more token (a resumed partial may have only one left in its
    budget), stop, a reward."""
    last = sample.segments[-1].version if sample.segments else 0
    if sample.prompt_ids.shape[0] == 0:
        sample = dataclasses.replace(sample, prompt_ids=np.array([1, 2, 3], np.int32))
    return sample.extend([5], [-0.5], max(last, version), FinishReason.STOP).scored(1.0)


def leases_for(sock: zmq.Socket[bytes], want: int, timeout: float) -> tuple[int, list[tuple[int, Sample]]]:
    """Read the broker's messages until `want` leased samples arrived; returns (version, leases)."""
    version, got = 0, []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        msg = recv(sock, 100)
        if isinstance(msg, protocol.Welcome | protocol.WeightsReady):
            version = msg.version
            if version:  # "loaded": the broker leases work only to workers serving its version
                send(sock, protocol.WeightsLoaded(version, True, "", "file", 0.0))
        elif isinstance(msg, protocol.Lease):
            got += list(zip(msg.lease_ids.tolist(), msg.samples.to_samples(), strict=True))
    assert len(got) >= want, f"the rogue got {len(got)} leases in {timeout}s"
    return version, got


def play_rogue(c: Cluster) -> dict[str, int]:
    """A registered-looking worker with two leases, then a stranger; returns the rejections it expects."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rogue = dealer(ctx, c.worker_address, "rogue")
    send(rogue, protocol.WorkerHello("rogue", "sim", 2, 0, 1, "nowhere", np.zeros(0, np.int64)))
    version, leases = leases_for(rogue, 2, 60)
    (l1, s1), (l2, s2) = leases[:2]
    good = protocol.encode(result([l1], [finished(s1, version)], credit=1))
    for _ in range(3):  # accepted once, then two replays of the very same frames: duplicates
        rogue.send_multipart(good)
    bad = finished(s2, version)
    nan_lp = bad.response_logprobs.copy()
    nan_lp[-1] = np.nan
    nan_batch = dataclasses.replace(SampleBatch.from_samples([bad]), response_logprobs=np.asarray(nan_lp))
    send(rogue, protocol.SampleResult(np.array([l2], np.int64), nan_batch, 0))  # NaN log-prob
    send(rogue, result([l2, l2], [bad]))  # two lease ids, one sample
    send(rogue, result([l2], [bad], credit=-3))  # negative count
    send(rogue, protocol.LeaseRequest(-5))  # negative count
    send(rogue, result([l2 + (1 << 30)], [bad]))  # a lease id nobody was given: not_leased
    send(rogue, result([l2], [dataclasses.replace(bad, group_id=bad.group_id + 10_000)]))  # another sample
    send(rogue, protocol.AbortDone(999_999, 2, np.zeros(0, np.int64)))  # a round that never was: harmless
    send(rogue, protocol.Disconnect("rogue done"))
    stranger = dealer(ctx, c.worker_address, "stranger")  # never said hello
    stranger.send_multipart(good)
    # a message whose frames each pass ZeroMQ's MAXMSGSIZE but that is over the codec's limit in all
    oversized = [*good[:2], *(b"\0" * (400 << 10) for _ in range(3))]
    stranger.send_multipart(oversized)
    time.sleep(1.0)
    for sock in (rogue, stranger):
        sock.close(linger=60_000)  # deliver everything (ctx.term waits for it)
    ctx.term()
    return {
        "duplicate": 2,
        "not_leased": 1,
        "invalid_value": 4,
        "wrong_sample": 1,
        "not_registered": 2,
        "oversize": 1,
    }


def test_the_broker_serves_the_run_through_garbage_and_a_rogue_worker(
    cluster: Callable[..., Cluster],
) -> None:
    # the rogue sends no heartbeats: a liveness window (60 s) it cannot outstay on a busy machine, so its
    # rejections are the ones it provoked and not "not_registered" after being declared dead
    c = cluster(run={"mode": "april"}, broker={"max_message_bytes": 1 << 20, "liveness": 300})
    c.start_broker()
    c.start_worker("w0")
    c.start_learner(steps=8, train_s=0.2)
    sent = throw_garbage(c)
    expected = play_rogue(c)
    c.wait_exit("learner", 90)
    batches = {b["batch"]: b for b in c.batches()}.values()
    assert len(batches) == 8 and all(b["ok"] for b in batches)
    trained = Counter(tuple(k) for b in batches for k in b["keys"])
    assert all(n == 1 for n in trained.values()), "a sample was trained twice"
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 8 * 4, status.ledger
    by_reason = status.rejected.by_reason
    for reason in ("bad_header", "wrong_version", "unknown_kind", "missing_field", "identity_mismatch"):
        assert by_reason.get(reason, 0) > 0, (reason, by_reason)
    rogue = status.rejected.by_peer["rogue"]
    # its first result was taken
    assert rogue == {"duplicate": 2, "not_leased": 1, "invalid_value": 4, "wrong_sample": 1}
    assert status.rejected.by_peer["stranger"] == {"not_registered": 1, "oversize": 1}
    assert status.rejected.total >= sent["counted"] + sum(expected.values())
    assert [w.id for w in status.workers] == ["w0"] and status.workers[0].alive
