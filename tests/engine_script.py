"""A fixed script of engine calls, replayed on the torch engine; what it returns, as plain data.

Each case names a model (the shipped tiny Llama, or a random Qwen3 with grouped-query attention and tied
embeddings), the engine's settings, and a script of calls: requests queued and added as slots free up
before every step (as a worker does), rows joining mid-run, longer rows joining shorter ones, rows
finishing and leaving, a weights load between steps, an abort, and a resume of prompt + partial response.
`replay` returns every output with the index of the call that returned it.

tests/data/torch_engine_golden.json holds what the engine before the static-shape decode step (commit
c3753dc) returned for these cases (`python tests/engine_script.py` wrote it with that engine);
tests/test_engine_golden.py replays them on the current engine.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "data" / "torch_engine_golden.json"

# ops: ("queue", [(request_id, prompt_len, budget, greedy)]), ("step", n), ("abort",),
#      ("resume", first_request_id, [budget, ...]): the first aborted requests (as many as there were)
#      again, from prompt + partial response,
#      ("load", seed, version), ("drain",)
Op = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    model: str  # "tiny" (models/tiny) or "qwen3" (random, made here)
    slots: int
    sampling: dict[str, Any]  # SamplingParams fields
    greedy: bool
    script: tuple[Op, ...]


MIXED: tuple[Op, ...] = (
    ("queue", [(0, 5, 12, False), (1, 17, 30, True), (2, 1, 6, False)]),
    ("step", 3),
    ("queue", [(3, 40, 20, False)]),  # longer than every running row
    ("step", 4),
    ("queue", [(4, 2, 3, False), (5, 60, 9, True), (6, 3, 25, False), (7, 8, 1, False), (8, 33, 14, False)]),
    ("step", 6),
    ("load", 11, 1),
    ("step", 5),
    ("abort",),
    ("resume", 20, [10, 12, 7]),
    ("queue", [(9, 12, 16, False), (10, 2, 40, False), (11, 70, 5, True)]),
    ("step", 9),
    ("load", 12, 2),
    ("drain",),
    ("queue", [(30, 6, 5, True), (31, 9, 4, True)]),  # only greedy rows: nothing is drawn
    ("drain",),
    ("queue", [(32, 4, 6, False)]),
    ("drain",),
)

CASES = (
    Case(
        "tiny-sampled",
        "tiny",
        4,
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 3, "stop_token_ids": (201,)},
        False,
        MIXED,
    ),
    Case("tiny-greedy", "tiny", 3, {"temperature": 0.7, "seed": 1}, True, MIXED),
    Case(
        "qwen3-sampled",
        "qwen3",
        3,
        {"temperature": 1.0, "seed": 7, "stop_token_ids": (239, 215)},
        False,
        MIXED,
    ),
    Case("qwen3-topk", "qwen3", 5, {"temperature": 1.3, "top_k": 5, "seed": 2}, False, MIXED),
)


def qwen3_model(root: Path) -> Path:
    """A random Qwen3: 4 query heads over 2 key/value heads, tied embeddings, a 1000-token vocabulary."""
    from april.hf import make_tiny_model

    return make_tiny_model(
        root / "qwen3", seed=3, architecture="qwen3", vocab_size=1000, hidden=64, layers=2, heads=4,
        kv_heads=2, tie_embeddings=True,
    )  # fmt: skip


def perturbed(model_dir: Path, path: Path, seed: int) -> Path:
    """The model's weights plus seeded noise, written to `path` (a .safetensors file)."""
    import torch
    from safetensors.torch import save_file

    from april.hf import load_model

    model = load_model(model_dir, dtype="float32")
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if any(tensor.data_ptr() == t.data_ptr() for t in state.values()):
            continue  # a tied weight is saved once, as save_pretrained does
        state[name] = (tensor + 0.05 * torch.randn(tensor.shape, generator=gen)).contiguous()
    save_file(state, str(path))
    return path


def prompt(request_id: int, length: int) -> np.ndarray:
    return np.random.default_rng(1000 + request_id).integers(3, 259, size=length).astype(np.int32)


