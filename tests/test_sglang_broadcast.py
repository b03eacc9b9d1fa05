"""The learner's broadcast into SGLang servers, over gloo on loopback: `learner.weight_broadcast.BroadcastHub`
sending, a worker's `actors.weight_receive.BroadcastMember` having its servers join (through
`SGLangEngine.broadcast_servers`), and `SGLangEngine.load_broadcast` posting each version's buckets to the
rebuilt servers (tests/sglang_server.py), which join a real gloo group the way SGLang does, receive real
broadcasts, hold the tensors and answer /get_weights_by_name. The test thread plays the worker loop (it
takes the member's offer and loads it). Tiny random Llama models; deadlines only say "did not hang".
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_server import FakeSGLangServer
from test_weight_broadcast import receive

import learner.weight_broadcast as weight_broadcast
from actors.engine import (
    EngineUnavailable,
    GenerationRequest,
    WeightLoadError,
    WeightsLost,
    run_to_completion,
)
from actors.engines.sglang_engine import SGLangEngine
from actors.weight_receive import BroadcastMember, Invite, Offer
from april.broadcast_group import BroadcastError
from april.hf import make_tiny_model
from april.ports import free_ports
from learner.weight_broadcast import BroadcastHub, BroadcastReport

HANG_S = 60.0
HOST = "127.0.0.1"
PROMPT = np.array([5, 6, 7, 8], dtype=np.int32)


def wait_for(what: str, check: Callable[[], bool], deadline_s: float = HANG_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"did not happen within {deadline_s:g} s: {what}"
        time.sleep(0.05)


def learner_state(launch: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The launch weights moved a little (seeded by `version`), norms in fp32, the rest in bf16: mixed
    dtypes in the buckets, as a learner's state can be."""
    gen = torch.Generator().manual_seed(version)
    return {
        k: (v + 0.05 * torch.randn(v.shape, generator=gen)).to(
            torch.float32 if "norm" in k else torch.bfloat16
        )
        for k, v in launch.items()
    }


@dataclass
class Setup:
    """A hub, an SGLang engine over fake servers holding `launch`, and the engine's broadcast member."""

    hub: BroadcastHub
    engine: SGLangEngine
    servers: list[FakeSGLangServer]
    member: BroadcastMember
    launch: dict[str, torch.Tensor]
    model_dir: Path
    others: list[BroadcastMember] = field(default_factory=list)

    def send(
        self, state: dict[str, torch.Tensor], version: int
    ) -> tuple[BroadcastReport, Offer | None, Exception | None]:
        """The hub broadcasts on a thread while this thread, as the worker loop, takes the offer and
        loads it: the report, the offer, and what the load raised."""
        reports: list[BroadcastReport] = []
        thread = threading.Thread(
            target=lambda: reports.append(self.hub.broadcast(state, version)), daemon=True
        )
        thread.start()
        offers: list[Offer] = []

        def offered() -> bool:
            offer = self.member.offer()
            if offer is not None:
                offers.append(offer)
            return bool(offers) or not thread.is_alive()

        wait_for(f"v{version} offered (errors: {self.member.errors()})", offered)
        raised: Exception | None = None
        if offers:
            assert offers[0].version == version
            try:
                self.engine.load_broadcast(offers[0])
            except (WeightLoadError, EngineUnavailable) as e:
                raised = e
        thread.join(HANG_S)
        assert not thread.is_alive(), f"broadcast of v{version} did not return"
        return reports[0], (offers[0] if offers else None), raised


def holds(server: FakeSGLangServer, state: dict[str, torch.Tensor]) -> bool:
    """Whether the server holds `state` exactly (every tensor read back whole by name, as floats)."""
    held = server.rt.held
    assert held is not None
    for name, tensor in state.items():
        got = held.get_weights_by_name(name, 1 << 30)
        if got is None or not torch.equal(torch.tensor(got, dtype=torch.float32), tensor.float()):
            return False
    return True


