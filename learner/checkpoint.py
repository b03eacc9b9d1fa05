"""Learner checkpoints: `checkpoints/step_{step:08d}/`, complete or absent, never half-written.

A checkpoint holds the engine's state (`engine/`: model, optimizer, LR scheduler, DeepSpeed's or ours),
every rank's RNG states (`rng_rank{r}.json`: python `random`, numpy's global generator, torch CPU and
CUDA) and `meta.json` (step, version, last batch id, world size, backend, ZeRO stage, optimizer). It is
written
into `.tmp-step_*` by every rank and renamed into place by rank 0 once `meta.json` is on disk, so
`latest()` only ever sees complete checkpoints; a crash leaves a temp dir that the next save removes.

Resuming restores all of it, so the next step equals the one an uninterrupted run would have taken.
A checkpoint resumes only into the layout that wrote it (same number of ranks, backend and ZeRO stage, and
an optimizer whose state it holds: torch's AdamW, fused or not, or DeepSpeed's FusedAdam): DeepSpeed's
engine files are one per rank and ZeRO-1..3 split the optimizer state (ZeRO-3 the weights too) by rank,
and every rank's RNG state is its own. Any other layout is refused with one line before anything loads
(`check_resumable`) rather than half-restored.
Nothing here is pickled by us: metadata and RNG are JSON (DeepSpeed pickles its own engine files).
Does not decide when to checkpoint (the learner loop does, every `checkpoint_every` steps).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from april.config import ConfigError
from april.files import fsync_dir
from learner.engine import TrainEngine

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
META = "meta.json"


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    step: int  # learner steps done (the next step is step + 1)
    version: int  # weights version published after `step`
    last_batch_id: int  # id of the last batch trained; -1 if none
    world_size: int = 1
    backend: str = "deepspeed"
    zero_stage: int = 0
    optimizer: str = ""  # TrainSettings.optimizer ("torch fused AdamW", ...); "" in older checkpoints


class CheckpointError(ConfigError):
    """A checkpoint this run's configuration cannot resume from (another number of ranks, backend or ZeRO
    stage); a ConfigError, so the command line shows it as one line."""


def step_dir(checkpoints_dir: Path, step: int) -> Path:
    return Path(checkpoints_dir) / f"step_{step:08d}"


def latest(checkpoints_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    complete = _complete(Path(checkpoints_dir))
    return complete[-1] if complete else None


def save(engine: TrainEngine, checkpoints_dir: Path, meta: CheckpointMeta, *, keep: int = 2) -> Path:
    """Write a checkpoint on every rank (a collective); returns its directory. Keeps the newest `keep`."""
    if keep < 1:
        raise ValueError(f"checkpoint.save: keep = {keep}, expected >= 1")
    checkpoints_dir = Path(checkpoints_dir)
    final = step_dir(checkpoints_dir, meta.step)
    tmp = checkpoints_dir / f".tmp-{final.name}"
    if engine.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    engine.barrier()
    engine.save_checkpoint(tmp / "engine")
    _write_json(tmp / f"rng_rank{engine.rank}.json", rng_state())
    engine.barrier()
    if engine.rank == 0:
        _write_json(tmp / META, dataclasses.asdict(meta))
        old = checkpoints_dir / f".old-{final.name}"
        if final.exists():  # the same step saved again (e.g. after a resume): move it aside first
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(checkpoints_dir)
        shutil.rmtree(old, ignore_errors=True)
        _prune(checkpoints_dir, keep)
    engine.barrier()
    return final


def read_meta(path: Path) -> CheckpointMeta:
    """The metadata of checkpoint `path` (cheap: loads nothing else); ValueError if it has none."""
    try:
        raw = json.loads((Path(path) / META).read_text(encoding="utf-8"))
        return CheckpointMeta(**raw)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a complete checkpoint ({META}: {exc})") from exc


def check_resumable(
    path: Path, meta: CheckpointMeta, *, world_size: int, backend: str, zero_stage: int, optimizer: str = ""
) -> None:
    """Raise CheckpointError unless checkpoint `path` (with `meta`) was written by this layout: the same
    number of ranks, backend and ZeRO stage (the torch backend has no stages), and an optimizer of the same
    kind (torch's AdamW and DeepSpeed's FusedAdam keep their state differently; an older checkpoint that
    does not say is taken as it is)."""
    wrote, runs = (
        _layout(meta.world_size, meta.backend, meta.zero_stage),
        _layout(world_size, backend, zero_stage),
    )
    if wrote != runs:
        raise CheckpointError(
            f"checkpoint {path} was written by {wrote}; this learner runs {runs}: resume with the layout "
            "that wrote it (its engine state is split by rank), or start a new run"
        )
    if meta.optimizer and optimizer and _adam_kind(meta.optimizer) != _adam_kind(optimizer):
        raise CheckpointError(
            f"checkpoint {path} holds the state of {meta.optimizer}; this learner steps {optimizer}: set "
            f'learner.adam_impl="{_adam_kind(meta.optimizer)}" to resume it, or start a new run'
        )


def _adam_kind(optimizer: str) -> str:
    """The `learner.adam_impl` an optimizer name belongs to: "deepspeed" (FusedAdam) or "torch"."""
    return "deepspeed" if optimizer.startswith("DeepSpeed") else "torch"


def _layout(world_size: int, backend: str, zero_stage: int) -> str:
    """How a layout reads in a message: '2 ranks of DeepSpeed ZeRO-3', '1 rank of plain torch'."""
    engine = f"DeepSpeed ZeRO-{zero_stage}" if backend == "deepspeed" else f"plain {backend}"
    return f"{world_size} rank{'s' if world_size != 1 else ''} of {engine}"


def load(engine: TrainEngine, path: Path) -> CheckpointMeta:
    """Restore the engine and this rank's RNG from checkpoint `path`; returns its metadata."""
    path = Path(path)
    meta = read_meta(path)
    settings = engine.settings
    check_resumable(
        path, meta, world_size=engine.world_size, backend=settings.backend, zero_stage=settings.zero_stage
    )
    engine.load_checkpoint(path / "engine")
    set_rng_state(json.loads((path / f"rng_rank{engine.rank}.json").read_text(encoding="utf-8")))
    return meta


# ---------------------------------------------------------------------- RNG as JSON


def rng_state() -> dict[str, Any]:
    """The global RNG states (python, numpy, torch CPU and every CUDA device) as JSON-able values."""
    import numpy as np
    import torch

    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: (name, keys, pos, has_gauss, cached_gaussian)
    name, keys, pos, has_gauss, cached = np_state
    return {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _b64(t: Any) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> Any:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


# ---------------------------------------------------------------------- files


def _complete(checkpoints_dir: Path) -> list[Path]:
    if not checkpoints_dir.is_dir():
        return []
    found = [(m, p) for p in checkpoints_dir.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for m, p in sorted(found, key=lambda mp: int(mp[0].group(1))) if (p / META).is_file()]


def _prune(checkpoints_dir: Path, keep: int) -> None:
    for old in _complete(checkpoints_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in [*checkpoints_dir.glob(".tmp-step_*"), *checkpoints_dir.glob(".old-step_*")]:
        shutil.rmtree(stale, ignore_errors=True)


def _write_json(path: Path, value: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
