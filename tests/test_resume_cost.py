"""Resume cost: the prefix-cache rule (april.sim.prefix_cache), the sim engine and the simulator's engine
charging the same re-prefill for the same events, resume affinity (policy.resume_affinity and the
broker's books), and the resume_kv setting (config, engine capability)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import zmq
from harness import local_broker, wait_for
from sim_setup import sim_config

from actors.engine import EngineError, GenerationOutput, GenerationRequest
from actors.engines.sim_engine import SampleIdentity, SimEngine
from actors.factory import check_worker, engine_class
from april import protocol
from april.config import AlgoConfig, ConfigError, Mode, ResumeKV, WorkerConfig, load_config
from april.data import SyntheticPromptSource
from april.records import FinishReason, Sample, SampleStatus, new_group_samples
from april.sim.engine_cost import EngineCost
from april.sim.prefix_cache import MISS, CachedPrefix, PrefixCache
from april.transport import dealer, recv, send
from april.wire_records import SampleBatch
from broker import policy
from broker.sim.engines import EngineModel
from broker.sim.figures import Meter
from broker.sim.model import simulate
from broker.state import BrokerState
from cli.sim_options import resolve_lengths

# ---------------------------------------------------------------------- the cache rule


def test_a_stored_prefix_is_taken_back_once_and_never_more_than_the_input() -> None:
    cache = PrefixCache(100, keep_across_updates=False)
    cache.store("a", 40, kv_version=0)
    assert cache.tokens == 40 and "a" in cache
    assert cache.take("a", 30) == CachedPrefix(30, 0)  # a shorter input reuses only its own length
    assert cache.take("a", 30) == MISS and cache.tokens == 0  # the running sequence owns its KV now
    assert cache.take("never", 10) == MISS


def test_least_recently_stored_prefixes_are_evicted_to_fit_the_capacity() -> None:
    cache = PrefixCache(100, keep_across_updates=False)
    cache.store("a", 40, 0)
    cache.store("b", 40, 0)
    cache.store("c", 40, 0)  # 120 > 100: "a", the oldest, goes
    assert "a" not in cache and "b" in cache and "c" in cache and cache.tokens == 80
    cache.store("b", 10, 0)  # stored again: replaces its old entry and becomes the newest
    cache.store("d", 60, 0)  # 130 > 100: "c" is now the oldest
    assert [k for k in ("a", "b", "c", "d") if k in cache] == ["b", "d"] and cache.tokens == 70
    cache.store("huge", 101, 0)  # larger than the whole cache: not stored, nothing evicted for it
    assert "huge" not in cache and cache.tokens == 70
    assert len(PrefixCache(0, keep_across_updates=True)) == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(-1, keep_across_updates=False)


def test_recompute_flushes_on_a_weight_update_and_refuses_kv_of_older_weights() -> None:
    cache = PrefixCache(100, keep_across_updates=False)
    cache.store("a", 40, 0)
    cache.update(0)  # not newer: nothing happens
    assert "a" in cache
    cache.update(1)
    assert len(cache) == 0 and cache.tokens == 0 and cache.take("a", 40) == MISS
    cache.store("b", 40, kv_version=0)  # a sequence prefilled under v0, aborted after v1 was loaded
    assert "b" not in cache
    cache.store("c", 40, kv_version=1)
    assert cache.take("c", 40) == CachedPrefix(40, 1)


def test_reuse_keeps_prefixes_across_updates_with_the_version_of_their_kv() -> None:
    cache = PrefixCache(100, keep_across_updates=True)
    cache.store("a", 40, 0)
    cache.update(1)
    cache.store("b", 30, kv_version=0)
    assert cache.take("a", 50) == CachedPrefix(40, 0)
    assert cache.take("b", 30) == CachedPrefix(30, 0)


# ---------------------------------------------------------------------- the two engines agree

PROMPT = 16
COST = EngineCost(decode_ms=6.0, decode_ms_per_seq=0.1, prefill_ms_per_token=0.02, prefix_cache_tokens=60)


class Pair:
    """The sim engine and the simulator's engine, driven through the same events on the same samples."""

    def __init__(self, keep: bool) -> None:
        self.prompt = np.arange(3, 3 + PROMPT, dtype=np.int32)
        self.sim = SimEngine(
            "fixed:40",
            slots=8,
            cost=COST,
            sleep=False,
            identify=self._identify,
            keep_kv_across_updates=keep,
        )
        self.samples = {i: new_group_samples(i, 1, self.prompt, "", {})[0] for i in range(4)}
        self.by_request: dict[int, int] = {}
        self.model = EngineModel(0, 8, COST, Meter(1), lambda s: 40, keep)
        self.outputs: dict[int, list[GenerationOutput]] = {g: [] for g in self.samples}
        self.next_id = 0
        self.now = 0.0

    def _identify(self, req: GenerationRequest) -> SampleIdentity:
        return SampleIdentity.of_sample(self.by_request[req.request_id], 0, PROMPT)

    def lease(self, *groups: int) -> None:
        work, requests = [], []
        for g in groups:
            leased = self.samples[g].resumed()
            self.next_id += 1
            self.by_request[self.next_id] = g
            work.append((self.next_id, leased.budget(100), leased))
            ids = np.concatenate([self.prompt, leased.response_ids]).astype(np.int32)
            requests.append(GenerationRequest(self.next_id, ids, leased.budget(100)))
        assert self.model.admit(work) == []
        self.sim.add(requests)

    def steps(self, n: int) -> None:
        for _ in range(n):
            assert self.sim.step() == []
        self.now = self.model.boundary(n)
        self.model.advance(self.now, n)

    def abort(self) -> None:
        outs: dict[int, GenerationOutput] = {o.request_id: o for o in self.sim.abort()}
        for lease_id, sample in self.model.abort():
            out = outs[lease_id]  # the sim engine's partial is the simulator's, token for token count
            assert out.finish_reason == FinishReason.ABORT
            assert len(out.token_ids) == sample.response_len - self.samples[sample.group_id].response_len
            self.samples[sample.group_id] = sample
            self.outputs[sample.group_id].append(out)

    def load(self, version: int) -> None:
        self.sim.load_weights("", version)
        self.model.load(version)

    def agree(self) -> int:
        assert self.sim.reprefill_tokens == self.model.reprefill_tokens
        assert self.sim.stale_kv_tokens == self.model.stale_kv_tokens
        assert self.sim.elapsed_s == pytest.approx(self.model.busy_s)
        assert self.sim.reprefill_s == pytest.approx(COST.prefill_s(self.model.reprefill_tokens))
        return self.model.reprefill_tokens


