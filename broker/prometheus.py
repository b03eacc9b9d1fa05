"""The broker's Prometheus endpoint: live gauges and counters at http://BIND_HOST:METRICS_PORT/metrics.

Off unless `broker.metrics_port` > 0. The figures are those of the status record (`april.status`,
built by `broker.status`): the poll loop hands each status it builds (once a second) to `update`, and a
scrape, served on prometheus-client's HTTP thread, reads only that latest frozen record; it never touches
the broker's books, so there is nothing to lock. Counters count what the status `totals` do: over the
run, across broker restarts (`batches_acked` since this process started; Prometheus handles its reset).
prometheus-client is imported here only, when the endpoint is configured; without it the broker refuses
to start with one line saying what to install.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from april.config import ConfigError
from april.status import BrokerStatus, Totals

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

PREFIX = "april_broker_"

# (metric name, help, figure): gauges read straight from the status record
GAUGES: tuple[tuple[str, str, Callable[[BrokerStatus], float]], ...] = (
    ("version", "weights version the broker serves", lambda s: s.version),
    ("in_flight_groups", "groups with a sample queued or leased", lambda s: s.in_flight_groups),
    ("partial_groups", "groups waiting to resume interrupted samples", lambda s: s.partial_groups),
    ("partial_buffer_samples", "interrupted samples waiting to resume", lambda s: s.partial_buffer),
    ("pinned_samples", "partials pinned to the worker that keeps their state", lambda s: s.pinned),
    ("complete_groups", "complete groups not yet in a batch", lambda s: s.complete_groups),
    ("leased_samples", "training samples leased to workers now", lambda s: s.leased_samples),
    ("queued_samples", "samples waiting in the dispatch queue", lambda s: s.queued_samples),
    ("workers", "registered workers", lambda s: len(s.workers)),
    ("workers_alive", "workers heard from within the liveness window", lambda s: s.workers_alive),
    (
        "workers_engine_down",
        "workers whose engine cannot serve (leased nothing until it does)",
        lambda s: sum(1 for w in s.workers if not w.engine_ok),
    ),
    (
        "worker_messages_per_sample",
        "messages heard from live workers per sample they returned, since their hellos (NaN before any)",
        lambda s: math.nan if s.messages_per_sample is None else s.messages_per_sample,
    ),
    (
        "weights_sync_seconds_max",
        "slowest live worker serving the broker's version: seconds from hearing of it to serving it",
        lambda s: max(
            (w.weights_sync_s for w in s.workers if w.alive and w.version == s.version), default=0.0
        ),
    ),
)
# (metric name without _total, help, figure): the status `totals`
COUNTERS: tuple[tuple[str, str, Callable[[Totals], int]], ...] = (
    ("aborted_samples", "samples returned interrupted by an abort", lambda t: t.aborted),
    ("resumed_samples", "samples leased again with a partial response", lambda t: t.resumed),
    (
        "tokens_generated",
        "new response tokens accepted from workers (training)",
        lambda t: t.tokens_generated,
    ),
    ("samples_finished", "training samples returned FINISHED or FAILED", lambda t: t.samples_finished),
    ("batches_acked", "batches the learner trained and acked", lambda t: t.batches_acked),
    ("restarted_samples", "pinned partials restarted from their prompt (worker lost)", lambda t: t.restarted),
)


def status_metrics(status: BrokerStatus | None) -> Iterator[Metric]:
    """The metric families of one status record (none before the first status)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if status is None:
        return
    for name, doc, figure in GAUGES:
        yield GaugeMetricFamily(PREFIX + name, doc, value=float(figure(status)))
    ledger = GaugeMetricFamily(PREFIX + "ledger_groups", "groups by ledger state", labels=["state"])
    books = status.ledger
    for state, count in (
        ("issued", books.issued),
        ("trained", books.trained),
        ("complete_waiting", books.complete_waiting),
        ("in_flight", books.in_flight),
        ("partial", books.partial),
        ("dropped", sum(books.dropped.values())),
    ):
        ledger.add_metric([state], float(count))
    yield ledger
    evaluation = status.eval
    accuracy = None if evaluation is None else evaluation.accuracy
    yield GaugeMetricFamily(
        PREFIX + "eval_accuracy",
        "accuracy on the held-out prompts at the latest evaluation (NaN before the first)",
        value=math.nan if accuracy is None else accuracy,
    )
    version = None if evaluation is None else evaluation.version
    yield GaugeMetricFamily(
        PREFIX + "eval_version",
        "weights version of the latest evaluation (-1 before the first)",
        value=-1.0 if version is None else float(version),
    )
    for name, doc, counter in COUNTERS:
        yield CounterMetricFamily(PREFIX + name, doc, value=float(counter(status.totals)))
    rejections = CounterMetricFamily(
        PREFIX + "rejections", "messages and samples rejected", labels=["reason"]
    )
    for reason, n in sorted(status.rejected.by_reason.items()):
        rejections.add_metric([reason], float(n))
    yield rejections
    errors = CounterMetricFamily(
        PREFIX + "sample_errors",
        "samples settled with an error, by reason (april.failures)",
        labels=["reason"],
    )
    for reason, n in sorted(status.errors.items()):
        errors.add_metric([reason], float(n))
    yield errors


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
        self.latest: BrokerStatus | None = None
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

    def update(self, status: BrokerStatus) -> None:
        """Serve this status from now on (the reference swap is atomic; the record is frozen)."""
        self.latest = status

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
