"""The collective weight broadcast over gloo on loopback: `learner.weight_broadcast.BroadcastHub` sending,
`actors.weight_receive.BroadcastMember` receiving (real processes where the behaviour is about processes:
several versions arrive equal, a killed member is dropped without hanging the learner and the survivor
goes on; threads in this process elsewhere). Small tensors, short timeouts; deadlines only say "did not
hang", never how fast.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import actors.weight_receive as weight_receive
import learner.weight_broadcast as weight_broadcast
from actors.engine import TensorLoading
from actors.weight_receive import BroadcastMember, ReceivedWeights
from april.broadcast_group import (
    SAMPLE_MAX_NUMEL,
    SAMPLE_VALUES,
    BroadcastError,
    Entry,
    Manifest,
    Sample,
    check_bucket,
    digest,
    plan,
    sample_entry,
    sample_mismatch,
    sample_rows,
)
from april.ports import free_ports
from learner.weight_broadcast import BroadcastHub, BroadcastReport

HANG_S = 60.0  # "did not hang": generous on a loaded 2-core machine
HOST = "127.0.0.1"

# A member process: receives versions and saves each one it got as <out>/<worker>-v<version>.safetensors
# (clones: the received tensors are views of their buckets, which safetensors will not save as such).
MEMBER = """
import sys, time
from pathlib import Path
from safetensors.torch import save_file
from actors.weight_receive import BroadcastMember
port, worker, out, timeout = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
member = BroadcastMember(worker, timeout_s=timeout)
member.join("127.0.0.1", port)
while True:
    got = member.poll()
    if got is not None:
        tmp = out / f"{worker}.tmp"
        save_file({k: v.clone() for k, v in got.tensors.items()}, str(tmp))
        tmp.rename(out / f"{worker}-v{got.version}.safetensors")
    for line in member.errors():
        print(line, flush=True)
    time.sleep(0.05)