@pytest.mark.parametrize("keep", [False, True])
def test_the_sim_engine_and_the_simulator_charge_the_same_reprefill(keep: bool) -> None:
    p = Pair(keep)
    p.lease(0, 1)
    p.steps(5)
    p.abort()  # 0 and 1 leave 16 + 5 tokens each in the cache (42 of 60)
    assert p.agree() == 0  # fresh prompts are no re-prefill
    p.lease(0)
    p.steps(1)
    assert p.agree() == 0  # its whole prefix was cached: nothing re-prefilled
    p.lease(2, 3)
    p.steps(4)
    p.abort()  # stored in turn: 0 (16 + 10), 2 and 3 (16 + 4 each); to fit 60, 1 then 0 are evicted
    p.lease(1, 2)
    p.steps(2)
    assert p.agree() == 21  # 1 was evicted: 16 + 5 re-prefilled; 2 was cached
    p.abort()  # 1 (16 + 7) and 2 (16 + 6) stored: 3 (oldest) is evicted
    p.load(1)  # recompute: the cache is emptied; reuse: kept
    p.lease(1, 3)
    p.steps(1)
    assert p.agree() == 21 + (16 + 4) + (0 if keep else 16 + 7)
    assert p.model.stale_kv_tokens == (1 if keep else 0)  # reuse: 1's next token attends to v0's KV


