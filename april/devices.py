"""Where a role runs: a configured device checked against the GPUs torch sees, resolved, and initialised.

Owns availability: `check_device` (is a `worker.device` / `learner.device` value usable here; a
`DeviceError` line naming the field, the value and what torch sees), `resolve_device` ("auto" becomes
"cuda" when torch sees a GPU, "cpu" otherwise; any other value is checked and kept) and `init_cuda`
(creates the CUDA context at start, so that a GPU or driver torch cannot use is one `StartupError` line
before the model loads, not a traceback in the middle of it), and `visible_gpus` (the node's GPUs a
process was given, for the status). The form of a value ('auto', 'cpu', 'cuda',
'cuda:N') is checked with the rest of the config (april/config.py), without torch. torch is imported
inside the functions, and only for a value that needs it: "cpu" never does, "auto" only to resolve.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from april.config import DEVICE, ConfigError
from april.placement import gpu_list
from april.startup import StartupError


class DeviceError(ConfigError):
    """A device torch does not see here (a config value the machine cannot honour); one line."""


def gpu_count() -> int:
    """CUDA GPUs torch sees (0 without CUDA). Creates no CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _no_gpu_reason() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    cuda = torch.version.cuda
    return f"torch {torch.__version__} (CUDA {cuda}) finds none: see nvidia-smi, CUDA_VISIBLE_DEVICES"


def check_device(value: str, name: str) -> None:
    """Raise DeviceError when `value` (already of a valid form) names a GPU torch does not see here.
    "auto" and "cpu" are always usable and import nothing."""
    match = DEVICE.fullmatch(value)
    if match is None:  # the config refuses these; a value built in code gets the same line
        raise DeviceError(f"{name} = {value!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not value.startswith("cuda"):
        return
    count = gpu_count()
    if count == 0:
        raise DeviceError(
            f"{name} = {value!r}: torch sees no CUDA GPU ({_no_gpu_reason()}); expected 'auto' or 'cpu'"
        )
    index = match[2]
    if index is not None and int(index) >= count:
        gpus = "GPU cuda:0" if count == 1 else f"{count} GPUs, cuda:0 to cuda:{count - 1}"
        raise DeviceError(f"{name} = {value!r}: torch sees {gpus}; expected one of those, 'cuda' or 'auto'")


def resolve_device(value: str, name: str) -> str:
    """The device to run on: "auto" -> "cuda" when torch sees a GPU, else "cpu"; others checked, kept."""
    if value == "auto":
        return "cuda" if gpu_count() > 0 else "cpu"
    check_device(value, name)
    return value


def init_cuda(device: str, role: str) -> None:
    """Create the CUDA context on `device` (a resolved CUDA device) now; StartupError if it cannot be
    (a driver torch cannot use, a GPU in a bad state): the same would happen at every restart."""
    import torch

    try:
        torch.zeros(1, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch's CUDA errors are RuntimeErrors (AcceleratorError)
        cause = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise StartupError(
            f"{role}: CUDA could not start on {device!r}: {cause}; check the GPU and driver (nvidia-smi), "
            f'or set {role}.device = "cpu"'
        ) from exc


def visible_gpus(env: Mapping[str, str] = os.environ) -> str:
    """The node's GPUs this process was given, for people ("GPU 4", "GPUs 0,1,2,3": CUDA_VISIBLE_DEVICES,
    which `april up` sets for each child); "" when it was given none or all."""
    gpus = [x.strip() for x in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return gpu_list(gpus) if gpus else ""