"""


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    """25 tensors in two dtypes (one empty, one scalar); 4820 bytes in all."""
    gen = torch.Generator().manual_seed(seed)
    state = {f"layers.{i}.weight": torch.randn(8, 4, generator=gen) for i in range(22)}
    state["norm.scale"] = torch.randn((), generator=gen)
    state["empty"] = torch.zeros(0)
    state["embed.weight"] = torch.randn(10, 100, generator=gen).to(torch.bfloat16)  # 2000 B: a bucket alone
    return state


def wait_for(what: str, check: Callable[[], bool], deadline_s: float = HANG_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"did not happen within {deadline_s:g} s: {what}"
        time.sleep(0.05)


def broadcast_within(hub: BroadcastHub, state: dict[str, torch.Tensor], version: int) -> BroadcastReport:
    """hub.broadcast in a thread: the test fails (rather than hangs) if it does not return."""
    out: list[BroadcastReport] = []
    thread = threading.Thread(target=lambda: out.append(hub.broadcast(state, version)), daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"broadcast of v{version} did not return within {HANG_S:g} s"
    return out[0]


def receive(member: BroadcastMember, version: int) -> ReceivedWeights:
    got: list[ReceivedWeights] = []

    def arrived() -> bool:
        item = member.poll()
        if item is not None:
            got.append(item)
        return any(g.version == version for g in got)

    wait_for(f"{member.worker_id} receives v{version} (errors: {member.errors()})", arrived)
    return next(g for g in got if g.version == version)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.fixture
def hub_port() -> Iterator[int]:
    yield free_ports(1)[0]


def test_two_member_processes_get_every_version_and_a_killed_one_is_dropped(
    hub_port: int, tmp_path: Path
) -> None:
    hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=1024, timeout_s=10)
    procs = {
        worker: subprocess.Popen(
            [sys.executable, "-c", MEMBER, str(hub_port), worker, str(tmp_path), "10"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for worker in ("w-a", "w-b")
    }
    try:
        wait_for("both members join", lambda: hub.waiting() == 2)
        for version in (1, 2, 3):
            state = state_dict(version)
            report = broadcast_within(hub, state, version)
            assert sorted(report.reached) == ["w-a", "w-b"] and report.dropped == () and report.error == ""
            # whole tensors in buckets of at most 1 KiB: 22 of 128 B (8, 8, 6 with the scalar and the empty
            # one), then the 2000 B one alone
            assert report.buckets == 4 < len(state)
            assert report.bytes == sum(t.numel() * t.element_size() for t in state.values())
            for worker in procs:
                file = tmp_path / f"{worker}-v{version}.safetensors"
                wait_for(f"{worker} saves v{version}", file.exists)
                assert_equal(load_file(str(file)), state)

        procs["w-a"].send_signal(signal.SIGKILL)
        procs["w-a"].wait(HANG_S)
        report = broadcast_within(hub, state_dict(4), 4)
        assert "w-a" in report.dropped and "w-a" not in report.reached and report.error

        wait_for("the survivor joins anew", lambda: hub.waiting() == 1)
        state = state_dict(5)
        report = broadcast_within(hub, state, 5)
        assert report.reached == ("w-b",) and report.dropped == ()
        file = tmp_path / "w-b-v5.safetensors"
        wait_for("w-b saves v5", file.exists)
        assert_equal(load_file(str(file)), state)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.communicate(timeout=HANG_S)
        hub.close()


def test_a_stopped_member_is_dropped_within_the_timeout_and_rejoins_when_it_resumes(
    hub_port: int, tmp_path: Path
) -> None:
    """SIGSTOP: the member is alive but takes nothing. 32 MiB is more than loopback's socket buffers hold,
    so the hub's send cannot complete: it gives up after timeout_s instead of waiting for the member."""
    hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=8 << 20, timeout_s=3)
    proc = subprocess.Popen(
        [sys.executable, "-c", MEMBER, str(hub_port), "w", str(tmp_path), "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    big = {"w": torch.randn(8 << 20)}  # 32 MiB of float32
    try:
        wait_for("the member joins", lambda: hub.waiting() == 1)
        assert broadcast_within(hub, state_dict(1), 1).reached == ("w",)
        proc.send_signal(signal.SIGSTOP)
        report = broadcast_within(hub, big, 2)
        assert report.dropped == ("w",) and report.reached == () and report.error
        proc.send_signal(signal.SIGCONT)

        wait_for("the member joins anew", lambda: hub.waiting() == 1)
        state = state_dict(3)
        assert broadcast_within(hub, state, 3).reached == ("w",)
        file = tmp_path / "w-v3.safetensors"
        wait_for("w saves v3", file.exists)
        assert_equal(load_file(str(file)), state)
        assert not (tmp_path / "w-v2.safetensors").exists()
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.communicate(timeout=HANG_S)
        hub.close()


def test_with_no_member_broadcast_returns_at_once_and_sends_nothing(hub_port: int) -> None:
    hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=1024, timeout_s=600)
    try:
        report = broadcast_within(hub, state_dict(1), 1)  # a 600 s timeout would show if it waited
        assert report == BroadcastReport(1, (), (), report.seconds, 0, 0)
        assert hub.members == () and hub.waiting() == 0
    finally:
        hub.close()


def test_a_member_that_joins_late_gets_the_version_after_it_joined(hub_port: int) -> None:
    hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=1024, timeout_s=10)
    early, late = BroadcastMember("early", timeout_s=10), BroadcastMember("late", timeout_s=10)
    try:
        early.join(HOST, hub_port)
        wait_for("early joins", lambda: hub.waiting() == 1)
        assert broadcast_within(hub, state_dict(1), 1).reached == ("early",)
        assert receive(early, 1).version == 1

        late.join(HOST, hub_port)
        wait_for("late joins", lambda: hub.waiting() == 1)
        state = state_dict(2)
        report = broadcast_within(hub, state, 2)  # a new generation: the early member stays in it
        assert sorted(report.reached) == ["early", "late"] and report.dropped == ()
        got = late.wait(2, HANG_S)  # it is in the group: waits for the announced version
        assert got is not None and got.version == 2
        assert_equal(got.tensors, state)
        assert_equal(receive(early, 2).tensors, state)
        assert late.poll() is None  # v1 was before its time: it never had it
        assert early.errors() == [] and late.errors() == []
    finally:
        early.close()
        late.close()
        hub.close()


def test_members_follow_a_restarted_hub_on_the_same_port(hub_port: int) -> None:
    """A learner that restarts hosts a new hub at the same address: its members join it by themselves."""
    hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=1024, timeout_s=10)
    member = BroadcastMember("w", timeout_s=10)
    try:
        member.join(HOST, hub_port)
        wait_for("the member joins", lambda: hub.waiting() == 1)
        assert broadcast_within(hub, state_dict(1), 1).reached == ("w",)
        assert receive(member, 1).version == 1
        hub.close()

        hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=1024, timeout_s=10)
        wait_for("the member joins the new hub", lambda: hub.waiting() == 1)
        state = state_dict(2)
        assert broadcast_within(hub, state, 2).reached == ("w",)
        assert_equal(receive(member, 2).tensors, state)
    finally:
        member.close()
        hub.close()


