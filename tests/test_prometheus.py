"""The broker's Prometheus endpoint: a real `april broker` process serving /metrics on a free port while
scripted peers run, scraped over HTTP; and the start-up errors (package missing, port busy)."""

from __future__ import annotations

import dataclasses
import socket
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Cluster, free_ports, wait_for

from april import protocol
from april.config import Config, ConfigError, load_config
from broker.server import Broker

pytest.importorskip("prometheus_client")


def scrape(port: int) -> dict[str, float]:
    """Samples of the text exposition as {"name{labels}": value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_endpoint_serves_live_gauges_and_counters(cluster: Callable[..., Cluster]) -> None:
    (port,) = free_ports(1)
    c = cluster(run={"mode": "april", "eval_every": 2}, data={"eval_size": 4}, broker={"metrics_port": port})
    c.start_broker()
    first = wait_for(lambda: scrape(port), 60, "the metrics endpoint")
    assert first["april_broker_version"] == 0 and first["april_broker_workers_alive"] == 0
    assert first["april_broker_eval_version"] == -1 and "april_broker_eval_accuracy" in first
    c.start_peer("worker", "w0", slots=8)
    wait_for(lambda: scrape(port)["april_broker_workers_alive"] == 1, 60, "the worker in the gauges")
    c.start_learner(steps=2, train_s=0.05)
    c.wait_exit("learner", 60)
    done = wait_for(
        lambda: (
            (m := scrape(port))["april_broker_batches_acked_total"] == 2
            and m["april_broker_eval_version"] == 2
        ),
        60,
        "two acked batches and the evaluation at v2",
    )
    assert done
    m = scrape(port)
    status = c.status()
    assert m["april_broker_version"] == 2 == status.version
    assert status.eval is not None
    assert m["april_broker_eval_accuracy"] == status.eval.accuracy == 0.5  # scripted rewards
    assert m['april_broker_ledger_groups{state="trained"}'] == 8
    for gauge in ("in_flight_groups", "partial_groups", "partial_buffer_samples", "complete_groups"):
        assert f"april_broker_{gauge}" in m
    assert m["april_broker_pinned_samples"] == 0 == m["april_broker_restarted_samples_total"]  # none here
    assert m["april_broker_samples_finished_total"] > 0 and m["april_broker_tokens_generated_total"] > 0
    assert "april_broker_aborted_samples_total" in m and "april_broker_resumed_samples_total" in m


def _config(metrics_port: int) -> Config:
    ports = free_ports(3)
    return load_config(
        overrides={
            "broker.worker_port": ports[0],
            "broker.learner_port": ports[1],
            "broker.pub_port": ports[2],
            "broker.metrics_port": metrics_port,
        }
    )


def test_busy_metrics_port_is_one_config_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        broker = Broker(_config(port), tmp_path / "run")
        with pytest.raises(ConfigError, match=rf"broker.metrics_port = {port}: cannot serve Prometheus"):
            broker.bind()


def test_missing_prometheus_client_is_one_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client.registry", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"broker.metrics_port = 9464: .* needs prometheus-client"):
        Broker(_config(9464), tmp_path / "run")


def test_workers_whose_engine_is_down_are_a_gauge() -> None:
    from test_codec import EXAMPLES

    from broker.prometheus import status_metrics

    status = EXAMPLES[protocol.StatusReply].status  # worker-1's engine is down, worker-0's serves
    gauges = {m.name: m.samples[0].value for m in status_metrics(status) if m.samples}
    assert gauges["april_broker_workers_engine_down"] == 1 and gauges["april_broker_workers"] == 2


def test_the_slowest_sync_of_the_current_version_is_a_gauge() -> None:
    from test_codec import EXAMPLES

    from broker.prometheus import status_metrics

    status = EXAMPLES[protocol.StatusReply].status
    synced = [dataclasses.replace(w, alive=True, version=status.version) for w in status.workers]
    synced[0] = dataclasses.replace(synced[0], weights_transport="network", weights_sync_s=1.5)
    synced[1] = dataclasses.replace(synced[1], weights_transport="file", weights_sync_s=0.25)
    behind = dataclasses.replace(synced[0], id="w-old", version=status.version - 1, weights_sync_s=9.0)
    gauges = {
        m.name: m.samples[0].value
        for m in status_metrics(dataclasses.replace(status, workers=[*synced, behind]))
        if m.samples
    }
    assert gauges["april_broker_weights_sync_seconds_max"] == 1.5  # not the worker still on an older version
