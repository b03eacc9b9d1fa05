"""SGLang servers as ranks of the learner's weight broadcast (learner/weight_broadcast.py, protocol in
docs/protocol.md section 16): joining and leaving a generation's group, the requests that receive one
version, and reading back what each server holds.

`ServerGroup` is what the worker's broadcast member (actors/weight_receive.py) calls from its thread:
`ranks` (the servers' TP sizes summed; 0 while one does not answer, or when they cannot say what they hold
by name), `join` (/init_weights_update_group on every server at once, each at its rank offset; they block
until the whole group connected) and `leave` (/destroy_weights_update_group). `receive_version` and
`check_version` are the per-version calls the engine (actors/engines/sglang_engine.py: load_broadcast)
makes for one server while the hub sends: one /update_weights_from_distributed per bucket, in order, with
`load_format` "flattened_bucket" (present from 0.5.6, the oldest the adapter takes: model_runner.py there,
model_runner_components/weight_updater.py from 0.5.20), inside /begin_weight_update and
/end_weight_update from 0.5.21; then /model_info's weight_version and /get_weights_by_name on each
bucket's sampled tensor. Does not park requests or decide when a version loads (the engine, the worker).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from actors.engine import EngineError
from actors.engines.sglang_http import HTTPStatusError, ServerInfo, http_call, parse_server_info
from april.broadcast_group import BroadcastError, sample_mismatch, sample_rows

if TYPE_CHECKING:  # actors.weight_receive imports torch, which an SGLang worker need not load
    from actors.weight_receive import Invite, Offer

log = logging.getLogger(__name__)

# a name every Llama-family checkpoint has: SGLang answers get_weights_by_name only for model classes that
# implement it (models/llama.py and its subclasses; not qwen2.py or qwen3.py in 0.5.6 to 0.5.23)
PROBE_NAME = "model.embed_tokens.weight"
NOT_BY_NAME = "Get parameter by name failed"  # http_server.py: get_weights_by_name's answer to None


class ServerGroup:
    """The servers at `urls` as broadcast ranks (module docstring); thread-safe (HTTP calls only)."""

    def __init__(self, urls: Sequence[str], control_timeout_s: float, weights_timeout_s: float) -> None:
        self.urls = list(urls)
        self.control_timeout_s = control_timeout_s
        self.weights_timeout_s = weights_timeout_s
        self._readable: dict[str, bool] = {}  # url -> it answers get_weights_by_name (asked once)
        self._lock = threading.Lock()

    def ranks(self) -> int:
        """The ranks the servers take in a group now: 0 when one does not answer or cannot be checked."""
        try:
            infos = [self._info(url) for url in self.urls]
        except EngineError:
            return 0
        if not all(self._by_name(url) for url in self.urls):
            return 0
        return sum(i.tp_size for i in infos)

    def join(self, invite: Invite) -> None:
        """Every server joins `invite`'s group, server i at the invite's offset plus the TP sizes before
        it; returns once all did (they block until the whole group connected). BroadcastError otherwise."""
        sizes = [self._info(url).tp_size for url in self.urls]

        def join_one(i: int, url: str) -> None:
            body = {
                "master_address": invite.master_address,
                "master_port": invite.master_port,
                "rank_offset": invite.rank_offset + sum(sizes[:i]),
                "world_size": invite.world_size,
                "group_name": invite.group_name,
                "backend": invite.backend,
            }
            self._post(url, "/init_weights_update_group", body, self.weights_timeout_s)

        errors = concurrently(self.urls, join_one)
        if errors:
            raise BroadcastError(f"sglang: cannot join {invite.group_name}: {errors[0]}")

    def leave(self, group_name: str) -> None:
        """Every server drops the group (its sockets or NCCL communicator); errors are only logged."""

        def leave_one(_: int, url: str) -> None:
            body = {"group_name": group_name}
            self._post(url, "/destroy_weights_update_group", body, self.control_timeout_s)

        for error in concurrently(self.urls, leave_one):
            log.info("sglang: leaving %s: %s", group_name, error)

    # -- servers ----------------------------------------------------------------------------------

    def _info(self, url: str) -> ServerInfo:
        return parse_server_info(url, http_call(url, "GET", "/server_info", None, self.control_timeout_s))

    def _by_name(self, url: str) -> bool:
        """Whether the server can say what it holds by name (asked once per server)."""
        with self._lock:
            known = self._readable.get(url)
        if known is not None:
            return known
        try:
            body = {"name": PROBE_NAME, "truncate_size": 1}
            http_call(url, "POST", "/get_weights_by_name", body, self.control_timeout_s)
            readable = True
        except HTTPStatusError as e:
            if NOT_BY_NAME not in e.text:
                return False  # not known yet: asked again next time
            readable = False
            log.error(
                "sglang %s cannot say what it holds by name (/get_weights_by_name: %s; SGLang implements "
                "it for Llama-family models only), so a broadcast could not be checked: its weights come "
                "through the network or file transport",
                url,
                e.text,
            )
        except EngineError:
            return False
        with self._lock:
            self._readable[url] = readable
        return readable

    def _post(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        """POST; EngineError when it fails or answers success false."""
        answer = http_call(url, "POST", path, body, timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(f"sglang {url}{path}: {answer.get('message', 'failed')}")
        return answer


def update_bodies(offer: Offer, version: int) -> list[dict[str, Any]]:
    """One /update_weights_from_distributed body per bucket, in the hub's order: the bucket's tensors as
    the hub laid them out (names, dtypes, shapes in order: the server computes the offsets itself); the
    weight_version only on the last, so /model_info names `version` only once every bucket loaded."""
    bodies = []
    for i, bucket in enumerate(offer.manifest.buckets):
        body: dict[str, Any] = {
            "names": [e.name for e in bucket.entries],
            "dtypes": [e.dtype for e in bucket.entries],
            "shapes": [list(e.shape) for e in bucket.entries],
            "group_name": offer.group_name,
            "load_format": "flattened_bucket",
            "flush_cache": False,
        }
        if i == len(offer.manifest.buckets) - 1:
            body["weight_version"] = str(version)
        bodies.append(body)
    return bodies


def receive_version(
    url: str, info: ServerInfo, offer: Offer, post: Callable[[str, str, dict[str, Any]], None]
) -> None:
    """One server receives the offered version, bucket after bucket (each request returns once its
    broadcast arrived and loaded); `post(url, path, body)` raises on a failed call. The weight-update
    session (0.5.21+) is closed whatever happens: an open one makes every later begin a 400."""
    if info.weight_update_bracket:
        post(url, "/begin_weight_update", {"selector": "all"})
    try:
        for body in update_bodies(offer, offer.version):
            post(url, "/update_weights_from_distributed", body)
    finally:
        if info.weight_update_bracket:
            post(url, "/end_weight_update", {})
    post(url, "/flush_cache", {})


def check_version(url: str, offer: Offer, call: Callable[[str, str, str, Any], Any]) -> str:
    """What is wrong with what the server holds after receiving the offer ("" when nothing): its
    /model_info weight_version, then the first values of each bucket's sampled tensor
    (/get_weights_by_name; `call(url, method, path, body)`)."""
    info = call(url, "GET", "/model_info", None)
    live = info.get("weight_version") if isinstance(info, dict) else None
    if live != str(offer.version):
        return f"sglang {url}: weight_version is {live} after the broadcast, expected {offer.version}"
    for bucket in offer.manifest.buckets:
        sample = bucket.sample
        if sample is None:
            continue
        shape = next(e.shape for e in bucket.entries if e.name == sample.name)
        body = {"name": sample.name, "truncate_size": sample_rows(shape)}
        try:
            got = flatten(call(url, "POST", "/get_weights_by_name", body))
        except HTTPStatusError as e:
            return f"sglang {url}: cannot read {sample.name} back ({e.text})"
        wrong = sample_mismatch(sample.values, got)
        if wrong:
            return f"sglang {url}: {sample.name} does not hold what was sent: {wrong}"
    return ""


def flatten(values: Any) -> list[float]:
    """A get_weights_by_name answer (rows of floats, or floats) read row-major."""
    if isinstance(values, list):
        return [v for item in values for v in flatten(item)]
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        return [float(values)]
    raise EngineError(f"sglang /get_weights_by_name: expected numbers, got {str(values)[:100]}")


def concurrently(urls: Sequence[str], call: Callable[[int, str], None]) -> list[EngineError]:
    """Run call(i, url) for every server at once (group calls block until every rank takes part); the
    errors, in server order."""
    errors: list[EngineError | None] = [None] * len(urls)

    def run(i: int, url: str) -> None:
        try:
            call(i, url)
        except EngineError as e:  # re-raised by the caller, in its thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, u), daemon=True) for i, u in enumerate(urls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [e for e in errors if e is not None]