def test_an_abort_before_the_first_step_leaves_only_what_the_cache_gave() -> None:
    p = Pair(keep=False)
    p.lease(0)
    p.steps(3)
    p.abort()
    p.lease(0, 1)  # admitted, aborted before any step: 0's cached KV goes back, 1 had none
    p.abort()
    p.lease(0, 1)
    p.steps(1)
    assert p.agree() == 0
    assert p.sim.elapsed_s == pytest.approx(
        COST.step_s(1, PROMPT) + 2 * COST.step_s(1) + COST.step_s(2, PROMPT)
    )


# ---------------------------------------------------------------------- affinity


def test_resume_affinity_sends_each_partial_to_its_holder_while_it_has_room() -> None:
    assert policy.resume_affinity([0, 1, 0, 0, None, 2], [2, 1, 0]) == [0, 1, 0, None, None, None]
    assert policy.resume_affinity([], [3]) == []
    assert policy.resume_affinity([5], [1]) == [None]  # a holder index out of range: gone


def test_the_dispatch_queue_gives_its_head_and_removes_keys_anywhere() -> None:
    q = policy.DispatchQueue()
    for g in range(5):
        q.push((g, 0), None if g % 2 else 0)  # partials first (version 0), then fresh samples
    assert q.head(3) == [(0, 0), (2, 0), (4, 0)] and q.head(0) == []
    q.remove({(2, 0), (3, 0)})
    assert q.ordered() == [(0, 0), (4, 0), (1, 0)] and len(q) == 3


def source() -> SyntheticPromptSource:
    return SyntheticPromptSource(size=100, seed=0, prompt_len_min=3, prompt_len_max=6, vocab_size=50)


def interrupted(sample: Sample, version: int = 0) -> Sample:
    return sample.extend(np.full(2, 7, np.int32), np.full(2, -0.5, np.float32), version, FinishReason.ABORT)


def state_with_partials(version: int = 0) -> tuple[BrokerState, dict[tuple[int, int], str]]:
    """april, one group of 4 on weights `version`: w0 and w1 lease 2 samples each and return them
    interrupted."""
    algo = AlgoConfig(
        rollout_batch_size=1,
        over_sampling_batch_size=1,
        n_samples_per_prompt=4,
        max_new_tokens=8,
        resume_affinity=True,
    )
    state = BrokerState(Mode.APRIL, algo, source())
    state.set_weights(version, "", "")
    leases = [(w, lease) for w in ("w0", "w1") for lease in state.take_work(w, 2, version)]
    held = {}
    for worker, (lease_id, _, sample) in leases:
        state.accept_result(worker, lease_id, interrupted(sample, version))
        held[sample.key] = worker
    state.check_ledger()
    return state, held


def test_partials_go_back_to_their_holder_when_it_has_room() -> None:
    state, held = state_with_partials()
    out = state.take_held_partials(["w1", "w0", "w2"], [4, 4, 4], [0, 0, 0])
    got = {s.key: w for w, items in zip(["w1", "w0", "w2"], out, strict=True) for _, _, s in items}
    assert got == held and len(state.queue) == 0
    assert all(s.status == SampleStatus.RUNNING and s.response_len == 2 for items in out for _, _, s in items)
    state.check_ledger()
    assert state.totals.resumed == 4


def test_a_partial_whose_holder_has_no_room_goes_to_another_worker() -> None:
    state, held = state_with_partials()
    out = state.take_held_partials(["w0", "w1"], [4, 0], [0, 0])  # w1 is full
    assert {s.key for _, _, s in out[0]} == {k for k, w in held.items() if w == "w0"} and out[1] == []
    left = {k for k, w in held.items() if w == "w1"}
    assert set(state.queue.ordered()) == left  # nothing waits for w1: the spread leases them anywhere
    assert {s.key for _, _, s in state.take_work("w2", 4, 0)} == left
    state.check_ledger()


