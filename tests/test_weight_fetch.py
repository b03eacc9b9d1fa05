"""The network weights transport: the learner's WeightService and the worker's WeightFetcher over real
sockets on loopback, the transport each announced URI leads a worker to, and a worker that fetches.

Faults are injected at the service (paused: it reads requests and answers none; stopped and started
again on the same port; files pruned under it) or by a socket that never answers. Deadlines are "did not
hang" bounds, never speeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from harness import Cluster, wait_for
from scripted_engine import EngineScript
from test_engine_failures import NOISE, BareBroker, running_worker
from typer.testing import CliRunner

from actors.weight_fetch import Fetched, FetchFailed, FetchResult, WeightFetcher
from actors.weight_sync import BROADCAST, FILE, NETWORK, Ready, Unavailable, WeightSync
from april import keys, protocol
from april.config import WeightsConfig, WeightsTransport
from april.keys import KeysError
from april.ports import free_port_pair, free_ports
from april.weights_uri import WeightsLocation, parse
from cli.main import app
from learner.weight_service import WeightService, WeightServiceError, announce_location

DEADLINE_S = 60.0
CHUNK = 64 * 1024


def publish(weights_dir: Path, version: int, size: int) -> tuple[Path, bytes, str]:
    """A published version of `size` random bytes: (path, bytes, sha256)."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    path = weights_dir / f"v{version:06d}.safetensors"
    path.write_bytes(data)
    return path, data, hashlib.sha256(data).hexdigest()


def config(port: int, **overrides: object) -> WeightsConfig:
    values: dict[str, object] = {
        "port": port,
        "chunk_bytes": CHUNK,
        "window": 4,
        "timeout_s": 30.0,
        "keep": 2,
    }
    values.update(overrides)
    return WeightsConfig(**values)  # type: ignore[arg-type]


@contextmanager
def serving(weights_dir: Path, cfg: WeightsConfig, service_type: type[WeightService] = WeightService,
            server_keys: keys.ServerKeys | None = None) -> Iterator[WeightService]:  # fmt: skip
    service = service_type(weights_dir, cfg, server_keys)
    service.start()
    try:
        yield service
    finally:
        service.stop()


@contextmanager
def fetching(
    cfg: WeightsConfig, cache: Path, client_keys: keys.ClientKeys | None = None
) -> Iterator[WeightFetcher]:
    fetcher = WeightFetcher(cfg, cache, client_keys, identity="w0")
    try:
        yield fetcher
    finally:
        fetcher.close()


def location(service: WeightService, version: int, size: int) -> WeightsLocation:
    return WeightsLocation(version, service=service.endpoint, size=size)


def results_until(fetcher: WeightFetcher, done: type, version: int) -> list[FetchResult]:
    """Every result until one of type `done` for `version` (AssertionError if none within the deadline)."""
    seen: list[FetchResult] = []

    def arrived() -> bool:
        seen.extend(fetcher.poll())
        return any(isinstance(r, done) and r.version == version for r in seen)

    wait_for(arrived, DEADLINE_S, f"{done.__name__} for v{version}")
    return seen


class StallAfter(WeightService):
    """Fault injection: answers `chunks` chunks, then stops answering (reads on, answers nothing)."""

    chunks = 3

    def _answer(
        self, router: zmq.Socket[bytes], identity: bytes, request: protocol.WeightsChunkRequest
    ) -> None:
        super()._answer(router, identity, request)
        if sum(self.stats().chunks_served.values()) >= self.chunks:
            self.pause()


# ---------------------------------------------------------------------------------------- fetching


def test_a_version_comes_in_chunks_with_the_window_in_flight_and_lands_verified_in_the_cache(
    tmp_path: Path,
) -> None:
    _, data, sha = publish(tmp_path / "weights", 1, 10 * CHUNK + 123)  # 11 chunks, the last one short
    cfg = config(free_ports(1)[0], window=4)
    with serving(tmp_path / "weights", cfg) as service, fetching(cfg, tmp_path / "cache") as fetcher:
        service.pause()  # requests pile up unanswered: exactly the window, no more
        fetcher.fetch(location(service, 1, len(data)), sha)
        wait_for(lambda: len(service.stats().requests) >= 4, DEADLINE_S, "the window of requests")
        time.sleep(0.5)  # a fetcher past its window would have sent more by now
        assert len(service.stats().requests) == 4
        service.resume()
        (result,) = results_until(fetcher, Fetched, 1)
        stats = service.stats()
    assert isinstance(result, Fetched)
    assert result.path == tmp_path / "cache" / "v000001.safetensors" and result.bytes == len(data)
    assert result.path.read_bytes() == data
    assert list(stats.max_outstanding.values()) == [4]  # several in flight, never more than the window
    assert sorted(offset for _, _, offset, _ in stats.requests) == [i * CHUNK for i in range(11)]
    assert stats.chunks_served == {1: 11}
    assert not list((tmp_path / "cache").glob("*.part"))


