"""The DeepSpeed config dict, built by one pure function of the learner's training settings.

Owns the mapping from our settings (ZeRO stage, batch split, AdamW hyper-parameters, clipping, device) to
DeepSpeed's JSON config: fp32 + `torch.optim.AdamW` (`"torch_adam": true`) on CPU; bf16 on CUDA with
torch's fused AdamW (`"torch_adam": true, "fused": true`, which DeepSpeed 0.19.8 passes on to
`torch.optim.AdamW`: `runtime/engine.py`, `get_optimizer_configuration`) or, with `adam_impl`
"deepspeed", DeepSpeed's FusedAdam (an op it builds with nvcc at first use). Nothing else: it imports
nothing heavy, touches no process group and reads no environment, so it is unit-tested as a plain dict.

Batch arithmetic (DeepSpeed checks it at initialize):
`train_batch_size = micro_batch_size * grad_accum_steps * world_size`, all in samples.
"""

from __future__ import annotations

from typing import Any, Literal

Device = Literal["cpu", "cuda"]
AdamImpl = Literal["torch", "deepspeed"]  # learner.adam_impl: whose AdamW steps on CUDA

ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed prints a line every `steps_per_print` steps; the learner logs its own metrics.
_QUIET_STEPS = 2**31 - 1


def deepspeed_config(
    *,
    zero_stage: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    grad_clip: float,
    device: Device,
    world_size: int,
    adam_impl: AdamImpl = "torch",
) -> dict[str, Any]:
    """The config for `deepspeed.initialize`; raises ValueError naming the bad argument.

    `grad_clip` <= 0 disables clipping. The optimizer is always AdamW (decoupled weight decay).
    """
    _check(zero_stage in ZERO_STAGES, "zero_stage", zero_stage, "one of 0, 1, 2, 3")
    _check(micro_batch_size >= 1, "micro_batch_size", micro_batch_size, ">= 1")
    _check(grad_accum_steps >= 1, "grad_accum_steps", grad_accum_steps, ">= 1")
    _check(world_size >= 1, "world_size", world_size, ">= 1")
    _check(lr > 0, "lr", lr, "> 0")
    _check(weight_decay >= 0, "weight_decay", weight_decay, ">= 0")
    _check(all(0 <= b < 1 for b in betas) and len(betas) == 2, "betas", betas, "two values in [0, 1)")
    _check(eps > 0, "eps", eps, "> 0")
    _check(device in ("cpu", "cuda"), "device", device, '"cpu" or "cuda"')
    _check(adam_impl in ("torch", "deepspeed"), "adam_impl", adam_impl, '"torch" or "deepspeed"')
    on_gpu = device == "cuda"
    adam: dict[str, Any] = {
        # CPU: torch.optim.AdamW (DeepSpeed's CPU Adam needs a compiled op and differs from torch's).
        # CUDA: torch's fused AdamW (nothing to build), or DeepSpeed's FusedAdam in AdamW mode.
        "torch_adam": not on_gpu or adam_impl == "torch",
    }
    if on_gpu and adam_impl == "torch":
        adam["fused"] = True
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        # Publishing gathers parameters one by one; never let DeepSpeed keep a full copy around.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    return {
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": max(0.0, float(grad_clip)),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": float(lr),
                "betas": [float(betas[0]), float(betas[1])],
                "eps": float(eps),
                "weight_decay": float(weight_decay),
                **adam,
            },
        },
        "bf16": {"enabled": on_gpu},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
    }


def _check(ok: bool, name: str, got: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"deepspeed_config: {name} = {got!r}, expected {expected}")
