"""Weight sync: seconds to get a new weights version from the learner to a worker, per transport, against
the loopback TCP bandwidth measured in the same run.

What runs: for each model size (`--sizes`, one at a time, so at most one model is in memory), a random-init
Qwen3-shaped model in fp32, or for the `-llama` sizes a Llama-shaped one in bf16 (transformers, nothing
downloaded; untied embeddings, so the published state dict holds each parameter once), whose state dict is
the version to sync. The learner's side runs in this
process, the worker's in a child process started once per size (`--child`, commands as JSON lines on its
stdin), so bytes really cross a process boundary. Each round (`--rounds`, after one warm-up round that is
recorded but not counted: connections and the broadcast group form there) measures, in turn:

- `loopback`: a raw TCP socket on 127.0.0.1 moving the same number of bytes as the version's file, in
  `weights.chunk_bytes` sends, into a reused receive buffer, until the receiver acknowledges the last
  byte: the machine's ceiling for a one-stream transfer, measured beside the transports it judges;
- `file`: `learner.weights.publish` (write, fsync, sha256, rename), then the worker's side as
  `actors.worker` does it: the sha256 of the file, then its tensors read with safetensors and loaded;
- `network`: the same publish, then `actors.weight_fetch.WeightFetcher` fetching it from
  `learner.weight_service.WeightService` over loopback TCP into the child's own cache (chunks, a window
  in flight, the sha256 checked), then its tensors read from the cache and loaded;
- `broadcast`: the same publish (the learner publishes every version; the file stays the source of
  truth), then `learner.weight_broadcast.BroadcastHub.broadcast` to one
  `actors.weight_receive.BroadcastMember` over a gloo group on loopback, until the child holds the
  version; then loaded.

The load, for every transport, copies the version into the worker's model tensors, as the torch engine's
load does (the first version allocates them, in the warm-up round).

The SGLang transports (`--transports sglang-disk,sglang-broadcast`, on a Llama-shaped size, bf16: SGLang
checks a broadcast on Llama-family models only) run the rebuilt SGLang server (tests/sglang_server.py,
holding the model's tensors under SGLang's names) in the child, driven by `SGLangEngine`, after the same
publish:
- `sglang-disk`: the worker's sha256 of the file, a directory holding a hard link to it, and
  `/update_weights_from_disk`, which reads the safetensors and copies every tensor into the server's;
- `sglang-broadcast`: the hub's broadcast into the server as a rank of its gloo group (one flattened
  bucket per `/update_weights_from_distributed`), then the version and one sampled tensor a bucket read back.
Their transfer is everything after the publish until the server serves the version, checked.

Reported per (size, transport): the median over rounds of the sync seconds (publish + transfer + load),
of the transfer alone (file: the worker's sha256 of the file; network: the fetch into the cache;
broadcast: the collective until the member has it) and its GB/s (bytes / transfer seconds; GB = 1e9
bytes), and that GB/s over the loopback median's: the issue's target is the network transport at half
of loopback or better. The machine's load is in the provenance (the machine is shared: take the ratios,
not the seconds). A transport whose modules are not in this tree is reported as skipped. Not a test:
nothing is asserted. Writes JSON (`--out`).

Usage: python benchmarks/weight_sync.py [--sizes 10M,100M,500M --rounds 3]
       python benchmarks/weight_sync.py --sizes 500M-llama --transports sglang-disk,sglang-broadcast
       python benchmarks/weight_sync.py --smoke        # a ~1M-parameter model, one round
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from april.config import ConfigError, WeightsConfig, load_config  # noqa: E402
from april.files import write_json  # noqa: E402
from april.ports import free_port_pair  # noqa: E402

GB = 1e9
TARGET_NETWORK_VS_LOOPBACK = 0.5  # the target, reported (never asserted)


@dataclass(frozen=True, slots=True)
class Size:
    """A model's shape: vocabulary, hidden width, layers, MLP width, heads (query, kv), head width; its
    architecture (Qwen3 in fp32, or Llama in bf16 for the SGLang transports)."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    arch: str = "qwen3"


