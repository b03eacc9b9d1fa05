"""The training engine: one small API over plain torch or DeepSpeed (ZeRO 0-3, CPU gloo or GPU NCCL).

Owns the optimizer (AdamW: torch's, fused on CUDA, or DeepSpeed's FusedAdam with `adam_impl`
"deepspeed"), gradient clipping, gradient accumulation, the optional linear LR warm-up, the process group
DeepSpeed needs, gathering full weights for publishing, and saving/loading the engine's own state (model,
optimizer, scheduler, step count) into a directory. Which of DeepSpeed's compiled ops get built, where and
how is `learner.ds_ops`.

Knows nothing of RL, samples or tokenization: the caller gives a loss function
`(model, micro_batch) -> scalar loss tensor` and calls `forward_backward` once per micro-batch, then
`step()` once per optimizer step (exactly `grad_accum_steps` micro-batches per step, per rank; the count
may change between optimizer steps with `set_accumulation`, for token-budgeted micro-batches).
The applied gradient is the mean over micro-batches and ranks of each micro-batch loss's gradient
(DeepSpeed's semantics, reproduced by the torch backend), so a micro-batch loss should be a mean.
Does not write weights files (`learner.weights`) nor checkpoint metadata/RNG (`learner.checkpoint`).
Heavy imports (torch, deepspeed, safetensors) happen inside functions.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from april.ports import free_ports
from learner.ds_config import ZERO_STAGES, AdamImpl, deepspeed_config
from learner.ds_ops import (
    build_fused_adam,
    name_a_cpu_accelerator,
    skip_shared_memory_comm_op,
    use_environment_extensions_dir,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from april.config import LearnerConfig

Backend = Literal["torch", "deepspeed"]
LossFn = Callable[[Any, Any], "torch.Tensor"]  # (forward-callable model, micro_batch) -> scalar loss


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """What the engine needs from the learner config (future `LearnerConfig` fields, same names)."""

    backend: Backend = "deepspeed"
    zero_stage: int = 0
    micro_batch_size: int = 1  # samples per micro-batch, per rank (DeepSpeed's batch bookkeeping)
    grad_accum_steps: int = 1  # micro-batches per optimizer step, per rank
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    warmup_steps: int = 0  # linear LR warm-up over this many optimizer steps; 0: constant LR
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N" (resolved: april.devices)
    adam_impl: AdamImpl = "torch"  # CUDA: torch's fused AdamW, or DeepSpeed's FusedAdam (built at first use)

    @classmethod
    def of(cls, lc: LearnerConfig, device: str, **overrides: Any) -> TrainSettings:
        """The settings `learner.*` gives, on `device` (already resolved), with `overrides` on top."""
        given: dict[str, Any] = {
            "backend": lc.backend,
            "zero_stage": lc.zero_stage,
            "grad_accum_steps": lc.micro_batches,
            "lr": lc.lr,
            "weight_decay": lc.weight_decay,
            "betas": (lc.beta1, lc.beta2),
            "eps": lc.adam_eps,
            "grad_clip": lc.grad_clip,
            "warmup_steps": lc.warmup_steps,
            "device": device,
            "adam_impl": lc.adam_impl.value,
        }
        return cls(**(given | overrides))

    def __post_init__(self) -> None:
        if self.backend not in ("torch", "deepspeed"):
            raise ValueError(f"backend = {self.backend!r}, expected 'torch' or 'deepspeed'")
        if self.adam_impl not in ("torch", "deepspeed"):
            raise ValueError(f"adam_impl = {self.adam_impl!r}, expected 'torch' or 'deepspeed'")
        if self.adam_impl == "deepspeed" and self.backend != "deepspeed":
            raise ValueError("adam_impl = 'deepspeed' needs backend = 'deepspeed'")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage = {self.zero_stage!r}, expected one of 0, 1, 2, 3")
        for name in ("micro_batch_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)!r}, expected >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps = {self.warmup_steps!r}, expected >= 0")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device = {self.device!r}, expected 'cpu', 'cuda' or 'cuda:N'")

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def optimizer(self) -> str:
        """The AdamW these settings step with, for people: "torch fused AdamW", "DeepSpeed FusedAdam"."""
        if not self.on_cuda:
            return "torch AdamW"
        return "DeepSpeed FusedAdam" if self.adam_impl == "deepspeed" else "torch fused AdamW"


def init_process_group(device: str) -> None:
    """Join (or create, for a lone process) the default process group: gloo on CPU, NCCL on CUDA.

    A launcher (torchrun, deepspeed) sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; a lone process gets
    rank 0 of 1 on a free loopback port. A group that already exists is reused.
    """
    name_a_cpu_accelerator()  # before DeepSpeed is imported
    import deepspeed  # type: ignore[import-untyped]
    import torch.distributed as dist

    if dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        return
    if "RANK" not in os.environ:
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(name, value)
        os.environ.setdefault("MASTER_PORT", str(free_ports(1)[0]))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    use_environment_extensions_dir()
    skip_shared_memory_comm_op()
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", verbose=False)


def leave_process_group() -> None:
    """Leave the default process group once every rank is done with it (a barrier, then the teardown).
    A rank that exits with the group still up can abort in gloo's destructors ("terminate called without
    an active exception", exit -6) while a peer still finishes its last collective: launchers then report
    a finished run as failed. Call it only when every rank gets there (not on an error path: the others
    would wait at the barrier)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _warmup_factor(warmup_steps: int) -> Callable[[int], float]:
    """LR multiplier for optimizer step s (0-based): (s + 1) / warmup_steps, then 1."""
    return lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0