def record(out: Any, call: int) -> dict[str, Any]:
    return {
        "call": call,
        "request_id": int(out.request_id),
        "token_ids": [int(t) for t in out.token_ids],
        "logprobs": [float(x) for x in out.logprobs],
        "versions": [int(v) for v in out.versions],
        "finish_reason": out.finish_reason.name,
    }


def replay(engine: Any, script: Sequence[Op], weights: Callable[[int], Path]) -> list[dict[str, Any]]:
    """Run `script` on `engine`; every output with the index of the engine call that returned it."""
    from actors.engine import GenerationRequest

    queue: list[GenerationRequest] = []
    inputs: dict[int, np.ndarray] = {}
    partial: list[np.ndarray] = []  # prompt + partial response of each aborted request, in abort order
    outputs: list[dict[str, Any]] = []
    call = 0

    def step() -> None:
        nonlocal call, queue
        free = engine.slots - engine.active
        if queue and free > 0:
            engine.add(queue[:free])
            queue = queue[free:]
        outputs.extend(record(o, call) for o in engine.step())
        call += 1

    for op in script:
        if op[0] == "queue":
            for rid, length, budget, greedy in op[1]:
                inputs[rid] = prompt(rid, length)
                queue.append(GenerationRequest(rid, inputs[rid], budget, greedy=greedy))
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        elif op[0] == "abort":
            for o in engine.abort():
                partial.append(np.concatenate([inputs[o.request_id], o.token_ids]).astype(np.int32))
                outputs.append(record(o, call))
            call += 1
        elif op[0] == "resume":
            for i, budget in enumerate(op[2][: len(partial)]):
                rid = op[1] + i
                inputs[rid] = partial[i]
                queue.append(GenerationRequest(rid, inputs[rid], budget))
        elif op[0] == "load":
            engine.load_weights(weights(op[1]), version=op[2])
            call += 1
        elif op[0] == "drain":
            while queue or engine.active:
                step()
    return outputs


def build(case: Case, root: Path, **engine_kwargs: Any) -> tuple[Any, Callable[[int], Path]]:
    """The case's engine (float32; `engine_kwargs` added) and its weights-file maker, models under `root`."""
    from actors.engine import SamplingParams
    from actors.engines.torch_engine import TorchEngine

    model_dir = REPO / "models" / "tiny" if case.model == "tiny" else qwen3_model(root)
    kwargs = {"dtype": "float32", **engine_kwargs}
    engine = TorchEngine(
        model_dir, slots=case.slots, sampling=SamplingParams(**case.sampling), greedy=case.greedy, **kwargs
    )

    def weights(seed: int) -> Path:
        return perturbed(model_dir, root / f"{case.model}-{seed}.safetensors", seed)

    return engine, weights


def run_case(case: Case, root: Path, **engine_kwargs: Any) -> list[dict[str, Any]]:
    """Build the case's model and engine under `root` and replay its script."""
    engine, weights = build(case, root, **engine_kwargs)
    return replay(engine, case.script, weights)


def golden() -> dict[str, list[dict[str, Any]]]:
    data: dict[str, list[dict[str, Any]]] = json.loads(GOLDEN.read_text())
    return data


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]], atol: float) -> None:
    """The same outputs from the same calls: tokens, reasons and versions equal, log-probs within `atol`."""
    assert [(o["call"], o["request_id"]) for o in got] == [(o["call"], o["request_id"]) for o in want]
    for g, w in zip(got, want, strict=True):
        where = f"request {w['request_id']} (call {w['call']})"
        assert g["token_ids"] == w["token_ids"], where
        assert g["finish_reason"] == w["finish_reason"], where
        assert g["versions"] == w["versions"], where
        np.testing.assert_allclose(g["logprobs"], w["logprobs"], atol=atol, rtol=0, err_msg=where)


def main() -> None:
    """Write GOLDEN from the engine on this tree (run on the engine the golden data is to describe)."""
    import torch

    torch.set_num_threads(1)
    golden: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            golden[case.name] = run_case(case, Path(tmp))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    main()