def greedy(engine: SGLangEngine) -> list[int]:
    (out,) = run_to_completion(engine, [GenerationRequest(1, PROMPT, 8, greedy=True)])
    return [int(t) for t in out.token_ids]


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Callable[..., Setup]]:
    made: list[Setup] = []

    def make(
        servers: int = 2,
        timeout_s: float = 20.0,
        architecture: str = "llama",
        torch_member: bool = False,
        version: str = "0.5.23",
    ) -> Setup:
        n = len(made)
        model_dir = make_tiny_model(tmp_path / f"launch-{n}", seed=0, kv_heads=2, architecture=architecture)
        fakes = [
            FakeSGLangServer(model_dir=str(model_dir), health_poll_s=0.01, version=version)
            for _ in range(servers)
        ]
        for fake in fakes:
            fake.start()
        engine = SGLangEngine([f.url for f in fakes], slots=2, weights_dir=tmp_path / f"dirs-{n}")
        port = free_ports(1)[0]
        hub = BroadcastHub(HOST, port, HOST, bucket_bytes=64 << 10, timeout_s=timeout_s)
        member = BroadcastMember("w", timeout_s=timeout_s, servers=engine.broadcast_servers)
        launch = load_file(str(model_dir / "model.safetensors"))
        made.append(s := Setup(hub, engine, fakes, member, launch, model_dir))
        if torch_member:
            s.others.append(BroadcastMember("t", timeout_s=timeout_s))
        for m in [member, *s.others]:
            m.join(HOST, port)
        return s

    yield make
    for s in made:
        for m in [s.member, *s.others]:
            m.close()
        s.hub.close()
        s.engine.close()
        for fake in s.servers:
            fake.stop()