def test_affinity_only_chooses_among_what_this_dispatch_leases_and_keeps_versions() -> None:
    state, held = state_with_partials()
    first = state.queue.head(1)[0]
    out = state.take_held_partials(["w0", "w1"], [1, 0], [0, 0])  # one free slot: only the queue's head
    assert [s.key for items in out for _, _, s in items] == ([first] if held[first] == "w0" else [])
    newer, _ = state_with_partials(version=1)  # partials generated under v1
    out = newer.take_held_partials(["w0", "w1"], [4, 4], [0, None])  # w0 still serves v0
    assert out[0] == [] and {s.key for _, _, s in out[1]} == {k for k, w in held.items() if w == "w1"}
    assert len(newer.queue) == 2  # w0's partials wait for a worker on v1, as take_work leaves them
    newer.check_ledger()


def test_a_partial_returned_with_nothing_new_is_held_by_the_worker_that_returned_it() -> None:
    state, held = state_with_partials()
    key = next(k for k, w in held.items() if w == "w0")
    leases = state.take_work("w1", 4, 0)
    lease_id, _, sample = next(item for item in leases if item[2].key == key)
    state.accept_result("w1", lease_id, sample.extend([], [], 0, FinishReason.ABORT))  # nothing new
    assert state.holders == {key: "w1"}
    state.check_ledger()


def test_without_holders_nothing_is_taken() -> None:
    state = BrokerState(Mode.ASYNC, AlgoConfig(n_samples_per_prompt=2), source())
    assert state.take_held_partials(["w0"], [4], [0]) == [[]]
    assert state.holders == {}


def test_holders_are_forgotten_when_a_partial_is_leased_again() -> None:
    state, held = state_with_partials()
    leases = state.take_work("w0", 3, 0)  # leased in queue order, to a worker whatever its holder
    assert set(state.holders) == set(held) - {s.key for _, _, s in leases} and len(state.holders) == 1
    for lease_id, _, sample in leases:
        done = sample.extend([3], [-0.5], 0, FinishReason.STOP).scored(1.0)
        state.accept_result("w0", lease_id, done)
    assert len(state.holders) == 1
    state.check_ledger()


# ---------------------------------------------------------------------- the simulator and resume_kv


def run(mode: Mode, affinity: bool, kv: ResumeKV) -> tuple[float, int]:
    algo = AlgoConfig(
        rollout_batch_size=4,
        over_sampling_batch_size=8,
        n_samples_per_prompt=4,
        max_new_tokens=2048,
        resume_affinity=affinity,
    )
    cfg = sim_config(
        mode,
        algo,
        engines=4,
        slots=8,
        learner_step_s=1.0,
        steps=6,
        check_ledger_every_event=True,
        resume_kv=kv,
    )
    result = simulate(cfg, resolve_lengths("lognormal:median=200,sigma=1.2,cap=2048"))
    f = result.figures
    assert f.wasted_tokens == 0
    assert f.reprefill_frac is not None and f.stale_kv_token_frac is not None
    # only a prefix kept across a weight update makes tokens attend to KV of older weights
    assert (f.stale_kv_token_frac > 0) == (kv is ResumeKV.REUSE and f.resumed > 0)
    return f.reprefill_frac, f.resumed


@pytest.mark.parametrize("mode", [Mode.APRIL, Mode.ASYNC])
def test_the_simulator_reports_the_reprefill_share_and_reuse_with_affinity_removes_it(mode: Mode) -> None:
    base, resumed = run(mode, False, ResumeKV.RECOMPUTE)
    assert resumed > 0 and 0 < base < 1
    cut, resumed = run(mode, True, ResumeKV.REUSE)
    assert resumed > 0 and cut < base  # the holder's cache still holds nearly every prefix


def test_sync_has_no_reprefill() -> None:
    assert run(Mode.SYNC, False, ResumeKV.RECOMPUTE) == (0.0, 0)