def test_a_sha256_mismatch_is_refused_and_nothing_lands_in_the_cache(tmp_path: Path) -> None:
    _, data, _ = publish(tmp_path / "weights", 1, 3 * CHUNK)
    cfg = config(free_ports(1)[0])
    with serving(tmp_path / "weights", cfg) as service, fetching(cfg, tmp_path / "cache") as fetcher:
        fetcher.fetch(location(service, 1, len(data)), "0" * 64)
        (failed,) = results_until(fetcher, FetchFailed, 1)
    assert isinstance(failed, FetchFailed) and "sha256 of the fetched v1" in failed.reason
    assert not (tmp_path / "cache" / "v000001.safetensors").exists()


def test_a_dropped_connection_resumes_from_the_bytes_already_in(tmp_path: Path) -> None:
    _, data, sha = publish(tmp_path / "weights", 1, 16 * CHUNK)
    cfg = config(free_ports(1)[0], window=2)  # timeout_s 30: the drop, not a timeout, makes it reconnect
    with fetching(cfg, tmp_path / "cache") as fetcher:
        with serving(tmp_path / "weights", cfg, StallAfter) as first:
            fetcher.fetch(location(first, 1, len(data)), sha)
            wait_for(lambda: not first._answering.is_set(), DEADLINE_S, "3 chunks served")
            time.sleep(0.2)  # the 3 chunks reach the fetcher
        # the first service is gone (its connection dropped); a new one comes up on the same port
        with serving(tmp_path / "weights", cfg) as second:
            (result,) = results_until(fetcher, Fetched, 1)
            after = second.stats().requests
    assert isinstance(result, Fetched) and result.path.read_bytes() == data
    offsets = [offset for _, _, offset, _ in after]
    assert offsets[0] == 3 * CHUNK and sorted(offsets) == [i * CHUNK for i in range(3, 16)]


def test_a_version_pruned_mid_fetch_is_still_served_and_one_pruned_before_is_gone(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    v1, _, sha1 = publish(weights, 1, 2 * CHUNK)
    v2, data2, sha2 = publish(weights, 2, 8 * CHUNK)
    _, data3, sha3 = publish(weights, 3, 2 * CHUNK)
    v1.unlink()  # pruned before anyone asked for it
    cfg = config(free_ports(1)[0], window=2)
    with serving(weights, cfg, StallAfter) as service, fetching(cfg, tmp_path / "cache") as fetcher:
        fetcher.fetch(location(service, 2, len(data2)), sha2)
        wait_for(lambda: not service._answering.is_set(), DEADLINE_S, "3 chunks served")
        v2.unlink()  # pruned while the worker fetches it: served on from the open file
        service.chunks = 1_000
        service.resume()
        (fetched,) = results_until(fetcher, Fetched, 2)
        assert isinstance(fetched, Fetched) and fetched.path.read_bytes() == data2
        fetcher.fetch(location(service, 3, 2 * CHUNK), sha3)  # the newest, then an older one: ignored
        fetcher.fetch(location(service, 1, 2 * CHUNK), sha1)
        (newest,) = results_until(fetcher, Fetched, 3)
        assert isinstance(newest, Fetched) and newest.path.read_bytes() == data3
    with serving(weights, cfg) as service, fetching(cfg, tmp_path / "cache2") as fetcher:
        fetcher.fetch(location(service, 1, 2 * CHUNK), sha1)
        (gone,) = results_until(fetcher, FetchFailed, 1)
        assert isinstance(gone, FetchFailed) and gone.reason == "v1 is gone from the learner (it serves v3)"
        asked = len(service.stats().requests)
        assert 1 <= asked <= cfg.window  # the first window's requests
        time.sleep(1.5)  # past the first retry's backoff: a gone version is not asked for again
        assert len(service.stats().requests) == asked


def test_the_cache_keeps_the_newest_versions_only(tmp_path: Path) -> None:
    cfg = config(free_ports(1)[0], keep=2)
    published = {v: publish(tmp_path / "weights", v, CHUNK + v) for v in (1, 2, 3)}
    with serving(tmp_path / "weights", cfg) as service, fetching(cfg, tmp_path / "cache") as fetcher:
        for v, (_, data, sha) in published.items():
            fetcher.fetch(location(service, v, len(data)), sha)
            results_until(fetcher, Fetched, v)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "v000002.safetensors",
        "v000003.safetensors",
    ]


