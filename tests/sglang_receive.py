"""SGLang's own receive side of a weights-update group, run with the python of the SGLang virtualenv
(APRIL_SGLANG_PYTHON; see tests/test_sglang_server.py), never imported by the test suite itself.

It executes, unchanged, the methods of `WeightUpdater` in the installed wheel's
sglang/srt/model_executor/model_runner_components/weight_updater.py that a server runs for
/init_weights_update_group, /update_weights_from_distributed (the receive, before the model loads the
tensors) and /destroy_weights_update_group: their source is read from the wheel and compiled here, because
importing that module needs GPU-only packages. They call SGLang's own `init_custom_process_group`
(sglang/srt/utils/common.py) and `FlattenedTensorBucket` (sglang/srt/weight_sync/tensor_bucket.py).

Commands are JSON lines on stdin, answers JSON lines on stdout:
    {"op": "init", "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
        -> {"success", "message"}
    {"op": "receive", "names", "dtypes", "shapes", "group_name", "load_format"}
        -> {"tensors": {name: [dtype, shape, sha256 of its bytes]}} or {"error": "..."}
    {"op": "destroy", "group_name"} -> {"success", "message"}
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Any

METHODS = (
    "init_weights_update_group",
    "destroy_weights_update_group",
    "receive_weights_from_distributed",
    "_receive_bucketed_weights_from_distributed",
)


def weight_updater_methods() -> dict[str, Any]:
    """WeightUpdater's METHODS, compiled from the installed wheel's source with the names they use."""
    import sglang
    import torch
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.utils.network import NetworkAddress
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    source = Path(sglang.__file__).parent / "srt/model_executor/model_runner_components/weight_updater.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WeightUpdater")
    defs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    future = ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0)
    module = ast.fix_missing_locations(ast.Module(body=[future, *defs], type_ignores=[]))
    namespace: dict[str, Any] = {
        "torch": torch,
        "logger": logging.getLogger("sglang_receive"),
        "NetworkAddress": NetworkAddress,
        "init_custom_process_group": init_custom_process_group,
        "FlattenedTensorBucket": FlattenedTensorBucket,
        **{name: getattr(typing, name) for name in ("Any", "Callable", "List", "Optional", "Tuple", "Union")},
    }
    exec(compile(module, str(source), "exec"), namespace)  # the wheel's own code
    missing = [m for m in METHODS if m not in namespace]
    if missing:
        raise SystemExit(f"{source}: WeightUpdater has no {missing}")
    return {m: namespace[m] for m in METHODS}


def main() -> None:
    import torch
    import torch.distributed as dist

    # a server's default group is its TP group; init_weights_update_group asserts there is one
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    methods = weight_updater_methods()
    updater = type("WeightUpdater", (), methods)()  # the fields its methods read: tp_rank, device, groups
    updater.tp_rank, updater.device, updater._model_update_group = 0, "cpu", {}
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "init":
            success, message = methods["init_weights_update_group"](updater, **command)
            answer: dict[str, Any] = {"success": success, "message": message}
        elif op == "destroy":
            success, message = methods["destroy_weights_update_group"](updater, command["group_name"])
            answer = {"success": success, "message": message}
        elif op == "receive":
            try:
                named = methods["receive_weights_from_distributed"](updater, **command)
                answer = {
                    "tensors": {
                        name: [
                            str(t.dtype).removeprefix("torch."),
                            list(t.shape),
                            hashlib.sha256(
                                t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                            ).hexdigest(),
                        ]
                        for name, t in named
                    }
                }
            except Exception as e:  # scheduler_components/weight_updater.py reports it as a failed update
                answer = {"error": f"{type(e).__name__}: {e}"}
        else:
            answer = {"error": f"unknown op {op!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