QWEN3_VOCAB = 151_936
SIZES = {  # parameters with untied embeddings: 2 x vocab x hidden + layers
    "1M": Size(4096, 96, 2, 384, 4, 2, 16),  # the smoke size
    "10M": Size(QWEN3_VOCAB, 32, 2, 128, 2, 1, 16),
    "100M": Size(QWEN3_VOCAB, 256, 24, 768, 4, 2, 64),
    "500M": Size(QWEN3_VOCAB, 1024, 12, 3072, 16, 8, 128),  # Qwen3-0.6B's layer shapes, 12 of its 28
    "1M-llama": Size(4096, 96, 2, 384, 4, 2, 24, "llama"),  # the SGLang transports' smoke size
    "500M-llama": Size(32_000, 2048, 8, 5632, 32, 4, 64, "llama"),  # TinyLlama-1.1B's shapes, 8 of its 22
}
TRANSPORTS = ("file", "network", "broadcast", "sglang-disk", "sglang-broadcast")
DEFAULT_TRANSPORTS = ("file", "network", "broadcast")
# the modules each transport needs: one not in this tree is skipped (and said so in the report)
NEEDS = {
    "file": ("learner.weights",),
    "network": ("learner.weight_service", "actors.weight_fetch"),
    "broadcast": ("learner.weight_broadcast", "actors.weight_receive"),
    "sglang-disk": ("actors.engines.sglang_engine", "uvicorn"),
    "sglang-broadcast": ("actors.engines.sglang_broadcast", "learner.weight_broadcast", "uvicorn"),
}
SMOKE: dict[str, Any] = {"sizes": "1M", "rounds": 1, "out": Path("bench-out/weight_sync-smoke.json")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10M,100M,500M", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument(
        "--transports",
        default=",".join(DEFAULT_TRANSPORTS),
        help=f"comma-separated, of {', '.join(TRANSPORTS)} (loopback: always)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per size (after one warm-up)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [weights] setting (chunk_bytes, window, bucket_bytes, ...); default: the config's defaults",
    )
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the worker's network cache goes (default: the system temp; /dev/shm: no disk)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-out/weight_sync.json"))
    ap.add_argument("--smoke", action="store_true", help="seconds: a ~1M-parameter model, one round")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:  # the smoke sizes become the defaults, so options given on the command line still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    for name in args.sizes.split(","):
        if name not in SIZES:
            ap.error(f"--sizes: unknown size {name!r} (known: {', '.join(SIZES)})")
    for name in args.transports.split(","):
        if name not in TRANSPORTS:
            ap.error(f"--transports: unknown transport {name!r} (known: {', '.join(TRANSPORTS)})")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: expected >= 1")
    for name in args.sizes.split(","):
        for transport in args.transports.split(","):
            if transport.startswith("sglang") and sglang_supported(SIZES[name]):
                ap.error(f"--transports {transport} on size {name}: {sglang_supported(SIZES[name])}")
    try:
        weights_config(args.set)
    except (ValueError, ConfigError) as exc:
        ap.error(f"--set: {exc}")
    return args


def weights_config(settings: list[str], **fixed: Any) -> WeightsConfig:
    """The [weights] section the transports run with: --set KEY=VALUE over the defaults (typed, checked)."""
    overrides = {f"weights.{k}": v for k, v in (item.split("=", 1) for item in settings)}
    section = load_config(env={}, overrides=overrides).weights
    return dataclasses.replace(section, **fixed)


def available(transport: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in NEEDS[transport])


def model_config(size: Size) -> Any:
    """The transformers config of a size (untied embeddings: the state dict holds each parameter once)."""
    from transformers import LlamaConfig, Qwen3Config

    config_type = LlamaConfig if size.arch == "llama" else Qwen3Config
    return config_type(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        tie_word_embeddings=False,
    )