def test_a_bucket_whose_bytes_do_not_match_the_digest_is_refused() -> None:
    bucket = torch.arange(64, dtype=torch.float32)
    expected = digest(bucket)
    check_bucket(bucket, expected, 0)  # intact: accepted
    bucket[17] = -1.0
    with pytest.raises(BroadcastError, match="bucket 3: sha256"):
        check_bucket(bucket, expected, 3)


def test_a_member_given_a_wrong_digest_delivers_nothing_and_joins_again(
    hub_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=1 << 20, timeout_s=10)
    member = BroadcastMember("w", timeout_s=10)
    try:
        member.join(HOST, hub_port)
        wait_for("the member joins", lambda: hub.waiting() == 1)
        with monkeypatch.context() as patch:
            patch.setattr(weight_broadcast, "digest", lambda buffer: "0" * 64)
            broadcast_within(hub, state_dict(1), 1)
        errors: list[str] = []
        wait_for("the member reports the bad digest", lambda: bool(errors.extend(member.errors()) or errors))
        assert "sha256" in errors[0]
        assert member.poll() is None  # the refused version is not handed out
        assert member.wait(1, HANG_S) is None  # nor waited for: it is in no group until it is called again

        wait_for("the member joins anew", lambda: hub.waiting() == 1)
        state = state_dict(2)
        report = broadcast_within(hub, state, 2)  # its old ticket is not waited for: it joined anew
        assert report.reached == ("w",) and report.dropped == ()
        assert_equal(receive(member, 2).tensors, state)
    finally:
        member.close()
        hub.close()