def test_resume_kv_reuse_is_refused_for_engines_that_flush_their_cache() -> None:
    check_worker(WorkerConfig(engine="sim", resume_kv=ResumeKV.REUSE))
    for engine in ("sglang", "vllm", "torch"):
        assert engine_class(engine).can_reuse_kv is False
        check_worker(WorkerConfig(engine=engine, resume_kv=ResumeKV.RECOMPUTE))
    with pytest.raises(EngineError, match=r"worker.resume_kv = 'reuse': engine 'sglang' cannot keep"):
        check_worker(WorkerConfig(engine="sglang", resume_kv=ResumeKV.REUSE))
    assert engine_class("sim").can_reuse_kv is True


def test_resume_options_in_config_and_their_errors() -> None:
    cfg = load_config(None, overrides={"worker.resume_kv": "reuse", "algo.resume_affinity": "true"})
    assert cfg.worker.resume_kv is ResumeKV.REUSE and cfg.algo.resume_affinity is True
    assert cfg.worker.sim_cost.prefix_cache_tokens == EngineCost().prefix_cache_tokens
    with pytest.raises(ConfigError, match=r"worker\.resume_kv"):
        load_config(None, overrides={"worker.resume_kv": "keep"})
    with pytest.raises(ConfigError, match=r"worker\.sim_prefix_cache_tokens"):
        WorkerConfig(sim_prefix_cache_tokens=-1)
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        dataclasses.replace(EngineCost(), prefix_cache_tokens=-1)


def test_the_recorded_logprobs_are_the_engines_whatever_the_cache() -> None:
    """With reuse a resumed sample attends to KV of older weights; the sim engine's tokens and log-probs
    depend on the sample and position only, so what it records is exactly what it sampled with, cache
    or not, and the version tags say which weights were loaded when each token was drawn."""
    runs = {}
    for keep in (False, True):
        p = Pair(keep)
        p.lease(0)
        p.steps(3)
        p.abort()
        p.load(1)
        p.lease(0)
        p.steps(2)
        p.abort()
        runs[keep] = p.outputs[0]
    for field in ("token_ids", "logprobs", "versions"):
        a, b = (np.concatenate([getattr(o, field) for o in runs[k]]) for k in (False, True))
        assert np.array_equal(a, b), field
    assert np.concatenate([o.versions for o in runs[True]]).tolist() == [0, 0, 0, 1, 1]


# ---------------------------------------------------------------------- a live broker


M = TypeVar("M")