def test_a_service_that_never_answers_fails_the_fetch_once_and_it_is_retried(tmp_path: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts the connection, reads, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = free_ports(1)[0]
    silent.bind(f"tcp://127.0.0.1:{port}")
    cfg = config(port, timeout_s=0.5)
    requests = 0
    try:
        with fetching(cfg, tmp_path / "cache") as fetcher:
            fetcher.fetch(WeightsLocation(1, service=f"tcp://127.0.0.1:{port}", size=3 * CHUNK), "0" * 64)
            (failed,) = results_until(fetcher, FetchFailed, 1)
            assert (
                isinstance(failed, FetchFailed)
                and failed.reason == f"no answer from tcp://127.0.0.1:{port} for 0.5s"
            )
            deadline = time.monotonic() + DEADLINE_S
            while requests <= 4 and time.monotonic() < deadline:  # window 4 sent, then a retry asks again
                if silent.poll(100):
                    silent.recv_multipart()
                    requests += 1
            assert requests > 4
            assert fetcher.poll() == []  # reported once, not at every retry
    finally:
        silent.close()
        ctx.term()


def test_curve_a_client_without_the_right_keys_is_refused(tmp_path: Path) -> None:
    keys_dir, stranger_dir = tmp_path / "keys", tmp_path / "stranger"
    keys.generate(keys_dir)
    keys.generate(stranger_dir)  # a pair of its own, not authorised
    _, data, sha = publish(tmp_path / "weights", 1, 2 * CHUNK)
    cfg = config(free_ports(1)[0], timeout_s=2.0)
    with serving(tmp_path / "weights", cfg, server_keys=keys.weights_server_keys(keys_dir)) as service:
        stranger = keys.ClientKeys(
            *keys.read_pair(stranger_dir / "client.key_secret"), keys.read_public(keys_dir / "weights.key")
        )
        with fetching(cfg, tmp_path / "c1", stranger) as fetcher:
            fetcher.fetch(location(service, 1, len(data)), sha)
            (refused,) = results_until(fetcher, FetchFailed, 1)
        with fetching(cfg, tmp_path / "c2", None) as fetcher:  # no CURVE at all
            fetcher.fetch(location(service, 1, len(data)), sha)
            results_until(fetcher, FetchFailed, 1)
        assert service.stats().requests == []  # neither got a single request through
        with fetching(cfg, tmp_path / "c3", keys.weights_client_keys(keys_dir)) as fetcher:
            fetcher.fetch(location(service, 1, len(data)), sha)
            (fetched,) = results_until(fetcher, Fetched, 1)
    assert isinstance(refused, FetchFailed) and "refused this worker's CurveZMQ keys" in refused.reason
    assert isinstance(fetched, Fetched) and fetched.path.read_bytes() == data


def test_keys_without_the_weights_pair_and_open_binds_are_one_line_errors(tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    keys.generate(keys_dir)
    (keys_dir / "weights.key_secret").unlink()
    (keys_dir / "weights.key").unlink()
    with pytest.raises(KeysError, match=r"weights\.key_secret: no such file .*april keys add-weights"):
        keys.weights_server_keys(keys_dir)
    with pytest.raises(KeysError, match=r"weights\.key: no such file"):
        keys.weights_client_keys(keys_dir)
    keys.add_client(keys_dir, "node7")  # made while the directory had no weights pair
    assert not (keys_dir / "clients" / "node7" / "weights.key").exists()
    result = CliRunner().invoke(app, ["keys", "add-weights", str(keys_dir)])
    assert result.exit_code == 0, result.output
    assert keys.weights_client_keys(keys_dir).server_public == keys.weights_server_keys(keys_dir).public
    node = keys.weights_client_keys(keys_dir / "clients" / "node7")  # the copyable directory got it too
    assert node.server_public == keys.weights_server_keys(keys_dir).public
    again = CliRunner().invoke(app, ["keys", "add-weights", str(keys_dir)])
    assert again.exit_code == 2 and "not overwriting" in again.output
    open_bind = WeightService(tmp_path, config(free_ports(1)[0], bind_host="0.0.0.0"))
    with pytest.raises(WeightServiceError, match=r"^weights.bind_host = '0.0.0.0': binding a non-loopback"):
        open_bind.start()
    cfg = config(free_ports(1)[0])
    with serving(tmp_path, cfg), pytest.raises(WeightServiceError, match=rf"weights.port = {cfg.port}: busy"):
        WeightService(tmp_path, cfg).start()


# ---------------------------------------------------------------------------------------- which transport


def test_the_announced_uri_per_transport(tmp_path: Path) -> None:
    path, _, _ = publish(tmp_path / "weights", 7, 100)
    endpoint = "tcp://10.0.0.5:5558"
    file = parse(announce_location(WeightsTransport.FILE, path, endpoint).uri(), 7)
    auto = parse(announce_location(WeightsTransport.AUTO, path, endpoint).uri(), 7)
    network = parse(announce_location(WeightsTransport.NETWORK, path, endpoint).uri(), 7)
    broadcast = parse(announce_location(WeightsTransport.BROADCAST, path, endpoint).uri(), 7)
    assert file == WeightsLocation(7, path=str(path))
    assert auto == WeightsLocation(7, path=str(path), service=endpoint, size=100)
    assert network == WeightsLocation(7, service=endpoint, size=100)
    assert broadcast == WeightsLocation(7, service=endpoint, size=100, broadcast=True)
    assert announce_location(WeightsTransport.NETWORK, path, "") == file  # no service: the file


def ready_of(sync: WeightSync, version: int) -> Ready | Unavailable:
    found: list[Ready | Unavailable] = []

    def arrived() -> bool:
        found.extend(r for r in sync.poll() if r.version == version)
        return bool(found)

    wait_for(arrived, DEADLINE_S, f"v{version} synced")
    return found[0]


def test_broadcast_versions_come_from_the_group_and_the_rest_over_the_network(tmp_path: Path) -> None:
    """WeightSync with an engine that takes tensors, against a real hub and weight service: a version
    announced before its member is in a group comes over the network at once; one broadcast to the group
    comes from the broadcast; one the group never sends comes over the network once weights.timeout_s
    has passed."""
    pytest.importorskip("torch")
    import torch

    from learner.weight_broadcast import BroadcastHub

    port = free_port_pair()
    cfg = config(port, transport="broadcast", timeout_s=2.0)
    files = {v: publish(tmp_path / "weights", v, 2 * CHUNK) for v in (1, 2, 3)}
    sync = WeightSync(cfg, "w0", cache_dir=tmp_path / "cache")
    sync.accept_broadcast("cpu")
    hub = BroadcastHub("127.0.0.1", port + 1, "127.0.0.1", bucket_bytes=1024, timeout_s=10.0)
    state = {"w": torch.arange(300, dtype=torch.float32)}
    try:
        with serving(tmp_path / "weights", cfg) as service:

            def announce(version: int) -> None:
                path, _, sha = files[version]
                uri = announce_location(WeightsTransport.BROADCAST, path, service.endpoint).uri()
                sync.announce(protocol.WeightsReady(version, uri, sha))

            announce(1)  # joins now: in no group yet, so the network it is
            first = ready_of(sync, 1)
            assert isinstance(first, Ready) and first.transport == NETWORK and first.tensors is None
            wait_for(lambda: hub.waiting() == 1, DEADLINE_S, "the member to join")
            report = hub.broadcast(state, 2)  # the learner broadcasts before it announces
            assert report.reached == ("w0",), report
            announce(2)
            second = ready_of(sync, 2)
            assert isinstance(second, Ready) and second.transport == BROADCAST and second.tensors is not None
            assert torch.equal(second.tensors["w"], state["w"])
            announce(3)  # never broadcast: after timeout_s the network
            third = ready_of(sync, 3)
            assert isinstance(third, Ready) and third.transport == NETWORK
            assert third.path is not None and third.path.read_bytes() == files[3][1]
            assert service.stats().chunks_served.get(2, 0) == 0  # v2 came only from the broadcast
    finally:
        sync.close()
        hub.close()


def test_a_worker_reads_the_file_it_sees_and_fetches_what_it_does_not(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    cfg = config(free_ports(1)[0])
    with serving(weights, cfg) as service:
        paths = {v: publish(weights, v, 2 * CHUNK) for v in (1, 2, 3, 4)}

        def announce(
            sync: WeightSync, v: int, transport: WeightsTransport, seen_as: Path | None = None
        ) -> None:
            """Announce v; `seen_as`: the path this worker finds under the learner's file name."""
            path, _, sha = paths[v]
            loc = announce_location(transport, path, service.endpoint)
            if seen_as is not None:
                loc = WeightsLocation(v, path=str(seen_as), service=loc.service, size=loc.size)
            sync.announce(protocol.WeightsReady(v, loc.uri(), sha))

        auto = WeightSync(config(cfg.port), "w-auto", cache_dir=tmp_path / "cache-auto")
        network = WeightSync(config(cfg.port, transport="network"), "w-net", cache_dir=tmp_path / "cache-net")
        try:
            announce(auto, 1, WeightsTransport.AUTO)  # visible, right size: read in place
            first = ready_of(auto, 1)
            assert isinstance(first, Ready) and (first.transport, first.path, first.verified) == (
                FILE,
                paths[1][0],
                False,
            )
            other = tmp_path / "other-host" / "v000002.safetensors"
            announce(auto, 2, WeightsTransport.AUTO, seen_as=other)  # not there: fetched
            second = ready_of(auto, 2)
            assert isinstance(second, Ready) and second.transport == NETWORK and second.verified
            assert second.path is not None and second.path.read_bytes() == paths[2][1]
            other.parent.mkdir()
            other.write_bytes(b"another file of another size")
            announce(auto, 3, WeightsTransport.AUTO, seen_as=other)  # there, but not the learner's: fetched
            third = ready_of(auto, 3)
            assert isinstance(third, Ready) and third.transport == NETWORK
            assert third.path is not None and third.path.read_bytes() == paths[3][1]
            announce(network, 3, WeightsTransport.AUTO)  # a worker set to network never reads in place
            third = ready_of(network, 3)
            assert isinstance(third, Ready) and third.transport == NETWORK
            assert third.path == tmp_path / "cache-net" / "v000003.safetensors"
            announce(network, 4, WeightsTransport.BROADCAST)  # no broadcast receiver: the network
            fourth = ready_of(network, 4)
            assert isinstance(fourth, Ready) and fourth.transport == NETWORK and fourth.verified
        finally:
            auto.close()
            network.close()


def test_a_burst_of_versions_fetches_only_the_newest(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    cfg = config(free_ports(1)[0], transport="network")
    published = {v: publish(weights, v, 4 * CHUNK) for v in (1, 2, 3)}
    with serving(weights, cfg) as service:
        sync = WeightSync(cfg, "w-burst", cache_dir=tmp_path / "cache")
        try:
            for v, (path, _, sha) in published.items():  # announced in one broker read: none fetched yet
                uri = announce_location(WeightsTransport.NETWORK, path, service.endpoint).uri()
                sync.announce(protocol.WeightsReady(v, uri, sha))
            results: list[Ready | Unavailable] = []
            wait_for(lambda: results.extend(sync.poll()) or results, DEADLINE_S, "the burst synced")
            time.sleep(0.3)  # anything else that would come
            results.extend(sync.poll())
        finally:
            sync.close()
        requested = {version for _, version, _, _ in service.stats().requests}
    assert [(r.version, type(r)) for r in results] == [(3, Ready)]
    assert requested == {3} and service.stats().chunks_served == {3: 4}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["v000003.safetensors"]


# ---------------------------------------------------------------------------------------- in a worker


def talk(broker: BareBroker, seconds: float) -> None:
    """Heartbeat the worker for `seconds`, reading what it sends: nothing but its own keep-alives."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        broker.send(protocol.Heartbeat())
        if broker.sock.poll(50):
            msg = protocol.decode(broker.sock.recv_multipart()[1:])
            assert isinstance(msg, NOISE), msg
            broker.keepalives += 1


def test_a_worker_fetching_from_a_silent_service_keeps_heartbeating_and_answers_once(tmp_path: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = free_ports(1)[0]
    silent.bind(f"tcp://127.0.0.1:{port}")
    uri = WeightsLocation(1, service=f"tcp://127.0.0.1:{port}", size=CHUNK).uri()
    try:
        cfg = WeightsConfig(timeout_s=0.5, cache_dir=str(tmp_path / "cache"))
        with running_worker(EngineScript(), weights=cfg) as w:
            kept = w.broker.keepalives
            w.broker.send(protocol.WeightsReady(1, uri, "0" * 64))
            failed = w.broker.expect(protocol.WeightsLoaded)
            assert (failed.version, failed.ok, failed.transport) == (1, False, "network")
            assert failed.error.startswith("no answer from") and failed.sync_s > 0
            talk(w.broker, 1.5)  # a retry or two while the worker goes on
            assert w.broker.keepalives > kept  # heartbeats went on while the fetch waited
            assert w.engine.loads == 0 and w.engine.version == 0
    finally:
        silent.close()
        ctx.term()


def test_a_worker_loads_a_fetched_version_and_refuses_a_bad_sha256(tmp_path: Path) -> None:
    _, data, sha = publish(tmp_path / "weights", 1, 3 * CHUNK)
    _, data2, _ = publish(tmp_path / "weights", 2, 3 * CHUNK)
    cfg = config(free_ports(1)[0], transport="network", cache_dir=str(tmp_path / "cache"))
    with serving(tmp_path / "weights", cfg) as service, running_worker(EngineScript(), weights=cfg) as w:
        w.broker.send(protocol.WeightsReady(2, location(service, 2, len(data2)).uri(), "f" * 64))
        refused = w.broker.expect(protocol.WeightsLoaded)
        assert (refused.version, refused.ok, refused.transport) == (2, False, "network")
        assert "sha256 of the fetched v2" in refused.error
        assert w.engine.loads == 0  # nothing loaded
        w.broker.send(
            protocol.WeightsReady(3, location(service, 1, len(data)).uri().replace("v000001", "v000003"), sha)
        )
        gone = w.broker.expect(protocol.WeightsLoaded)  # v3 was never published
        assert (gone.version, gone.ok) == (3, False) and "gone from the learner" in gone.error
    assert w.engine.loads == 0


def test_a_worker_loads_the_newest_fetched_version(tmp_path: Path) -> None:
    published = {v: publish(tmp_path / "weights", v, 3 * CHUNK) for v in (1, 2)}
    cfg = config(free_ports(1)[0], transport="network", cache_dir=str(tmp_path / "cache"))
    with serving(tmp_path / "weights", cfg) as service, running_worker(EngineScript(), weights=cfg) as w:
        for v, (_, data, sha) in published.items():
            w.broker.send(protocol.WeightsReady(v, location(service, v, len(data)).uri(), sha))
            loaded = w.broker.expect(protocol.WeightsLoaded)
            assert (loaded.version, loaded.ok, loaded.error, loaded.transport) == (v, True, "", "network")
            assert loaded.sync_s > 0
            assert w.engine.version == v
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "v000001.safetensors",
        "v000002.safetensors",
    ]


# ---------------------------------------------------------------------------------------- a run


def run_two_workers(
    cluster: Callable[..., Cluster], tmp_path: Path, transport: str
) -> tuple[Cluster, dict[str, Path], dict[str, Path]]:
    """Broker, torch learner and two torch workers as processes with `transport`, each worker with a cache
    of its own; returns the cluster, the workers' logs and their caches."""
    pytest.importorskip("torch")
    from april.hf import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    port = free_port_pair()  # the broadcast rendezvous takes port + 1
    c = cluster(
        # sync mode: a version comes a round of generation after the last (a worker that is sent versions
        # faster than it loads them skips to the newest, by design); stopped by the fixture after the test
        run={"mode": "sync", "steps": 50},
        algo={"rollout_batch_size": 2, "over_sampling_batch_size": 2, "n_samples_per_prompt": 2,
              "max_new_tokens": 96},
        data={"synthetic_vocab_size": 320},
        worker={"engine": "torch", "model": str(model_dir), "slots": 4},
        learner={"model": str(model_dir), "backend": "torch", "lr": 1e-3, "checkpoint_every": 100},
        weights={"transport": transport, "port": port, "chunk_bytes": 65536, "window": 4},
    )  # fmt: skip
    c.start_broker()
    caches = {name: tmp_path / f"cache-{name}" for name in ("nw0", "nw1")}
    logs = {name: c.start_worker(name, f"weights.cache_dir={cache}") for name, cache in caches.items()}
    c.start_learner_process("learner")
    return c, logs, caches


def loads(log: Path) -> dict[int, str]:
    """Version -> transport, of every version a worker's log says it loaded."""
    return {int(v): t for v, t in re.findall(r"weights v(\d+) loaded in [\d.]+s \((\w+),", log.read_text())}


def test_a_run_over_the_network_transport_loads_every_version_on_every_worker(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """weights.transport = network: the workers never read the run directory; the versions reach each
    worker's own cache over the weight service. A worker sent a version while it still loads an earlier one
    skips to the newest (by design), so what is waited for is v3 or later on both, every load by network."""
    c, logs, caches = run_two_workers(cluster, tmp_path, "network")
    metrics = c.run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 600, "three steps")
    wait_for(lambda: all(max(loads(log), default=0) >= 3 for log in logs.values()), DEADLINE_S, "v3 on both")
    assert all(set(loads(log).values()) == {"network"} for log in logs.values())
    for cache in caches.values():
        cached = sorted(p.name for p in cache.iterdir())
        assert cached and all(re.fullmatch(r"v\d{6}\.safetensors", n) for n in cached), cached
        assert len(cached) <= 2  # weights.keep
        newest = cache / cached[-1]
        published = c.run_dir / "weights" / newest.name
        if published.exists():  # not yet pruned by the learner: the same bytes
            assert newest.read_bytes() == published.read_bytes()
    first = json.loads(metrics.read_text().splitlines()[0])
    assert first["weights_transport"] == "network"


def test_a_run_over_the_broadcast_loads_versions_from_the_collective_and_the_rest_over_the_network(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """weights.transport = broadcast with torch engines: each worker joins the learner's gloo group at the
    first announcement (that version comes over the network: it was in no group yet), and from the next
    group on takes versions from the collective; the learner's metrics say whom it reached."""
    c, logs, _ = run_two_workers(cluster, tmp_path, "broadcast")
    metrics = c.run_dir / "metrics.jsonl"

    def broadcast_loads() -> bool:
        return all("broadcast" in loads(log).values() for log in logs.values())

    wait_for(broadcast_loads, 600, "a version loaded from the broadcast on both workers")
    for log in logs.values():
        got = loads(log)
        assert set(got.values()) <= {"network", "broadcast"}, got
        assert got[min(got)] == "network"  # before its first group: the network transport
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert {r["weights_transport"] for r in records} == {"broadcast"}
    assert max(r["learner/broadcast_reached"] for r in records) == 2  # both workers in one group


def test_an_engine_down_at_load_loads_the_fetched_version_from_the_cache_once_back(tmp_path: Path) -> None:
    _, data, sha = publish(tmp_path / "weights", 1, 3 * CHUNK)
    cfg = config(free_ports(1)[0], transport="network", cache_dir=str(tmp_path / "cache"))
    with (
        serving(tmp_path / "weights", cfg) as service,
        running_worker(EngineScript(down_on_load=1), cfg) as w,
    ):
        w.broker.send(protocol.WeightsReady(1, location(service, 1, len(data)).uri(), sha))
        refused = w.broker.expect(protocol.WeightsLoaded)
        assert (refused.version, refused.ok, refused.transport) == (1, False, "network")
        assert not w.broker.expect(protocol.EngineHealth).ok
        assert w.broker.expect(protocol.EngineHealth).ok
        loaded = w.broker.expect(protocol.WeightsLoaded)
        assert (loaded.version, loaded.ok, loaded.transport) == (1, True, "network")
        assert loaded.sync_s > refused.sync_s and w.engine.version == 1 and w.engine.loads == 2
        assert service.stats().chunks_served == {1: 3}  # fetched once, loaded twice from the cache


def test_a_cache_that_cannot_be_written_fails_the_fetch_once_and_a_retry_succeeds_once_it_can(
    tmp_path: Path,
) -> None:
    _, data, sha = publish(tmp_path / "weights", 1, 2 * CHUNK)
    cfg = config(free_ports(1)[0])
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache directory should be")
    with serving(tmp_path / "weights", cfg) as service, fetching(cfg, blocked) as fetcher:
        fetcher.fetch(location(service, 1, len(data)), sha)
        (failed,) = results_until(fetcher, FetchFailed, 1)
        assert isinstance(failed, FetchFailed) and failed.reason.startswith(f"cache {blocked}:")
        blocked.unlink()  # the disk is fixed: the retry (after its backoff) fetches it
        (fetched,) = results_until(fetcher, Fetched, 1)
    assert isinstance(fetched, Fetched) and fetched.path.read_bytes() == data