class TrainEngine:
    """AdamW training of one HF model on plain torch (one process) or DeepSpeed (one process or many)."""

    def __init__(self, model: nn.Module, settings: TrainSettings) -> None:
        import torch

        self.settings = settings
        self._pending = 0  # micro-batches back-propagated since the last optimizer step
        self._accum = settings.grad_accum_steps  # micro-batches in the current optimizer step, per rank
        self._steps = 0  # optimizer steps taken (torch backend; DeepSpeed counts its own)
        self._ds: Any = None  # the DeepSpeedEngine (untyped)
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if settings.backend == "deepspeed":
            self._ds = self._init_deepspeed(model)
            self._model: nn.Module = self._ds.module
        else:
            self._model = model.to(settings.device)
            self._optimizer = torch.optim.AdamW(
                [p for p in self._model.parameters() if p.requires_grad],
                lr=settings.lr,
                betas=settings.betas,
                eps=settings.eps,
                weight_decay=settings.weight_decay,
                fused=True if settings.on_cuda else None,  # one kernel per step on CUDA, nothing to build
            )
            self._scheduler = torch.optim.lr_scheduler.LambdaLR(
                self._optimizer, _warmup_factor(settings.warmup_steps)
            )
        self._model.train()

    def _init_deepspeed(self, model: nn.Module) -> Any:
        """Join the process group and wrap `model` in a DeepSpeedEngine (returned; untyped)."""
        import deepspeed
        import torch
        import torch.distributed as dist

        s = self.settings
        init_process_group(s.device)
        on_gpu = s.on_cuda
        if on_gpu:  # DeepSpeed places the model on the current device: the one asked for, or the rank's
            index = torch.device(s.device).index
            torch.cuda.set_device(index if index is not None else int(os.environ.get("LOCAL_RANK", "0")))
        config = deepspeed_config(
            zero_stage=s.zero_stage,
            micro_batch_size=s.micro_batch_size,
            grad_accum_steps=s.grad_accum_steps,
            lr=s.lr,
            weight_decay=s.weight_decay,
            betas=s.betas,
            eps=s.eps,
            grad_clip=s.grad_clip,
            device="cuda" if on_gpu else "cpu",
            world_size=dist.get_world_size(),
            adam_impl=s.adam_impl,
        )
        if on_gpu and s.adam_impl == "deepspeed":
            build_fused_adam()  # now, so that a failed build is one line (StartupError), not a traceback
        warmup = _warmup_factor(s.warmup_steps)
        ds_engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup),
        )
        return ds_engine

    # ------------------------------------------------------------------ properties

    @property
    def module(self) -> nn.Module:
        """The underlying HF model: for no-grad forwards, `.config`, the device.

        Under ZeRO-3 its parameters are partitioned outside forward. A loss given to `backward` must come
        from `model`, not from this: under ZeRO-3 a grad forward through the bare module gives wrong
        gradients (DeepSpeed's backward set-up is hooked onto its own forward).
        """
        return self._model

    @property
    def model(self) -> Any:
        """What a loss is computed with (`model(input_ids=...)`): the DeepSpeed engine, or the model."""
        return self._ds if self._ds is not None else self._model

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def steps(self) -> int:
        """Optimizer steps taken (restored by `load_checkpoint`)."""
        return int(self._ds.global_steps) if self._ds is not None else self._steps

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        optimizer = self._ds.optimizer if self._ds is not None else self._optimizer
        assert optimizer is not None
        return float(optimizer.param_groups[0]["lr"])

    @property
    def accumulation(self) -> int:
        """Micro-batches (backward calls) per optimizer step, per rank, for the current step."""
        return self._accum

    # ------------------------------------------------------------------ training

    def set_accumulation(self, micro_batches: int) -> None:
        """Use `micro_batches` backward calls for the next optimizer step (same on every rank); only
        between optimizer steps. DeepSpeed's 1/accumulation loss scaling follows it."""
        if micro_batches < 1:
            raise ValueError(f"set_accumulation: micro_batches = {micro_batches}, expected >= 1")
        if self._pending:
            raise RuntimeError(f"set_accumulation() with {self._pending} micro-batches accumulated")
        self._accum = micro_batches
        if self._ds is not None:
            micro = self._ds.train_micro_batch_size_per_gpu()
            self._ds.set_train_batch_size(micro * micro_batches * self._ds.dp_world_size)
            self._ds.set_gradient_accumulation_boundary(micro_batches == 1)  # for the first forward

    def forward_backward(self, loss_fn: LossFn, micro_batch: Any) -> torch.Tensor:
        """`loss_fn(self.model, micro_batch)`, back-propagated; returns the (unscaled) loss, detached, on
        its device (reading it is the caller's choice: a read waits for the GPU)."""
        loss = loss_fn(self.model, micro_batch)
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of one micro-batch's loss (scaled by 1 / grad_accum_steps).

        The loss must come from a forward through `self.model` (see `module`).
        """
        accum = self._accum
        if self._pending >= accum:
            raise RuntimeError(f"backward() called {self._pending + 1} times before step(); expected {accum}")
        self._pending += 1
        if self._ds is None:
            (loss / accum).backward()  # type: ignore[no-untyped-call]
            return
        # the boundary set explicitly: DeepSpeed's own test counts micro-steps modulo the accumulation,
        # which goes wrong once the accumulation changes between steps
        self._ds.set_gradient_accumulation_boundary(self._pending == accum)
        self._ds.backward(loss)
        if self._pending < accum:
            self._ds.step()  # not a boundary: DeepSpeed only advances its micro-step counter

    def step(self) -> float:
        """Clip, apply AdamW, advance the LR schedule, clear gradients; returns the pre-clip grad norm."""
        accum = self._accum
        if self._pending != accum:
            raise RuntimeError(f"step() after {self._pending} backward() calls; expected {accum}")
        self._pending = 0
        if self._ds is None:
            return self._torch_step()
        norm = self._grad_norm() if self.settings.zero_stage == 0 else None
        self._ds.step()
        self._ds.set_gradient_accumulation_boundary(accum == 1)  # the next step's first forward
        if norm is None:
            got = self._ds.get_global_grad_norm()
            norm = float(got) if got is not None else float("nan")
        return norm

    def _torch_step(self) -> float:
        import torch

        assert self._optimizer is not None and self._scheduler is not None
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(), clip)
        self._optimizer.step()
        self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return float(norm)

    def _grad_norm(self) -> float:
        """Global L2 norm of the (already all-reduced) gradients in `param.grad` (ZeRO-0)."""
        import torch

        grads = [p.grad for p in self._model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))

    def zero_grad(self) -> None:
        """Clear gradients; only between optimizer steps (a partial accumulation cannot be undone)."""
        if self._pending:
            raise RuntimeError(
                f"zero_grad() with {self._pending} micro-batches accumulated; call step() first"
            )
        if self._ds is not None:
            self._ds.zero_grad()
        else:
            assert self._optimizer is not None
            self._optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Every rank, at the end of a run that every rank finished: leave the process group the DeepSpeed
        backend joined (`leave_process_group`)."""
        if self._ds is not None:
            leave_process_group()

    # ------------------------------------------------------------------ weights

    def state_dict_for_publish(self) -> dict[str, torch.Tensor]:
        """Full weights (fp32 on CPU, bf16 on GPU), detached CPU copies, on rank 0; `{}` on other ranks.

        A collective under ZeRO-3 (every rank must call it): parameters are gathered one at a time, so
        peak extra memory is one parameter, not the model. Copies never alias each other or the model.
        """
        sd = self._model.state_dict()
        if self._ds is None or self.settings.zero_stage < 3:
            return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()} if self.rank == 0 else {}
        import deepspeed

        params = dict(self._model.named_parameters(remove_duplicate=False))
        out: dict[str, torch.Tensor] = {}
        for name, tensor in sd.items():
            param = params.get(name)
            if param is None:  # a buffer: never partitioned
                if self.rank == 0:
                    out[name] = tensor.detach().to("cpu", copy=True)
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if self.rank == 0:
                    out[name] = param.detach().to("cpu", copy=True)
        return out

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: Path) -> None:
        """Model, optimizer, scheduler and step count into `directory` (a collective under DeepSpeed)."""
        directory.mkdir(parents=True, exist_ok=True)
        if self._ds is not None:
            self._ds.save_checkpoint(str(directory), tag="engine", save_latest=False)
            return
        import torch
        from safetensors.torch import save_file

        assert self._optimizer is not None and self._scheduler is not None
        save_file(self.state_dict_for_publish(), str(directory / "model.safetensors"))
        state = {
            "optimizer": self._optimizer.state_dict(),
            "scheduler": self._scheduler.state_dict(),
            "steps": self._steps,
        }
        torch.save(state, directory / "optimizer.pt")

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what `save_checkpoint` wrote; raises FileNotFoundError/RuntimeError naming the dir."""
        if self._ds is not None:
            loaded, _ = self._ds.load_checkpoint(str(directory), tag="engine")
            if loaded is None:
                raise RuntimeError(f"DeepSpeed could not load a checkpoint from {directory}/engine")
            return
        import torch
        from safetensors.torch import load_file

        assert self._optimizer is not None and self._scheduler is not None
        weights = load_file(str(directory / "model.safetensors"), device=str(self.settings.device))
        self._model.load_state_dict(weights)
        # weights_only: tensors and plain containers only, no arbitrary pickle
        state = torch.load(directory / "optimizer.pt", map_location=self.settings.device, weights_only=True)
        self._optimizer.load_state_dict(state["optimizer"])
        self._scheduler.load_state_dict(state["scheduler"])
        self._steps = int(state["steps"])

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