def state_dict(size: Size, seed: int) -> dict[str, Any]:
    """A random-init model's state dict (no tensor aliases another): Qwen3 in fp32, Llama in bf16."""
    import torch
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = (LlamaForCausalLM if size.arch == "llama" else Qwen3ForCausalLM)(model_config(size))
    if size.arch == "llama":
        model = model.to(torch.bfloat16)
    return dict(model.state_dict())


def sglang_supported(size: Size) -> str:
    """Why the SGLang transports cannot run on `size` ("" when they can)."""
    return (
        "" if size.arch == "llama" else "needs a Llama-shaped size (SGLang checks a broadcast on Llama only)"
    )


# ------------------------------------------------------------------------------------------- the worker


class Worker:
    """The child's side: one command per stdin line, one JSON answer per stdout line."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.fetcher: Any = None
        self.member: Any = None
        self.model: dict[str, Any] = {}  # the engine's weights, which each version is copied into

    def load(self, tensors: dict[str, Any]) -> float:
        """Copy a version into the model, as the torch engine's load does; the seconds it took."""
        started = time.perf_counter()
        for name, tensor in tensors.items():
            if name in self.model:
                self.model[name].copy_(tensor)
            else:  # the first version: the model's memory is allocated here (a warm-up round)
                self.model[name] = tensor.clone()
        return time.perf_counter() - started

    def load_file(self, path: Path) -> float:
        """Read a safetensors file (the file and network transports) and load it."""
        from safetensors.torch import load_file

        started = time.perf_counter()
        tensors = load_file(str(path))  # mapped: the pages are read by the copy
        self.load(tensors)
        return time.perf_counter() - started

    def loopback(self, port: int, nbytes: int, chunk: int) -> dict[str, Any]:
        buffer = bytearray(chunk)
        view = memoryview(buffer)
        with socket.create_connection(("127.0.0.1", port)) as conn:
            got = 0
            while got < nbytes:
                n = conn.recv_into(view, min(chunk, nbytes - got))
                if n == 0:
                    raise SystemExit(f"loopback: sender closed after {got} of {nbytes} bytes")
                got += n
            conn.sendall(b"k")
        return {"bytes": got}

    def file(self, path: str, sha256: str) -> dict[str, Any]:
        from april.files import sha256_file

        started = time.perf_counter()
        got = sha256_file(Path(path))
        verify_s = time.perf_counter() - started
        if got != sha256:
            raise SystemExit(f"file: sha256 of {path} is {got}, expected {sha256}")
        return {"transfer_s": verify_s, "path": path}

    def network(self, uri: str, version: int, sha256: str, cfg: dict[str, Any]) -> dict[str, Any]:
        from actors.weight_fetch import Fetched, WeightFetcher
        from april.config import WeightsConfig
        from april.weights_uri import parse

        if self.fetcher is None:
            self.fetcher = WeightFetcher(WeightsConfig(**cfg), self.cache, identity="bench-worker")
        location = parse(uri, version)
        if location is None:
            raise SystemExit(f"network: {uri} names nothing to fetch")
        started = time.perf_counter()
        self.fetcher.fetch(location, sha256)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            for result in self.fetcher.poll():
                if isinstance(result, Fetched) and result.version == location.version:
                    return {"transfer_s": time.perf_counter() - started, "path": str(result.path)}
                if not isinstance(result, Fetched):
                    raise SystemExit(f"network: fetching v{location.version} failed: {result.reason}")
            time.sleep(0.001)
        raise SystemExit(f"network: v{location.version} not fetched in 600 s")

    def broadcast_join(self, port: int, timeout_s: float) -> dict[str, Any]:
        from actors.weight_receive import BroadcastMember

        self.member = BroadcastMember("bench-worker", timeout_s=timeout_s)
        self.member.join("127.0.0.1", port)
        return {}

    def broadcast_wait(self, version: int) -> dict[str, Any]:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            got = self.member.poll()
            if got is not None and got.version == version:
                nbytes = sum(t.numel() * t.element_size() for t in got.tensors.values())
                return {"bytes": nbytes, "load_s": self.load(got.tensors)}
            errors = self.member.errors()
            if errors:
                print(f"broadcast member: {'; '.join(errors)}", file=sys.stderr, flush=True)
            time.sleep(0.001)
        raise SystemExit(f"broadcast: v{version} not received in 600 s")

    def sglang_start(self, model_dir: str) -> dict[str, Any]:
        """The rebuilt SGLang server holding the launch model, and the adapter driving it."""
        sys.path.insert(0, str(REPO / "tests"))
        from sglang_server import FakeSGLangServer

        from actors.engines.sglang_engine import SGLangEngine

        self.server = FakeSGLangServer(model_dir=model_dir, health_poll_s=0.01)
        self.server.start()
        self.engine = SGLangEngine([self.server.url], slots=1, weights_dir=self.cache / "sglang")
        return {}

    def sglang_disk(self, path: str, sha256: str, version: int) -> dict[str, Any]:
        """The worker's sha256 of a file it reads in place, then the adapter's load: a directory linking
        it, /update_weights_from_disk (the server reads the safetensors), the weight_version checked."""
        from april.files import sha256_file

        started = time.perf_counter()
        if sha256_file(Path(path)) != sha256:
            raise SystemExit(f"sglang-disk: sha256 of {path} is not the announced one")
        verified = time.perf_counter()
        self.engine.load_weights(Path(path), version)
        return {"verify_s": verified - started, "load_s": time.perf_counter() - verified}

    def sglang_join(self, port: int, timeout_s: float) -> dict[str, Any]:
        from actors.weight_receive import BroadcastMember

        self.sglang_member = BroadcastMember("bench-sglang", timeout_s, servers=self.engine.broadcast_servers)
        self.sglang_member.join("127.0.0.1", port)
        return {}

    def sglang_broadcast_wait(self, version: int) -> dict[str, Any]:
        """Take the offered version and load it as the worker loop does: every bucket posted while the hub
        sends, then the version and one sampled tensor a bucket read back."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            offer = self.sglang_member.offer()
            if offer is not None and offer.version == version:
                started = time.perf_counter()
                self.engine.load_broadcast(offer)  # raises on a failed or mismatched version
                return {"bytes": offer.manifest.nbytes, "load_s": time.perf_counter() - started}
            errors = self.sglang_member.errors()
            if errors:
                print(f"sglang member: {'; '.join(errors)}", file=sys.stderr, flush=True)
            time.sleep(0.001)
        raise SystemExit(f"sglang-broadcast: v{version} not offered in 600 s")

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
        if self.member is not None:
            self.member.close()
        if getattr(self, "sglang_member", None) is not None:
            self.sglang_member.close()
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if getattr(self, "server", None) is not None:
            self.server.stop()


def child_main(cache_dir: Path | None) -> None:
    with tempfile.TemporaryDirectory(prefix="april-weight-sync-cache-", dir=cache_dir) as cache:
        worker = Worker(Path(cache))
        try:
            for line in sys.stdin:
                command = json.loads(line)
                op = command.pop("op")
                if op == "exit":
                    break
                answer = getattr(worker, op)(**command)
                if "path" in answer:  # the worker loads what it got, as an engine would
                    answer["load_s"] = worker.load_file(Path(answer.pop("path")))
                print(json.dumps(answer), flush=True)
        finally:
            worker.close()


# ------------------------------------------------------------------------------------------- the learner


class Child:
    """The worker process of one size: answers one command at a time (JSON lines)."""

    def __init__(self, cache_dir: Path | None) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
        }
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", *(["--cache-dir", str(cache_dir)] if cache_dir else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def send(self, op: str, **command: Any) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps({"op": op, **command}) + "\n")
        stdin.flush()

    def answer(self) -> dict[str, Any]:
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise SystemExit(f"weight_sync: the worker process exited (code {self.proc.wait(60)})")
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, op: str, **command: Any) -> dict[str, Any]:
        self.send(op, **command)
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure_loopback(child: Child, nbytes: int, chunk: int) -> dict[str, Any]:
    payload = memoryview(os.urandom(chunk))
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        child.send("loopback", port=server.getsockname()[1], nbytes=nbytes, chunk=chunk)
        conn, _ = server.accept()  # connecting is not part of the transfer
        with conn:
            conn.settimeout(600)
            started = time.perf_counter()
            sent = 0
            while sent < nbytes:
                n = min(chunk, nbytes - sent)
                conn.sendall(payload[:n])
                sent += n
            if conn.recv(1) != b"k":
                raise SystemExit("loopback: the receiver did not acknowledge")
            seconds = time.perf_counter() - started
    assert child.answer()["bytes"] == nbytes
    return {"transfer_s": seconds, "bytes": nbytes}


class Learner:
    """The learner's side of every transport for one size: publishes versions into a weights directory,
    serves them (network) and broadcasts them (broadcast) to the one child."""

    def __init__(
        self,
        state: dict[str, Any],
        size: Size,
        weights_dir: Path,
        transports: list[str],
        child: Child,
        settings: list[str],
    ) -> None:
        self.state, self.weights_dir, self.child = state, weights_dir, child
        self.cfg = weights_config(settings, port=free_port_pair())
        self.version = 0
        self.service: Any = None
        self.hub: Any = None
        self.sglang_hub: Any = None
        if "network" in transports:
            from learner.weight_service import WeightService

            self.service = WeightService(weights_dir, self.cfg, keys=None, broker_host="127.0.0.1")
            self.service.start()
        if "broadcast" in transports:
            from learner.weight_broadcast import BroadcastHub

            self.hub = BroadcastHub.from_config(self.cfg, "127.0.0.1")
            child.ask("broadcast_join", port=self.cfg.port + 1, timeout_s=self.cfg.timeout_s)
            wait_joined(self.hub, "broadcast")
        if "sglang-disk" in transports or "sglang-broadcast" in transports:
            child.ask("sglang_start", model_dir=str(launch_dir(state, size, weights_dir.parent / "launch")))
        if "sglang-broadcast" in transports:
            from learner.weight_broadcast import BroadcastHub

            cfg = weights_config(settings, port=free_port_pair())
            self.sglang_hub = BroadcastHub.from_config(cfg, "127.0.0.1")
            child.ask("sglang_join", port=cfg.port + 1, timeout_s=cfg.timeout_s)
            wait_joined(self.sglang_hub, "sglang-broadcast")

    def publish(self) -> tuple[Path, str, float]:
        from learner.weights import publish

        self.version += 1
        started = time.perf_counter()
        path, sha256 = publish(self.state, self.weights_dir, self.version, keep=2)
        return path, sha256, time.perf_counter() - started

    def file(self) -> dict[str, Any]:
        path, sha256, publish_s = self.publish()
        started = time.perf_counter()
        got = self.child.ask("file", path=str(path), sha256=sha256)
        return {**got, "publish_s": publish_s, "sync_s": publish_s + time.perf_counter() - started,
                "bytes": path.stat().st_size}  # fmt: skip

    def network(self) -> dict[str, Any]:
        from april.config import WeightsTransport
        from learner.weight_service import announce_location

        path, sha256, publish_s = self.publish()
        location = announce_location(WeightsTransport.NETWORK, path, self.service.endpoint)
        wanted = {k: getattr(self.cfg, k) for k in ("port", "chunk_bytes", "window", "timeout_s", "keep")}
        started = time.perf_counter()
        got = self.child.ask("network", uri=location.uri(), version=self.version, sha256=sha256, cfg=wanted)
        return {**got, "publish_s": publish_s, "sync_s": publish_s + time.perf_counter() - started,
                "bytes": path.stat().st_size}  # fmt: skip

    def broadcast(self) -> dict[str, Any]:
        path, got, wall_s, publish_s, _ = self._broadcast("broadcast", self.hub, "bench-worker")
        return {"publish_s": publish_s, "transfer_s": wall_s - got["load_s"], "load_s": got["load_s"],
                "sync_s": publish_s + wall_s, "bytes": got["bytes"],
                "file_bytes": path.stat().st_size}  # fmt: skip

    def sglang_disk(self) -> dict[str, Any]:
        path, sha256, publish_s = self.publish()
        started = time.perf_counter()
        got = self.child.ask("sglang_disk", path=str(path), sha256=sha256, version=self.version)
        wall_s = time.perf_counter() - started
        return {**got, "publish_s": publish_s, "transfer_s": wall_s, "sync_s": publish_s + wall_s,
                "bytes": path.stat().st_size}  # fmt: skip

    def sglang_broadcast(self) -> dict[str, Any]:
        path, got, wall_s, publish_s, report = self._broadcast(
            "sglang_broadcast", self.sglang_hub, "bench-sglang"
        )
        return {"publish_s": publish_s, "transfer_s": wall_s, "sync_s": publish_s + wall_s,
                "server_s": got["load_s"], "bytes": got["bytes"],
                "file_bytes": path.stat().st_size, "buckets": report.buckets}  # fmt: skip

    def _broadcast(self, op: str, hub: Any, member: str) -> tuple[Path, dict[str, Any], float, float, Any]:
        """Publish, have the child wait for the version (`op`_wait), broadcast it from `hub` and wait for
        the child's answer: (file, answer, seconds from the broadcast to the answer, publish seconds,
        the hub's report)."""
        path, _, publish_s = self.publish()
        self.child.send(f"{op}_wait", version=self.version)
        started = time.perf_counter()
        report = hub.broadcast(self.state, self.version)
        if member not in report.reached:
            raise SystemExit(f"{op}: v{self.version} did not reach {member}: {report}")
        got = self.child.answer()
        return path, got, time.perf_counter() - started, publish_s, report

    def close(self) -> None:
        if self.service is not None:
            self.service.stop()
        if self.hub is not None:
            self.hub.close()
        if self.sglang_hub is not None:
            self.sglang_hub.close()


