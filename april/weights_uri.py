"""Where a published weights version can be had: the URI a WeightsReady carries, written and read.

The learner announces each version with one URI (docs/design.md section 6); the broker relays it
untouched and never carries weight bytes. Three forms:

    file:///abs/run/weights/v000003.safetensors                     the file transport: read the file
    april+tcp://HOST:PORT/v000003.safetensors?size=N[&path=P][&broadcast=1]
                                                                    the learner's weight service
    sim://...                                                       the sim engine: nothing to load

An `april+tcp` URI names the learner's weight service (ZeroMQ, `learner.weight_service`) and the file's
size; `path` (transport auto) is the learner's own file, which a worker that sees it reads directly
instead of pulling it; `broadcast` says the learner also sends each version through a collective to
engines that joined its group (rendezvous at PORT + 1).

Also names the files versions live in, in the learner's weights/ and in a worker's cache alike
(`version_path`, `file_version`, `published_versions`), and how a version's bytes came, as workers
report it (WeightsLoaded.transport) and the broker counts it in each batch's stats (`WORKER_SYNC_STATS`,
copied into metrics.jsonl). Owns the format only: fetching is `actors.weight_fetch`'s, serving
`learner.weight_service`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlencode, urlparse

from april.config import ConfigError

SERVICE_SCHEME = "april+tcp"
WEIGHT_TRANSPORTS = ("file", "network", "broadcast")  # WeightsLoaded.transport values
WORKER_SYNC_STATS = (
    "workers_synced",  # live workers serving the broker's version when the batch formed
    "worker_sync_s_max",  # the slowest of them: seconds from hearing of the version to serving it
    *(f"workers_synced_{t}" for t in WEIGHT_TRANSPORTS),  # of them, how many got it by each transport
)
_VERSION_FILE = re.compile(r"^v(\d{6,})\.safetensors$")


def version_path(directory: Path, version: int) -> Path:
    """Version `version`'s file in `directory` (the learner's weights/ or a worker's cache)."""
    return Path(directory) / f"v{version:06d}.safetensors"


def file_version(name: str) -> int | None:
    """The version a file named `name` holds; None for any other name (a temp or .part file, ...)."""
    match = _VERSION_FILE.match(name)
    return int(match.group(1)) if match else None


def published_versions(directory: Path) -> list[int]:
    """Versions with a complete file in `directory`, ascending."""
    if not Path(directory).is_dir():
        return []
    found = (file_version(p.name) for p in Path(directory).iterdir())
    return sorted(v for v in found if v is not None)


class WeightsURIError(ConfigError):
    """A weights URI this worker cannot read; one line naming it."""


@dataclass(frozen=True, slots=True)
class WeightsLocation:
    """Where version `version` can be had: a file path, the learner's service, or both."""

    version: int
    path: str = ""  # the learner's file; a worker that sees it may read it ("" = not offered)
    service: str = ""  # "tcp://HOST:PORT" of the learner's weight service ("" = file transport)
    size: int = 0  # bytes of the file; 0 = not announced (file transport)
    broadcast: bool = False  # the learner also broadcasts versions to its collective group

    @property
    def file_name(self) -> str:
        return version_path(Path(), self.version).name

    @property
    def broadcast_rendezvous(self) -> tuple[str, int]:
        """(host, port) of the broadcast group's rendezvous store: the service host, its port + 1."""
        parsed = urlparse(self.service)
        if not self.broadcast or parsed.hostname is None or parsed.port is None:
            raise WeightsURIError(f"v{self.version}: the learner announced no broadcast group")
        return parsed.hostname, parsed.port + 1

    def uri(self) -> str:
        if not self.service:
            return "file://" + quote(self.path)
        query: dict[str, str] = {"size": str(self.size)}
        if self.path:
            query["path"] = self.path
        if self.broadcast:
            query["broadcast"] = "1"
        endpoint = self.service.removeprefix("tcp://")
        return f"{SERVICE_SCHEME}://{endpoint}/{self.file_name}?{urlencode(query)}"


def parse(uri: str, version: int) -> WeightsLocation | None:
    """The location `uri` names for version `version`; None for sim:// (nothing to load).

    A plain path is a file location (older learners announced those). WeightsURIError if malformed."""
    if uri.startswith("sim://"):
        return None
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return WeightsLocation(version, path=unquote(parsed.path) if parsed.scheme else uri)
    if parsed.scheme != SERVICE_SCHEME:
        raise WeightsURIError(
            f"weights URI {uri!r}: unknown scheme {parsed.scheme!r} (expected file or {SERVICE_SCHEME})"
        )
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host = port = None
    named = file_version(parsed.path.removeprefix("/"))
    query = parse_qs(parsed.query)
    size = query.get("size", [""])[0]
    if not host or not port or named != version or not size.isdigit():
        raise WeightsURIError(
            f"weights URI {uri!r}: expected {SERVICE_SCHEME}://HOST:PORT/v{version:06d}.safetensors?size=N"
        )
    return WeightsLocation(
        version,
        path=query.get("path", [""])[0],
        service=f"tcp://{parsed.netloc}",
        size=int(size),
        broadcast=query.get("broadcast", [""])[0] == "1",
    )
