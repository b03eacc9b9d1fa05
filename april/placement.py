"""Where `april up`'s processes run on one node: the GPUs of the learner and of each engine.

Owns the placement rule (docs/design.md section 9): the node's GPUs (what CUDA_VISIBLE_DEVICES names, or
0..n-1), the learner on `learner.gpus` of them (default half) as that many ranks, the engines on the rest,
`worker.gpus_per_engine` each, one worker per engine; on one GPU the learner and the engines share it;
a role that runs on no GPU (the sim engine or learner, a "cpu" device) gets none. A request that does not
fit is one `PlacementError` line. Pure: the node's GPUs are given, so `april up --plan --gpus 8` plans a
node from any machine; no torch. Does not start processes (cli/up_cmd.py) nor pick the device inside
one (april/devices.py): each process is handed its GPUs as CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from april.config import Config, ConfigError, WorkerConfig

GPU_ENGINES = ("torch", "vllm", "sglang")  # engines that run on GPUs (sim runs on none)
TENSOR_PARALLEL_ENGINES = ("vllm", "sglang")  # engines that can spread one model over several GPUs
DEFAULT_CPU_WORKERS = 2  # workers on a machine (or for engines) without GPUs


class PlacementError(ConfigError):
    """A placement the node cannot give (more GPUs than it has, a role left none); one line."""


class Role(StrEnum):
    BROKER = "broker"
    LEARNER = "learner"
    WORKER = "worker"
    SGLANG = "sglang"  # an SGLang server that `april up` starts for a worker


@dataclass(frozen=True, slots=True)
class Process:
    """One process of the run: its name (its log's stem), role, GPUs and, for the learner, ranks."""

    name: str
    role: Role
    gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES entries; empty: no GPU
    ranks: int = 1

    def to_json(self) -> dict[str, object]:
        gpus = [int(g) if g.isdigit() else g for g in self.gpus]
        return {"name": self.name, "role": str(self.role), "gpus": gpus, "ranks": self.ranks}


@dataclass(frozen=True, slots=True)
class Placement:
    """The node's GPUs and who runs on which. `engines[i]` are worker i's GPUs."""

    node: tuple[str, ...]
    learner: tuple[str, ...]
    learner_ranks: int
    engines: tuple[tuple[str, ...], ...]
    starts_sglang: bool  # `april up` starts one SGLang server per engine

    @property
    def shared(self) -> bool:
        """The learner and an engine run on the same GPU (a node of one GPU)."""
        return any(set(e) & set(self.learner) for e in self.engines)

    def processes(self) -> list[Process]:
        """Every process, in start order: broker, (servers,) workers, learner."""
        out = [Process("broker", Role.BROKER, ())]
        if self.starts_sglang:
            out += [Process(f"sglang-{i}", Role.SGLANG, g) for i, g in enumerate(self.engines)]
        out += [Process(f"worker-{i}", Role.WORKER, g) for i, g in enumerate(self.engines)]
        out.append(Process("learner", Role.LEARNER, self.learner, self.learner_ranks))
        return out

    def env(self, gpus: Sequence[str]) -> dict[str, str]:
        """A process's environment additions: its GPUs, and none at all on a node without any."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if self.node else {}

    def resolved(self, config: Config) -> Config:
        """`config` with the learner's ranks written down (learner.gpus): what its process spawns, and what
        a resumed run must find again."""
        return dataclasses.replace(
            config, learner=dataclasses.replace(config.learner, gpus=self.learner_ranks)
        )


def node_gpus(count: int, env: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs of this node as a child's CUDA_VISIBLE_DEVICES names them: the first `count` entries of
    this process's CUDA_VISIBLE_DEVICES when it is set (its order kept), else "0".."count-1"."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return tuple(str(i) for i in range(count))
    return tuple(x.strip() for x in visible.split(",") if x.strip())[:count]


def gpu_list(gpus: Sequence[str]) -> str:
    """For people: "GPU 4", "GPUs 0,1,2,3", "no GPU"."""
    if not gpus:
        return "no GPU"
    return f"GPU {gpus[0]}" if len(gpus) == 1 else "GPUs " + ",".join(gpus)


def starts_sglang(worker: WorkerConfig) -> bool:
    """Whether `april up` starts the SGLang servers (engine sglang, no `worker.sglang_urls`)."""
    return worker.engine == "sglang" and not worker.sglang_urls.strip()


def learner_uses_gpus(config: Config) -> bool:
    return config.learner.backend != "sim" and config.learner.device != "cpu"


def engines_use_gpus(config: Config) -> bool:
    """Whether the engines take this node's GPUs: not the sim engine, not on "cpu", and not SGLang servers
    the user runs (`worker.sglang_urls`)."""
    wc = config.worker
    if wc.engine == "sglang":
        return starts_sglang(wc)
    return wc.engine in GPU_ENGINES and wc.device != "cpu"


def wants_gpus(config: Config) -> bool:
    """Whether any role of `config` would run on a GPU if the node had one."""
    return learner_uses_gpus(config) or engines_use_gpus(config)


def place(config: Config, node: Sequence[str], workers: int | None = None) -> Placement:
    """Place the learner and `workers` engines (None: as many as fit; 2 without GPUs) on `node`."""
    node = tuple(node)
    lc, wc = config.learner, config.worker
    learner_on_gpu = bool(node) and learner_uses_gpus(config)
    engines_on_gpu = bool(node) and engines_use_gpus(config)
    _check_request(config, node, learner_on_gpu, engines_on_gpu)
    per_engine = wc.gpus_per_engine if engines_on_gpu else 0
    learner: tuple[str, ...]
    free: tuple[str, ...]
    engines: tuple[tuple[str, ...], ...]
    if learner_on_gpu and engines_on_gpu and len(node) == 1:  # one GPU: both roles on it
        learner, free = node, node
    elif learner_on_gpu:
        wanted = lc.gpus or (1 if lc.backend == "torch" else len(node) // 2 if engines_on_gpu else len(node))
        learner, free = node[:wanted], node[wanted:]
    else:
        learner, free = (), node
    if engines_on_gpu and len(free) < per_engine:
        raise PlacementError(
            f"worker.gpus_per_engine = {per_engine}: the engines have {len(free)} of this node's "
            f"{len(node)} GPUs (learner.gpus = {len(learner)} of them for the learner)"
        )
    fit = len(free) // per_engine if per_engine else DEFAULT_CPU_WORKERS
    if engines_on_gpu and len(node) == 1:
        fit = 1  # the default on a shared GPU; more may share it when asked for
    count = workers or fit
    if engines_on_gpu and len(node) > 1 and count > fit:
        raise PlacementError(
            f"--workers {count} x worker.gpus_per_engine {per_engine} needs {count * per_engine} GPUs; "
            f"the engines have {len(free)} (this node's {len(node)} less learner.gpus = {len(learner)})"
        )
    if engines_on_gpu and len(node) == 1:
        engines = tuple(node for _ in range(count))
    elif engines_on_gpu:
        engines = tuple(free[i * per_engine : (i + 1) * per_engine] for i in range(count))
    else:
        engines = tuple(() for _ in range(count))
    ranks = len(learner) if learner_on_gpu else (lc.gpus or 1)
    return Placement(node, learner, ranks, engines, starts_sglang(wc))


def _check_request(config: Config, node: tuple[str, ...], learner_on_gpu: bool, engines_on_gpu: bool) -> None:
    """What no split of this node can give, each as one line."""
    lc, wc = config.learner, config.worker
    if lc.gpus > len(node) and learner_on_gpu:
        raise PlacementError(f"learner.gpus = {lc.gpus}: this node has {node_words(node)}")
    if lc.gpus > 1 and lc.backend == "torch":
        raise PlacementError(
            f"learner.gpus = {lc.gpus}: learner.backend = 'torch' runs one process; "
            "expected 1, or learner.backend = 'deepspeed' for several ranks"
        )
    if wc.gpus_per_engine > 1 and wc.engine not in TENSOR_PARALLEL_ENGINES:
        raise PlacementError(
            f"worker.gpus_per_engine = {wc.gpus_per_engine}: engine {wc.engine!r} runs on one GPU "
            f"(several GPUs per engine need {' or '.join(TENSOR_PARALLEL_ENGINES)})"
        )
    if engines_on_gpu and wc.gpus_per_engine > len(node):
        raise PlacementError(
            f"worker.gpus_per_engine = {wc.gpus_per_engine}: this node has {node_words(node)}"
        )
    if learner_on_gpu and engines_on_gpu and len(node) > 1 and lc.gpus >= len(node):
        raise PlacementError(
            f"learner.gpus = {lc.gpus} leaves the engines none of this node's {len(node)} GPUs "
            f"(at most {len(node) - wc.gpus_per_engine})"
        )
    if len(node) > 1:
        for name, device, on_gpu in (
            ("learner.device", lc.device, learner_on_gpu),
            ("worker.device", wc.device, engines_on_gpu),
        ):
            if on_gpu and device.startswith("cuda:"):
                raise PlacementError(
                    f"{name} = {device!r}: april up gives each process its own GPUs (CUDA_VISIBLE_DEVICES); "
                    "expected 'auto' or 'cuda'"
                )


def node_words(node: Sequence[str]) -> str:
    return "no GPU" if not node else ("1 GPU" if len(node) == 1 else f"{len(node)} GPUs")
