"""Security guarantees (issue 7): CurveZMQ keys, who the broker lets in, and binding beyond loopback.

Real sockets on free loopback ports against a real `Broker` serving in a thread: a client with the keys
of `april keys generate` is served; a stranger with its own keys, or with no CURVE at all, gets nothing
and the broker counts the refusal; a non-loopback bind needs keys.
"""

from __future__ import annotations

import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zmq
from harness import free_ports, wait_for
from typer.testing import CliRunner

from april import keys, protocol
from april.config import load_config
from april.keys import ClientKeys, KeysError
from april.transport import dealer, recv, send
from broker.server import Broker
from cli.broker_cmd import BrokerStartError, check_bind_host
from cli.dashboard_feed import StatusFeed
from cli.main import app
from cli.status_cmd import StatusError, fetch_status

runner = CliRunner()
SILENCE_S = 1.5  # a refused client hears nothing for this long (the broker answers in milliseconds)


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("april: error: "), output
    return lines[0]


# ---------------------------------------------------------------------------------------- key files


def test_generate_creates_both_pairs_secrets_0600_and_authorises_the_client(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    result = runner.invoke(app, ["keys", "generate", str(d)])
    assert result.exit_code == 0, result.output
    for name in ("broker", "client", "weights"):
        assert stat.S_IMODE((d / f"{name}.key_secret").stat().st_mode) == 0o600
        public, secret = zmq.auth.load_certificate(d / f"{name}.key_secret")
        assert secret is not None and zmq.curve_public(secret) == public
        assert zmq.auth.load_certificate(d / f"{name}.key") == (public, None)  # no secret in the public file
    assert (d / "authorized" / "client.key").read_bytes() == (d / "client.key").read_bytes()
    assert not list(d.glob(".staging-*"))
    client = keys.client_keys(d)
    server = keys.server_keys(d)
    assert client.server_public == server.public != client.public


def test_generate_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert runner.invoke(app, ["keys", "generate", str(d)]).exit_code == 0
    before = (d / "broker.key_secret").read_bytes()
    result = runner.invoke(app, ["keys", "generate", str(d)])
    assert result.exit_code == 2
    assert "exists: not overwriting keys (pass --force" in one_error_line(result.output)
    assert (d / "broker.key_secret").read_bytes() == before
    assert runner.invoke(app, ["keys", "generate", str(d), "--force"]).exit_code == 0
    assert (d / "broker.key_secret").read_bytes() != before


def test_add_client_makes_a_copyable_directory_and_authorises_it(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    keys.generate(d)
    result = runner.invoke(app, ["keys", "add-client", str(d), "node7"])
    assert result.exit_code == 0, result.output
    node = keys.client_keys(d / "clients" / "node7")
    assert node.server_public == keys.server_keys(d).public
    fetching = keys.weights_client_keys(d / "clients" / "node7")  # the weight service's key travels too
    assert fetching.server_public == keys.weights_server_keys(d).public != node.server_public
    assert stat.S_IMODE((d / "clients" / "node7" / "client.key_secret").stat().st_mode) == 0o600
    assert zmq.utils.z85.decode(node.public) in keys.authorized_keys(d / "authorized")
    again = runner.invoke(app, ["keys", "add-client", str(d), "node7"])
    assert again.exit_code == 2 and "not overwriting" in one_error_line(again.output)
    bad = runner.invoke(app, ["keys", "add-client", str(d), "../x"])
    assert bad.exit_code == 2 and "plain file name" in one_error_line(bad.output)


def test_missing_or_corrupt_client_keys_are_one_error_line(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["status", "--keys", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "no such directory" in one_error_line(missing.output)
    d = tmp_path / "keys"
    keys.generate(d)
    secret = d / "client.key_secret"
    secret.write_text(secret.read_text().replace('secret-key = "', 'secret-key = "x'))
    corrupt = runner.invoke(app, ["status", "--keys", str(d)])
    assert corrupt.exit_code == 2 and "client.key_secret is corrupt" in one_error_line(corrupt.output)
    keys.generate(d, force=True)
    (d / "broker.key").unlink()
    with pytest.raises(KeysError, match=r"broker\.key"):
        keys.client_keys(d)


# ---------------------------------------------------------------------------------------- a CURVE broker


@dataclass
class CurveBroker:
    broker: Broker
    keys_dir: Path
    worker: str
    learner: str
    pub: str

    def rejected(self, reason: str) -> int:
        return self.broker.rejections.by_reason.get(reason, 0)


def _serve(tmp_path: Path, bind_host: str, keys_dir: Path, **broker: object) -> Iterator[CurveBroker]:
    ports = free_ports(3)
    overrides: dict[str, object] = {
        "broker.bind_host": bind_host,
        "broker.worker_port": ports[0],
        "broker.learner_port": ports[1],
        "broker.pub_port": ports[2],
        "broker.curve_keys_dir": str(keys_dir),
        "broker.heartbeat_interval_s": 0.2,
        **{f"broker.{k}": v for k, v in broker.items()},
    }
    b = Broker(load_config(overrides=overrides), tmp_path / "run")
    b.bind()
    stop = threading.Event()
    thread = threading.Thread(target=b.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    try:
        yield CurveBroker(b, keys_dir, *(f"tcp://127.0.0.1:{p}" for p in ports))
    finally:
        stop.set()
        thread.join(60)
        b.close()


@pytest.fixture
def curve_broker(tmp_path: Path) -> Iterator[CurveBroker]:
    keys.generate(tmp_path / "keys")
    yield from _serve(tmp_path, "127.0.0.1", tmp_path / "keys", max_message_bytes=1 << 20)


def stranger_keys(server_public: bytes) -> ClientKeys:
    public, secret = zmq.curve_keypair()
    return ClientKeys(public, secret, server_public)


def test_a_client_with_the_keys_is_served_on_every_socket(curve_broker: CurveBroker) -> None:
    client = keys.client_keys(curve_broker.keys_dir)
    status = fetch_status(curve_broker.learner, 60, client)
    assert status.rejected.total == 0
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, curve_broker.worker, "w0", curve=client)
    try:
        send(sock, protocol.WorkerHello("w0", "sim", 2, 0, 1, "h", np.zeros(0, np.int64)))
        assert isinstance(recv(sock, 60_000), protocol.Welcome)
    finally:
        sock.close(linger=0)
        ctx.term()
    with StatusFeed(curve_broker.pub, client) as feed:
        published = feed.wait(60)
    assert published is not None and published.mode == "april"
    assert curve_broker.broker.gate is not None and curve_broker.broker.gate.zap.accepted >= 3


def test_a_stranger_with_its_own_keys_gets_nothing_and_is_counted(curve_broker: CurveBroker) -> None:
    server_public = keys.server_keys(curve_broker.keys_dir).public
    stranger = stranger_keys(server_public)
    with pytest.raises(StatusError, match="no broker answered"):
        fetch_status(curve_broker.learner, SILENCE_S, stranger)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, curve_broker.worker, "intruder", curve=stranger)
    try:
        send(sock, protocol.WorkerHello("intruder", "sim", 2, 0, 1, "h", np.zeros(0, np.int64)))
        assert recv(sock, int(SILENCE_S * 1000)) is None
    finally:
        sock.close(linger=0)
        ctx.term()
    with StatusFeed(curve_broker.pub, stranger) as feed:
        assert feed.wait(SILENCE_S) is None  # the status feed is closed to it too
    assert "intruder" not in curve_broker.broker.core.workers
    # learner, worker and PUB ports, retried (counted by the broker's thread, which may lag on a busy machine)
    wait_for(lambda: curve_broker.rejected("auth_refused") >= 3, 60, "three refusals counted")
    status = fetch_status(curve_broker.learner, 60, keys.client_keys(curve_broker.keys_dir))
    assert status.rejected.by_reason["auth_refused"] >= 3
    assert status.rejected.by_peer["127.0.0.1"]["auth_refused"] >= 3


def test_a_client_without_curve_gets_nothing(curve_broker: CurveBroker) -> None:
    with pytest.raises(StatusError, match="no broker answered"):
        fetch_status(curve_broker.learner, SILENCE_S)  # plain NULL mechanism: the handshake never completes
    with StatusFeed(curve_broker.pub) as feed:
        assert feed.wait(SILENCE_S) is None
    assert curve_broker.broker.learner is None and len(curve_broker.broker.core.workers) == 0
    # counted from the sockets' monitor events
    wait_for(lambda: curve_broker.rejected("handshake_failed") >= 2, 60, "two failed handshakes counted")


def test_a_client_that_does_not_know_the_broker_key_gets_nothing(curve_broker: CurveBroker) -> None:
    impostor = stranger_keys(zmq.curve_keypair()[0])  # talks CURVE to a broker key it made up
    with pytest.raises(StatusError, match="no broker answered"):
        fetch_status(curve_broker.learner, SILENCE_S, impostor)
    wait_for(lambda: curve_broker.rejected("handshake_failed") >= 1, 60, "the failed handshake counted")
    assert curve_broker.rejected("auth_refused") == 0  # it never got as far as ZAP


def test_a_key_added_while_running_is_accepted_without_restart(curve_broker: CurveBroker) -> None:
    newcomer = keys.client_keys(keys.add_client(curve_broker.keys_dir, "late"))
    assert fetch_status(curve_broker.learner, 60, newcomer).rejected.total == 0
    (curve_broker.keys_dir / "authorized" / "late.key").unlink()  # revoked: new connections are refused
    with pytest.raises(StatusError, match="no broker answered"):
        fetch_status(curve_broker.learner, SILENCE_S, newcomer)


def test_an_oversized_frame_is_dropped_and_the_broker_serves_on(curve_broker: CurveBroker) -> None:
    client = keys.client_keys(curve_broker.keys_dir)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    big = dealer(ctx, curve_broker.learner, "big", max_bytes=8 << 20, curve=client)
    try:
        big.send_multipart([bytes(protocol.encode(protocol.StatusRequest())[0]), b"x" * (2 << 20)])
        assert recv(big, int(SILENCE_S * 1000)) is None  # over MAXMSGSIZE (1 MiB): zmq drops the peer
    finally:
        big.close(linger=0)
        ctx.term()
    assert curve_broker.broker.learner_sock.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
    assert fetch_status(curve_broker.learner, 60, client).ledger_balanced


# ---------------------------------------------------------------------------------------- binding


def test_non_loopback_bind_needs_keys(tmp_path: Path) -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_bind_host(host, "")
    for host in ("0.0.0.0", "10.1.2.3", "head-node"):
        with pytest.raises(BrokerStartError, match="needs CurveZMQ keys: run `april keys generate DIR`"):
            check_bind_host(host, "")
        check_bind_host(host, str(tmp_path))
    result = runner.invoke(app, ["broker", "--run-dir", str(tmp_path / "run"), "--bind-host", "0.0.0.0"])
    assert result.exit_code == 2 and "broker.bind_host = '0.0.0.0'" in one_error_line(result.output)
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_a_broker_with_keys_binds_every_interface_and_serves_authorised_clients(tmp_path: Path) -> None:
    keys.generate(tmp_path / "keys")
    for served in _serve(tmp_path, "0.0.0.0", tmp_path / "keys"):
        assert fetch_status(served.learner, 60, keys.client_keys(served.keys_dir)).rejected.total == 0
        stranger = stranger_keys(keys.server_keys(served.keys_dir).public)
        with pytest.raises(StatusError):
            fetch_status(served.learner, SILENCE_S, stranger)
        wait_for(lambda s=served: s.rejected("auth_refused"), 60, "the refusal to be counted")


def test_a_broker_with_a_corrupt_authorised_key_does_not_start(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    keys.generate(d)
    (d / "authorized" / "junk.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(KeysError, match=r"junk\.key is corrupt"):
        next(_serve(tmp_path, "127.0.0.1", d))


# ---------------------------------------------------------------------------------------- weights


def test_weights_with_a_wrong_sha256_are_refused_counted_and_the_old_ones_kept(
    curve_broker: CurveBroker, tmp_path: Path
) -> None:
    """A real worker (sim engine, CURVE client keys) is told of weights whose file does not match the
    announced sha256: it does not load them, reports it (counted by the broker) and serves on; the next,
    matching announcement loads."""
    from actors.engine import Engine, SamplingParams
    from actors.factory import make_engine, make_tokenizer
    from actors.reward_runner import RewardRunner
    from actors.worker import Worker
    from april.config import WorkerConfig
    from april.files import sha256_file

    client = keys.client_keys(curve_broker.keys_dir)
    cfg = WorkerConfig(broker=curve_broker.worker, engine="sim", slots=2, worker_id="w-sha", sim_time_scale=0)
    worker: Worker

    def engine_factory(sampling: SamplingParams, version: int) -> Engine:
        return make_engine(cfg, sampling, worker.identify, version)

    worker = Worker(cfg, make_tokenizer(cfg), RewardRunner("exact", 10.0), engine_factory, 0, curve=client)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop.is_set,), daemon=True)
    thread.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    learner = dealer(ctx, curve_broker.learner, "l0", curve=client)
    try:
        peers = curve_broker.broker.core.workers.peers
        wait_for(lambda: "w-sha" in peers and worker.engine is not None, 60, "the worker to register")
        weights = tmp_path / "weights-v1.bin"
        weights.write_bytes(b"version one")
        send(learner, protocol.LearnerHello("l0", 0, 1))
        send(learner, protocol.WeightsReady(1, str(weights), "0" * 64))
        wait_for(lambda: curve_broker.rejected("weights_not_loaded") == 1, 60, "the refused load")
        assert worker.engine is not None and worker.engine.version == 0 and peers["w-sha"].version == 0
        send(learner, protocol.WeightsReady(2, str(weights), sha256_file(weights)))
        wait_for(lambda: peers["w-sha"].version == 2, 60, "the matching weights to load")
        assert thread.is_alive() and curve_broker.rejected("weights_not_loaded") == 1
    finally:
        learner.close(linger=0)
        ctx.term()
        stop.set()
        thread.join(60)