def wait_joined(hub: Any, transport: str) -> None:
    """Until the child's member joined `hub` (it joins on its own thread)."""
    deadline = time.monotonic() + 60
    while not (hub.waiting() or hub.members):
        if time.monotonic() > deadline:
            raise SystemExit(f"{transport}: the worker did not join the rendezvous in 60 s")
        time.sleep(0.01)


def launch_dir(state: dict[str, Any], size: Size, model_dir: Path) -> Path:
    """A model directory of the launch weights (the state itself, as the server starts from it)."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    model_config(size).save_pretrained(model_dir)
    save_file(state, str(model_dir / "model.safetensors"))
    return model_dir


def summarise(rounds: list[dict[str, Any]], loopback_gbps: float | None) -> dict[str, Any]:
    """Medians over the measured rounds; GB/s of the transfer and its ratio to loopback's."""
    out: dict[str, Any] = {"rounds": rounds}
    for key in ("sync_s", "publish_s", "transfer_s", "load_s", "verify_s", "server_s"):
        if key in rounds[0]:
            out[key] = statistics.median(r[key] for r in rounds)
    out["bytes"] = rounds[0]["bytes"]
    out["transfer_gbps"] = out["bytes"] / out["transfer_s"] / GB
    if loopback_gbps:
        out["vs_loopback"] = out["transfer_gbps"] / loopback_gbps
    return out


