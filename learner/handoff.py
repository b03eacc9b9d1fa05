"""The learner's end of the weights hand-off, whatever the transport (docs/design.md section 6).

Rank 0 opens one `WeightsHandOff` for the run:

    handoff = WeightsHandOff.open(config, run_dir)   # the weight service unless transport is file; the
                                                     # broadcast hub on top with transport broadcast
    trainer.publish(weights_dir, version, handoff.broadcast)   # the file first, then the collective
    uri = handoff.uri(path)                          # what WeightsReady announces for that file
    handoff.figures()                                # the last broadcast's figures, for metrics.jsonl
    handoff.serve_last(client, version)              # after the last step: until the workers have it
    handoff.close()

It decides what is announced per `weights.transport` (file: the file URI; auto: the service and the file;
network: the service; broadcast: the service, flagged broadcast), and sends each version through the
collective when there is one: after the version's file is written, so a member that misses it fetches the
file; `BroadcastHub.broadcast` never raises for a member's fault and waits at most its timeouts.

Does not write the files (`learner.weights`), serve them (`learner.weight_service`) or run the collective
(`learner.weight_broadcast`); the loop decides when each step publishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from april.config import Config, WeightsTransport
from april.keys import weights_server_keys
from learner.client import BrokerClient
from learner.trainer import BroadcastSend
from learner.weight_service import WeightService, WeightServiceError, announce_location, broker_host_of

if TYPE_CHECKING:
    from learner.weight_broadcast import BroadcastHub, BroadcastReport

log = logging.getLogger("april.learner")


class WeightsHandOff:
    def __init__(self, config: Config, service: WeightService | None, hub: BroadcastHub | None) -> None:
        self.config = config
        self.service = service
        self.hub = hub
        self.last: BroadcastReport | None = None

    @classmethod
    def open(cls, config: Config, run_dir: Path) -> WeightsHandOff:
        """Start what the transport needs. WeightServiceError / KeysError: one line; with transport auto a
        service that cannot bind is a warning (workers on this host read the files). The simulated
        learner's stand-in files hold no weights: it serves nothing."""
        transport = config.weights.transport
        if transport == WeightsTransport.FILE or config.learner.backend == "sim":
            return cls(config, None, None)
        keys_dir = config.broker.curve_keys_dir
        keys = weights_server_keys(Path(keys_dir)) if keys_dir else None
        service = WeightService(
            run_dir / "weights", config.weights, keys, broker_host_of(config.learner.broker)
        )
        try:
            service.start()
        except WeightServiceError as exc:
            if transport != WeightsTransport.AUTO:
                raise
            # auto serves workers on other hosts when it can; workers on this one read the files anyway
            log.warning("%s: announcing weights as files only (workers on other hosts cannot get them)", exc)
            return cls(config, None, None)
        hub = None
        if transport == WeightsTransport.BROADCAST:
            try:
                hub = _open_hub(config, service.endpoint)
            except BaseException:
                service.stop()
                raise
        return cls(config, service, hub)

    def uri(self, path: Path) -> str:
        """The URI announcing the published file `path` (a stand-in file, no safetensors: as a file)."""
        path = path.resolve()
        if self.service is None or path.suffix != ".safetensors":
            return path.as_uri()
        return announce_location(self.config.weights.transport, path, self.service.endpoint).uri()

    @property
    def broadcast(self) -> BroadcastSend | None:
        """What `Trainer.publish` calls with each version's state (None: no collective)."""
        return self._broadcast if self.hub is not None else None

    def _broadcast(self, state: Mapping[str, Any], version: int) -> None:
        assert self.hub is not None
        self.last = report = self.hub.broadcast(state, version)
        if report.error:
            log.warning(
                "broadcast of v%d ended its group (%s): dropped %s", version, report.error, report.dropped
            )

    def figures(self) -> dict[str, float]:
        """The last broadcast's figures (metrics.jsonl); none without a collective."""
        if self.hub is None:
            return {}
        report = self.last
        return {
            "broadcast_s": report.seconds if report else 0.0,
            "broadcast_reached": float(len(report.reached)) if report else 0.0,
            "broadcast_dropped": float(len(report.dropped)) if report else 0.0,
        }

    def serve_last(self, client: BrokerClient, version: int) -> None:
        """After the last step: keep serving until every live worker serves `version` (the broker's final
        evaluation runs on it, and no worker can fetch it once this learner is gone), at most
        `weights.timeout_s`. Nothing to wait for when workers read the files, which outlive the learner."""
        if self.service is None:
            return
        deadline = time.monotonic() + self.config.weights.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            behind = client.workers_behind(version, min(left, 5.0))
            if behind == 0:
                return
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        log.warning("stopping the weight service with workers still behind v%d (weights.timeout_s)", version)

    def close(self) -> None:
        if self.hub is not None:
            self.hub.close()
            self.hub = None
        if self.service is not None:
            self.service.stop()
            self.service = None


def _open_hub(config: Config, endpoint: str) -> BroadcastHub:
    """The broadcast hub on the service's host (gloo sockets on the address workers reach the service at;
    NCCL with a CUDA learner)."""
    from april.devices import resolve_device
    from learner.weight_broadcast import BroadcastHub  # imports torch: only for the broadcast transport

    device = resolve_device(config.learner.device, "learner.device")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    host = urlparse(endpoint).hostname or config.weights.bind_host
    return BroadcastHub.from_config(config.weights, host, backend)