def test_versions_reach_sglang_servers_and_a_torch_member_in_one_group(
    setup: Callable[..., Setup], monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[int] = []
    real_digest = weight_broadcast.digest
    monkeypatch.setattr(weight_broadcast, "digest", lambda b: hashed.append(b.numel()) or real_digest(b))
    s = setup(servers=2, torch_member=True)
    wait_for("both members join", lambda: s.hub.waiting() == 2)
    before = greedy(s.engine)
    for version in (1, 2):
        state = learner_state(s.launch, version)
        reads = [len(f.rt.weights_reads) for f in s.servers]
        report, offer, raised = s.send(state, version)
        assert raised is None and offer is not None
        assert sorted(report.reached) == ["t", "w"] and report.dropped == () and report.error == ""
        assert 1 < report.buckets < len(state)  # buckets, not one broadcast per tensor
        assert s.engine.version == version and all(f.rt.weight_version == str(version) for f in s.servers)
        assert all(holds(f, state) for f in s.servers)
        # every server received each bucket as one flattened broadcast, and was read back: one sampled
        # tensor a bucket
        samples = [b.sample.name for b in offer.manifest.buckets if b.sample is not None]
        assert len(samples) == report.buckets
        for fake, n in zip(s.servers, reads, strict=True):
            assert fake.rt.distributed_updates[-report.buckets :] == [
                [e.name for e in b.entries] for b in offer.manifest.buckets
            ]
            assert fake.rt.weights_reads[n:] == samples
        got = receive(s.others[0], version)
        assert sorted(got.tensors) == sorted(state)
        assert all(torch.equal(got.tensors[k], v) for k, v in state.items())
    assert greedy(s.engine) != before  # the toy model's tokens follow the weights the servers hold
    assert len(hashed) == 2 * report.buckets  # the torch member checks each bucket's sha256
    assert sorted(s.hub.members) == ["t", "w"]  # one generation for both versions


@pytest.mark.parametrize(("version", "bracket"), [("0.5.23", True), ("0.5.21", True), ("0.5.6", False)])
def test_each_version_is_posted_bucket_by_bucket_then_read_back(
    setup: Callable[..., Setup], version: str, bracket: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What one server is asked per version: one update per bucket (flattened, in the hub's order, the
    weight_version on the last only) inside begin/end from 0.5.21, a cache flush, then its weight_version
    and one sampled tensor a bucket. With only servers in the group the hub hashes nothing."""
    hashed: list[int] = []
    real_digest = weight_broadcast.digest
    monkeypatch.setattr(weight_broadcast, "digest", lambda b: hashed.append(b.numel()) or real_digest(b))
    s = setup(servers=1, version=version)
    wait_for("the member joins", lambda: s.hub.waiting() == 1)
    fake = s.servers[0]
    assert s.send(learner_state(s.launch, 1), 1)[2] is None  # the group forms: /init_weights_update_group
    fake.calls.clear()
    report, offer, raised = s.send(learner_state(s.launch, 2), 2)
    assert raised is None and offer is not None and report.reached == ("w",)
    paths = [p for _, p in fake.calls if p != "/server_info"]
    updates = ["/update_weights_from_distributed"] * report.buckets
    posted = ["/begin_weight_update", *updates, "/end_weight_update"] if bracket else updates
    assert paths == [*posted, "/flush_cache", "/model_info", *["/get_weights_by_name"] * report.buckets]
    assert fake.rt.weight_version == "2" and not fake.rt.session_open
    assert hashed == []


@pytest.mark.parametrize(("fault", "on_disk"), [("flip", True), ("drop", False)])
def test_an_update_received_wrong_or_not_applied_is_caught(
    setup: Callable[..., Setup], fault: str, on_disk: bool, tmp_path: Path
) -> None:
    """The server says success; reading back a sampled tensor shows it does not hold what was sent. With
    the current version on disk every server reloads it and the load fails (WeightLoadError); with none
    (it came by broadcast) the engine is unavailable until a file brings a version again (WeightsLost),
    its version never going back. The failed version then comes by file; the next broadcast is taken."""
    s = setup(servers=2)
    wait_for("the member joins", lambda: s.hub.waiting() == 1)
    states = {v: learner_state(s.launch, v) for v in (1, 2, 3)}
    files = {v: tmp_path / f"v{v:06d}.safetensors" for v in states}
    for v, state in states.items():
        save_file(state, str(files[v]))
    if on_disk:
        s.engine.load_weights(files[1], 1)
    else:
        assert s.send(states[1], 1)[2] is None
    s.servers[1].fault_next_update(fault)
    report, _, raised = s.send(states[2], 2)
    assert report.reached == ("w",)  # the hub's part went through: the fault is the server's
    assert raised is not None and "does not hold what was sent" in str(raised)
    assert s.engine.version == 1
    if on_disk:
        assert isinstance(raised, WeightLoadError) and not isinstance(raised, EngineUnavailable)
        assert all(holds(f, states[1]) for f in s.servers)  # v1 again, whole
    else:
        assert isinstance(raised, WeightsLost) and raised.version == 1
        with pytest.raises(WeightsLost):  # down until a version is loaded again
            s.engine.probe()
    s.engine.load_weights(files[2], 2)  # the network transport brings the file; the disk path loads it
    s.engine.probe()
    assert all(holds(f, states[2]) for f in s.servers)

    report, _, raised = s.send(states[3], 3)
    assert raised is None and report.reached == ("w",) and s.engine.version == 3
    assert all(holds(f, states[3]) for f in s.servers)


def test_a_server_that_misses_its_bucket_fails_the_version_within_the_timeout(
    setup: Callable[..., Setup],
) -> None:
    """One server refuses one update call (it never takes its broadcast): the hub gives up after its
    timeout, the load fails with whole weights serving, and the member joins anew for the next version."""
    s = setup(servers=2, timeout_s=3.0)
    wait_for("the member joins", lambda: s.hub.waiting() == 1)
    s.servers[1].fail_next("/update_weights_from_distributed", 503, {"error": {"message": "busy"}})
    report, _, raised = s.send(learner_state(s.launch, 1), 1)
    assert report.error and report.dropped == ("w",)
    assert isinstance(raised, WeightsLost) and s.engine.version == 0  # the launch weights: not on disk
    assert all(not f.rt.session_open for f in s.servers)  # the weight-update session was closed
    s.engine.load_weights(s.model_dir / "model.safetensors", 0)  # what the worker does: a file, loaded
    s.engine.probe()
    assert all(holds(f, s.launch) for f in s.servers)

    wait_for("the member joins anew", lambda: s.hub.waiting() == 1)
    state = learner_state(s.launch, 2)
    report, _, raised = s.send(state, 2)
    assert raised is None and report.reached == ("w",) and all(holds(f, state) for f in s.servers)


def test_a_killed_server_rejoins_a_later_generation(setup: Callable[..., Setup], tmp_path: Path) -> None:
    s = setup(servers=2)
    wait_for("the member joins", lambda: s.hub.waiting() == 1)
    assert s.send(learner_state(s.launch, 1), 1)[2] is None

    s.servers[1].stop()
    s.servers[1].start()  # its launch weights and weight_version, and no group
    assert s.servers[1].rt.groups.groups == {}
    with pytest.raises(WeightsLost) as lost:  # v1 came by broadcast: no copy on disk to reload
        s.engine.probe()
    assert lost.value.version == 1 and s.engine.version == 1
    file = tmp_path / "v000001.safetensors"  # what the worker then fetches and loads
    save_file(learner_state(s.launch, 1), str(file))
    s.engine.load_weights(file, 1)
    s.engine.probe()
    s.member.rejoin()  # what the worker does when its engine comes back
    wait_for("the member joins anew", lambda: s.hub.waiting() == 1)

    state = learner_state(s.launch, 2)
    report, _, raised = s.send(state, 2)
    assert raised is None and report.reached == ("w",) and report.dropped == ()
    assert s.engine.version == 2 and all(holds(f, state) for f in s.servers)
    # the surviving server left the old generation's group: only the new one is held
    assert all(len(f.rt.groups.groups) == 1 for f in s.servers)


def test_servers_that_cannot_say_what_they_hold_do_not_join(setup: Callable[..., Setup]) -> None:
    """Qwen3 in SGLang has no get_weights_by_name: a broadcast into it could not be checked, so the member
    never asks the hub for a rank, and its versions come by the other transports."""
    s = setup(servers=1, architecture="qwen3")
    assert s.engine.broadcast_servers.ranks() == 0
    time.sleep(1.5)  # the member asked and will not take a ticket
    assert s.hub.waiting() == 0
    report = s.hub.broadcast(learner_state(s.launch, 1), 1)
    assert report.reached == () and report.buckets == 0


# -- SGLang's own receive code ----------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
SGLANG_PYTHON = Path(os.environ.get("APRIL_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))


class SGLangReceiver:
    """`GroupServers` over tests/sglang_receive.py: one SGLang rank whose join, receive and leave are the
    wheel's own WeightUpdater code, in the SGLang virtualenv."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [str(SGLANG_PYTHON), str(ROOT / "tests" / "sglang_receive.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lock = threading.Lock()

    def ask(self, **command: Any) -> dict[str, Any]:
        with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        assert line, f"sglang_receive.py exited ({self.proc.poll()})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ranks(self) -> int:
        return 1

    def join(self, invite: Invite) -> None:
        answer = self.ask(
            op="init",
            master_address=invite.master_address,
            master_port=invite.master_port,
            rank_offset=invite.rank_offset,
            world_size=invite.world_size,
            group_name=invite.group_name,
            backend=invite.backend,
        )
        if not answer["success"]:
            raise BroadcastError(answer["message"])

    def leave(self, group_name: str) -> None:
        self.ask(op="destroy", group_name=group_name)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(HANG_S)


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def sglang_receives(
    hub: BroadcastHub,
    member: BroadcastMember,
    receiver: SGLangReceiver,
    state: dict[str, torch.Tensor],
    version: int,
) -> tuple[BroadcastReport, dict[str, Any]]:
    """The hub broadcasts `version` on a thread; the receiver takes each bucket of the member's offer as
    an SGLang server does: the report, and what it rebuilt (name -> [dtype, shape, sha256])."""
    reports: list[BroadcastReport] = []
    thread = threading.Thread(target=lambda: reports.append(hub.broadcast(state, version)), daemon=True)
    thread.start()
    offers: list[Offer] = []

    def offered() -> bool:
        offer = member.offer()
        if offer is not None:
            offers.append(offer)
        return bool(offers)

    wait_for(f"v{version} offered", offered)
    got: dict[str, Any] = {}
    for bucket in offers[0].manifest.buckets:
        answer = receiver.ask(
            op="receive",
            names=[e.name for e in bucket.entries],
            dtypes=[e.dtype for e in bucket.entries],
            shapes=[list(e.shape) for e in bucket.entries],
            group_name=offers[0].group_name,
            load_format="flattened_bucket",
        )
        assert "error" not in answer, answer
        got.update(answer["tensors"])
    thread.join(HANG_S)
    assert not thread.is_alive(), f"broadcast of v{version} did not return"
    return reports[0], got


@pytest.mark.sglang
def test_sglangs_own_receive_code_joins_the_group_and_rebuilds_every_tensor() -> None:
    """The hub's rendezvous and bucket layout against SGLang's WeightUpdater (init_custom_process_group,
    FlattenedTensorBucket) from the wheel, in one group with a torch member: mixed dtypes with odd sizes,
    buckets of several tensors, two versions."""
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"no SGLang virtualenv at {SGLANG_PYTHON} (set APRIL_SGLANG_PYTHON)")
    receiver = SGLangReceiver()
    port = free_ports(1)[0]
    hub = BroadcastHub(HOST, port, HOST, bucket_bytes=256, timeout_s=60)
    members = [BroadcastMember("sglang", 60, servers=receiver), BroadcastMember("t", 60)]
    try:
        for m in members:
            m.join(HOST, port)
        wait_for("both members join", lambda: hub.waiting() == 2, 120)
        for version in (1, 2):
            gen = torch.Generator().manual_seed(version)
            state = {
                "embed.weight": torch.randn(7, 33, generator=gen).to(torch.bfloat16),
                "norm.weight": torch.randn(5, generator=gen),
                "scale": torch.randn((), generator=gen, dtype=torch.float64),
                "mask": torch.randint(-100, 100, (3,), generator=gen, dtype=torch.int8),
                **{
                    f"layers.{i}.weight": torch.randn(3, 11, generator=gen).to(torch.bfloat16)
                    for i in range(6)
                },
            }
            report, got = sglang_receives(hub, members[0], receiver, state, version)
            assert sorted(report.reached) == ["sglang", "t"] and report.buckets > 2
            want = {
                n: [str(t.dtype).removeprefix("torch."), list(t.shape), sha256(t)] for n, t in state.items()
            }
            assert got == want
            tensors = receive(members[1], version).tensors
            assert all(torch.equal(tensors[n], t) for n, t in state.items())
    finally:
        for m in members:
            m.close()
        hub.close()
        receiver.close()
