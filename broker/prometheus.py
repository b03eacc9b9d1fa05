"""The broker's Prometheus endpoint: live gauges and counters at http://BIND_HOST:METRICS_PORT/metrics.

Off unless `broker.metrics_port` > 0. The figures are those of the status object (`broker.status`): the
poll loop hands each status it builds (once a second) to `update`, and a scrape, served on
prometheus-client's HTTP thread, reads only that latest dict; it never touches the broker's books, so
there is nothing to lock. Counters count since this broker process started, as the status `totals` do
(Prometheus handles the reset at a restart). prometheus-client is imported here only, when the endpoint
is configured; without it the broker refuses to start with one line saying what to install.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from april.config import ConfigError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

PREFIX = "april_broker_"

# (status key, metric name, help): gauges read straight from the status object
GAUGES = (
    ("version", "version", "weights version the broker serves"),
    ("in_flight_groups", "in_flight_groups", "groups with a sample queued or leased"),
    ("partial_groups", "partial_groups", "groups waiting to resume interrupted samples"),
    ("partial_buffer", "partial_buffer_samples", "interrupted samples waiting in the queue"),
    ("complete_groups", "complete_groups", "complete groups not yet in a batch"),
    ("leased_samples", "leased_samples", "training samples leased to workers now"),
    ("queued_samples", "queued_samples", "samples waiting in the dispatch queue"),
)
# (totals key, metric name without _total, help)
COUNTERS = (
    ("aborted", "aborted_samples", "samples returned interrupted by an abort"),
    ("resumed", "resumed_samples", "samples leased again with a partial response"),
    ("tokens_generated", "tokens_generated", "new response tokens accepted from workers (training)"),
    ("samples_finished", "samples_finished", "training samples returned FINISHED or FAILED"),
    ("batches_acked", "batches_acked", "batches the learner trained and acked"),
)


def status_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    """The metric families of one status object (empty before the first status)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if not status:
        return
    for key, name, doc in GAUGES:
        yield GaugeMetricFamily(PREFIX + name, doc, value=float(status[key]))
    workers = status["workers"]
    yield GaugeMetricFamily(PREFIX + "workers", "registered workers", value=len(workers))
    yield GaugeMetricFamily(
        PREFIX + "workers_alive",
        "workers heard from within the liveness window",
        value=sum(w["alive"] for w in workers),
    )
    ledger = GaugeMetricFamily(PREFIX + "ledger_groups", "groups by ledger state", labels=["state"])
    for state in ("issued", "trained", "complete_waiting", "in_flight", "partial"):
        ledger.add_metric([state], float(status["ledger"][state]))
    ledger.add_metric(["dropped"], float(sum(status["ledger"]["dropped"].values())))
    yield ledger
    evaluation = status.get("eval") or {}
    accuracy = evaluation.get("accuracy")
    yield GaugeMetricFamily(
        PREFIX + "eval_accuracy",
        "accuracy on the held-out prompts at the latest evaluation (NaN before the first)",
        value=math.nan if accuracy is None else float(accuracy),
    )
    version = evaluation.get("version")
    yield GaugeMetricFamily(
        PREFIX + "eval_version",
        "weights version of the latest evaluation (-1 before the first)",
        value=-1.0 if version is None else float(version),
    )
    for key, name, doc in COUNTERS:
        yield CounterMetricFamily(PREFIX + name, doc, value=float(status["totals"][key]))
    rejections = CounterMetricFamily(
        PREFIX + "rejections", "messages and samples rejected", labels=["reason"]
    )
    for reason, count in sorted(status["rejected"]["by_reason"].items()):
        rejections.add_metric([reason], float(count))
    yield rejections


class PrometheusExporter:
    """Serves the latest status as Prometheus metrics on its own registry (never the global one)."""

    def __init__(self, port: int) -> None:
        try:
            from prometheus_client.registry import Collector, CollectorRegistry
        except ImportError:
            raise ConfigError(
                f"broker.metrics_port = {port}: the Prometheus endpoint needs prometheus-client, which is "
                "not installed (pip install prometheus-client, or the observability extra)"
            ) from None
        self.port = port
        self.latest: dict[str, Any] = {}
        exporter = self

        class StatusCollector(Collector):
            def collect(self) -> Iterator[Metric]:
                return status_metrics(exporter.latest)

        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector())
        self._server: WSGIServer | None = None

    def start(self, host: str) -> None:
        """Listen on host:port (raises OSError when the port is busy)."""
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(self.port, addr=host, registry=self.registry)

    def update(self, status: dict[str, Any]) -> None:
        """Serve this status from now on (the reference swap is atomic; the dict is never mutated)."""
        self.latest = status

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