def measure_size(name: str, args: argparse.Namespace, transports: list[str]) -> dict[str, Any]:
    size = SIZES[name]
    built = time.perf_counter()
    state = state_dict(size, args.seed)
    parameters = sum(t.numel() for t in state.values())
    print(
        f"{name}: {parameters / 1e6:.1f}M parameters built in {time.perf_counter() - built:.0f} s", flush=True
    )
    child = Child(args.cache_dir)
    raw: dict[str, list[dict[str, Any]]] = {t: [] for t in ["loopback", *transports]}
    with tempfile.TemporaryDirectory(prefix="april-weight-sync-") as scratch:
        learner = Learner(state, size, Path(scratch) / "weights", transports, child, args.set)
        try:
            nbytes = 0
            for round_ in range(args.rounds + 1):  # round 0: the warm-up
                for transport in transports:
                    raw[transport].append(getattr(learner, transport.replace("-", "_"))())
                    nbytes = raw[transport][-1].get("file_bytes", raw[transport][-1]["bytes"])
                raw["loopback"].append(measure_loopback(child, nbytes, learner.cfg.chunk_bytes))
                shown = ", ".join(f"{t} {raw[t][-1]['transfer_s']:.3f} s" for t in raw)
                print(f"{name} round {round_}{' (warm-up)' if round_ == 0 else ''}: {shown}", flush=True)
        finally:
            child.close()  # first: its members leave before the hubs' stores go away
            learner.close()
    loopback = summarise(raw["loopback"][1:], None)
    result: dict[str, Any] = {
        "size": name,
        "model": dataclasses.asdict(size),
        "parameters": parameters,
        "loopback": {**loopback, "warmup": raw["loopback"][0]},
        "transports": {
            t: {**summarise(raw[t][1:], loopback["transfer_gbps"]), "warmup": raw[t][0]} for t in transports
        },
    }
    if {"sglang-disk", "sglang-broadcast"} <= set(transports):  # the two paths into one server, as ratios
        disk, collective = result["transports"]["sglang-disk"], result["transports"]["sglang-broadcast"]
        result["sglang_disk_over_broadcast"] = {
            k: disk[k] / collective[k] for k in ("sync_s", "transfer_s") if collective[k] > 0
        }
    del state
    return result