def next_of(sock: zmq.Socket[bytes], kind: type[M], timeout_s: float = 60.0) -> M:
    """The next message of `kind` the broker sends this peer, skipping heartbeats and the like."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = recv(sock, 200)
        if isinstance(msg, kind):
            return msg
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s")


def keys(lease: protocol.Lease) -> set[tuple[int, int]]:
    return {s.key for s in lease.samples.to_samples()}


def give_back(sock: zmq.Socket[bytes], lease: protocol.Lease, finished: bool) -> None:
    """Return every leased sample with two new tokens: finished (freeing its slot) or interrupted."""
    samples = lease.samples.to_samples()
    if finished:
        done = [s.extend([5, 6], [-0.5, -0.5], 0, FinishReason.STOP).scored(1.0) for s in samples]
        send(sock, protocol.SampleResult(lease.lease_ids, SampleBatch.from_samples(done), len(done)))
    else:
        out = [interrupted(s) for s in samples]
        send(sock, protocol.SampleResult(lease.lease_ids, SampleBatch.from_samples(out), 0))


class LiveBroker:
    """An in-process async broker (B = 1, groups of 4, eta 1) with two workers of 2 slots each."""

    def __init__(self, tmp_path: Path, affinity: bool) -> None:
        self.broker, ports = local_broker(
            tmp_path / "run", {"algo.n_samples_per_prompt": 4, "algo.resume_affinity": affinity}
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.broker.serve, args=(self.stop.is_set,), daemon=True)
        self.thread.start()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.worker_address = f"tcp://127.0.0.1:{ports[0]}"
        self.learner = dealer(self.ctx, f"tcp://127.0.0.1:{ports[1]}", "learner")

    def worker(self, worker_id: str) -> zmq.Socket[bytes]:
        sock = dealer(self.ctx, self.worker_address, worker_id)
        send(sock, protocol.WorkerHello(worker_id, "sim", 2, 0, 1, "node", np.zeros(0, np.int64)))
        return sock

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.ctx.destroy(linger=0)
        self.broker.close()


def resumed_after_new_weights(tmp_path: Path, affinity: bool) -> dict[str, set[tuple[int, int]]]:
    """w0 and w1 each hold two samples when weights v1 are published: both abort, load v1, and get
    their slots back in the same dispatch (when the abort round ends). Returns the partials each worker
    held ("w0", "w1") and those it was leased after the abort ("w0 after", "w1 after"). Crossed on
    purpose: w1's partials come first in dispatch order and w0 is served first, so leasing the queue in
    order gives each worker the other's partials."""
    b = LiveBroker(tmp_path, affinity)
    try:
        w0 = b.worker("w0")
        first = next_of(w0, protocol.Lease)  # group 0, samples 0 and 1
        w1 = b.worker("w1")
        lease1 = next_of(w1, protocol.Lease)  # group 0, samples 2 and 3
        give_back(w0, first, finished=True)
        lease0 = next_of(w0, protocol.Lease)  # group 1, samples 0 and 1 (eta 1 admits a second group)
        send(b.learner, protocol.LearnerHello("learner", 0, 1))
        next_of(b.learner, protocol.Welcome)
        send(b.learner, protocol.WeightsReady(1, "sim://v1", "0" * 64))
        for sock, lease in ((w0, lease0), (w1, lease1)):
            next_of(sock, protocol.WeightsReady)
            send(sock, protocol.WeightsLoaded(1, True, ""))
            abort = next_of(sock, protocol.Abort)
            give_back(sock, lease, finished=False)
            send(sock, protocol.AbortDone(abort.round_id, 2, np.zeros(0, np.int64)))
        after0, after1 = (next_of(sock, protocol.Lease) for sock in (w0, w1))
        return {"w0": keys(lease0), "w1": keys(lease1), "w0 after": keys(after0), "w1 after": keys(after1)}
    finally:
        b.close()


def test_a_live_broker_sends_each_partial_back_to_the_worker_that_holds_its_prefix(tmp_path: Path) -> None:
    got = resumed_after_new_weights(tmp_path / "on", affinity=True)
    assert got["w0"] <= got["w0 after"] and got["w1"] <= got["w1 after"]
    # without affinity the same events lease the queue in order: each worker resumes the other's
    off = resumed_after_new_weights(tmp_path / "off", affinity=False)
    assert off["w1"] <= off["w0 after"] and off["w0"] <= off["w1 after"]


def test_a_live_broker_resumes_a_partial_elsewhere_when_its_holder_has_no_room(tmp_path: Path) -> None:
    """w0 returns its two samples interrupted but keeps its slots (credit 0): w1, with room, gets them at
    once rather than leaving them to wait for w0."""
    b = LiveBroker(tmp_path, affinity=True)
    try:
        w0 = b.worker("w0")
        lease0 = next_of(w0, protocol.Lease)
        w1 = b.worker("w1")
        lease1 = next_of(w1, protocol.Lease)
        give_back(w0, lease0, finished=False)
        # two sockets, no order between them: w1's slots must free only once w0's partials are queued
        wait_for(lambda: keys(lease0) <= set(b.broker.core.state.holders), 60, "w0's partials queued")
        give_back(w1, lease1, finished=True)  # w1 frees its two slots
        resumed = next_of(w1, protocol.Lease).samples.to_samples()
        assert {s.key for s in resumed} == keys(lease0) and all(s.response_len == 2 for s in resumed)
    finally:
        b.close()