def test_close_returns_while_the_member_is_blocked_in_a_receive(
    hub_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub stalls before sending (its timeout is far longer than the deadline); close still returns,
    the member hands out nothing afterwards, and its thread ends once the posted receive ends."""
    hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=1 << 20, timeout_s=600)
    member = BroadcastMember("w", timeout_s=600)
    hub_sending, member_waiting, release = threading.Event(), threading.Event(), threading.Event()
    real_start, real_await = weight_broadcast.start_broadcast, weight_receive.await_work

    def stalled_start(group: Any, tensor: torch.Tensor) -> Any:
        hub_sending.set()
        release.wait(HANG_S)
        return real_start(group, tensor)

    def observed_await(*args: Any, **kwargs: Any) -> None:
        member_waiting.set()
        real_await(*args, **kwargs)

    monkeypatch.setattr(weight_broadcast, "start_broadcast", stalled_start)
    monkeypatch.setattr(weight_receive, "await_work", observed_await)
    member.join(HOST, hub_port)
    thread = member._thread
    assert thread is not None
    try:
        wait_for("the member joins", lambda: hub.waiting() == 1)
        sender = threading.Thread(target=hub.broadcast, args=(state_dict(1), 1), daemon=True)
        sender.start()
        wait_for("the hub stalls before its first bucket", hub_sending.is_set)
        wait_for("the member waits for that bucket", member_waiting.is_set)

        closer = threading.Thread(target=member.close, daemon=True)
        closer.start()
        closer.join(HANG_S)
        assert not closer.is_alive(), "close() blocked on a receive in flight"

        release.set()
        sender.join(HANG_S)
        assert not sender.is_alive()
        thread.join(HANG_S)
        assert not thread.is_alive(), "the member's thread outlived its receive"
        assert member.poll() is None
    finally:
        release.set()
        member.close()
        hub.close()


def test_the_manifest_packs_whole_tensors_aligned_into_bounded_buckets() -> None:
    specs = [
        ("a", "bfloat16", (3,)),
        ("b", "float32", (5,)),
        ("c", "float32", (2, 50)),
        ("d", "float32", ()),
        ("e", "int8", (3,)),
        ("f", "float32", (100,)),
    ]
    manifest = plan(7, specs, bucket_bytes=256, sample=lambda name: (1.0, 2.0))
    assert Manifest.from_json(manifest.to_json()) == manifest
    layout = [[(e.name, e.offset) for e in b.entries] for b in manifest.buckets]
    # a bucket closes before the tensor that would overflow it; a 400 B tensor goes alone; within a bucket
    # the widest dtypes come first, so every offset is a multiple of its element size
    assert layout == [[("b", 0), ("a", 20)], [("c", 0)], [("d", 0), ("e", 4)], [("f", 0)]]
    assert [b.nbytes for b in manifest.buckets] == [26, 400, 7, 400]
    assert [b.sample.name if b.sample else None for b in manifest.buckets] == ["a", "c", "d", "f"]
    assert manifest.buckets[0].sample == Sample("a", (1.0, 2.0))
    assert manifest.nbytes == 3 * 2 + 5 * 4 + 100 * 4 + 4 + 3 + 400
    gap = manifest.to_json().replace('["a", "bfloat16", [3], 20]', '["a", "bfloat16", [3], 22]')
    with pytest.raises(BroadcastError, match="at byte 22, expected 20"):
        Manifest.from_json(gap)


def test_the_sampled_tensor_is_one_sglang_reads_right() -> None:
    entries = [
        Entry("model.layers.0.self_attn.k_proj.weight", "bfloat16", (4, 8), 0),
        Entry("model.layers.0.self_attn.v_proj.weight", "bfloat16", (4, 8), 64),
        Entry("empty", "bfloat16", (0,), 128),
        Entry("mask", "int8", (4,), 128),
        Entry("model.embed_tokens.weight", "bfloat16", (SAMPLE_MAX_NUMEL + 1,), 132),
        Entry("model.layers.0.self_attn.q_proj.weight", "bfloat16", (2, 8), 132 + 2 * (SAMPLE_MAX_NUMEL + 1)),
        Entry("model.layers.0.self_attn.o_proj.weight", "bfloat16", (8, 2), 164 + 2 * (SAMPLE_MAX_NUMEL + 1)),
    ]
    # the smallest, first of equals, not over SAMPLE_MAX_NUMEL (SGLang lists the whole tensor to answer);
    # never k_proj or v_proj
    chosen = sample_entry(entries)
    assert chosen is not None and chosen.name.endswith("q_proj.weight")
    assert sample_entry(entries[:5]) is None
    assert sample_rows((4096,)) == SAMPLE_VALUES and sample_rows((10, 8)) == 4 and sample_rows((3, 4096)) == 1
    assert sample_mismatch([1.0, -2.0], [1.0, -2.0, 7.0]) == ""
    assert sample_mismatch([1.0, 2.0], [1.0, 2.0 * (1 + 2**-9)]) == ""  # within one bfloat16 rounding
    assert "value 1" in sample_mismatch([1.0, 2.0], [1.0, 2.1])
    assert "1 values" in sample_mismatch([1.0, 2.0], [1.0])


def test_the_torch_engine_loads_a_broadcast_version_and_refuses_a_wrong_one(
    hub_port: int, tmp_path: Path
) -> None:
    """A learner's model state (another seed) broadcast to a member and loaded into a worker's engine."""
    from actors.engine import SamplingParams, WeightLoadError
    from actors.engines.torch_engine import TorchEngine
    from april.hf import load_model, make_tiny_model

    engine = TorchEngine(make_tiny_model(tmp_path / "worker", seed=0), slots=2, sampling=SamplingParams())
    learner_state = {
        k: v.detach().clone()
        for k, v in load_model(make_tiny_model(tmp_path / "learner", seed=1)).state_dict().items()
    }
    assert isinstance(engine, TensorLoading)
    hub = BroadcastHub(HOST, hub_port, HOST, bucket_bytes=64 << 10, timeout_s=10)
    member = BroadcastMember("w", timeout_s=10)
    try:
        member.join(HOST, hub_port)
        wait_for("the member joins", lambda: hub.waiting() == 1)
        report = broadcast_within(hub, learner_state, 3)
        assert report.reached == ("w",) and report.buckets < len(learner_state)
        got = receive(member, 3)
    finally:
        member.close()
        hub.close()
    engine.load_tensors(got.tensors, got.version)
    assert engine.version == 3
    assert_equal(engine.model.state_dict(), learner_state)

    name = next(iter(learner_state))
    with pytest.raises(WeightLoadError, match="has shape"):
        engine.load_tensors({**got.tensors, name: torch.zeros(1, 1)}, 4)
    with pytest.raises(WeightLoadError, match="broadcast v5 has 1 unexpected"):
        engine.load_tensors({**got.tensors, "extra": torch.zeros(1)}, 5)
    assert engine.version == 3  # a refused version leaves the old weights serving
    assert_equal(engine.model.state_dict(), learner_state)
    engine.close()