def print_table(sizes: list[dict[str, Any]]) -> None:
    print(f"{'size':>5} {'transport':>9} {'sync s':>8} {'transfer s':>10} {'GB/s':>7} {'x loopback':>10}")
    for s in sizes:
        lb = s["loopback"]
        print(f"{s['size']:>5} {'loopback':>9} {'-':>8} {lb['transfer_s']:10.3f} {lb['transfer_gbps']:7.2f}")
        for t, r in s["transports"].items():
            print(
                f"{s['size']:>5} {t:>9} {r['sync_s']:8.3f} {r['transfer_s']:10.3f} "
                f"{r['transfer_gbps']:7.2f} {r['vs_loopback']:10.2f}"
            )


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args.cache_dir)
        return
    from april.provenance import provenance

    stamp = provenance()
    wanted = args.transports.split(",")
    transports = [t for t in wanted if available(t)]
    skipped = {t: f"not in this tree (needs {', '.join(NEEDS[t])})" for t in wanted if t not in transports}
    for t, why in skipped.items():
        print(f"{t}: skipped, {why}", flush=True)
    started = time.perf_counter()
    sizes = [measure_size(name, args, transports) for name in args.sizes.split(",")]
    print_table(sizes)
    for s in sizes:
        if "sglang_disk_over_broadcast" in s:
            ratios = s["sglang_disk_over_broadcast"]
            print(f"{s['size']}: sglang disk / broadcast: sync {ratios['sync_s']:.2f}x, "
                  f"after the publish {ratios['transfer_s']:.2f}x", flush=True)  # fmt: skip
    report = {
        "benchmark": "weight_sync",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
        "provenance": stamp,
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "wall_s": time.perf_counter() - started,
        "target_network_vs_loopback": TARGET_NETWORK_VS_LOOPBACK,
        "transports": transports,
        "skipped": skipped,
        "sizes": sizes,
    }
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
