"""Torch engine throughput: continuous batching vs `model.generate` on static batches, long-tailed lengths.

What runs (one process, CPU by default, `--threads` torch threads):
- a model: `--model DIR`, or a random Llama-style model written by `april.hf.make_tiny_model` large enough
  that batching matters (`--hidden 256 --layers 4`);
- `--n` prompts (uniform lengths in [`--prompt-min`, `--prompt-max`]) and, per prompt, a response length
  drawn from a lognormal (median `--median`, sigma `--sigma`, capped at `--cap`): the long tail of RL
  rollouts. Both sides generate exactly these lengths: no stop tokens, each request's budget is its length.
- continuous batching: `TorchEngine` with `slots` requests in flight; a finished request's slot is refilled
  from the queue before the next step (as a rollout worker does); its rows hold the run's longest request
  (the cache and, on CUDA, every step shape's graph are made when the engine starts, as in a worker);
- static batching: `model.generate` (sampling, KV cache, SDPA) on consecutive batches of `slots` prompts;
  a batch runs until its longest member is done (`min_new_tokens = max_new_tokens = max length`), and only
  each request's own length counts as useful tokens.
Reported per slots value: useful tokens/s for both and their ratio. Then decode step time vs number of
active sequences (1, 2, 4, ..., `--max-active`): ms per `TorchEngine.step()` with every row decoding,
measured after the prefill, and tokens/s = active / step time. On CUDA the engine captures its decode
step as CUDA graphs unless `--no-cuda-graphs`; the report says how it ran (`placement`, graphs captured).

Not a test: nothing is asserted. Prints a table and writes JSON (`--out`).
Usage: python benchmarks/engine_throughput.py [--n 256 --slots 32 64 --threads 2]
       python benchmarks/engine_throughput.py --smoke     # a few seconds, tiny sizes (the suite runs it)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from april.files import write_json

# --smoke: the same runs on a model and workload small enough for a few seconds (tests/test_benchmarks.py)
SMOKE: dict[str, Any] = {
    "hidden": 32,
    "layers": 1,
    "heads": 2,
    "vocab": 320,  # prompts draw ids 3..258
    "n": 8,
    "slots": [2, 4],
    "prompt_min": 4,
    "prompt_max": 8,
    "median": 4.0,
    "cap": 12,
    "max_active": 4,
    "step_prompt": 8,
    "step_repeats": 2,
    "out": Path("bench-out/engine_throughput-smoke.json"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="HF model directory (default: make a random one)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--n", type=int, default=256, help="prompts")
    ap.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=64)
    ap.add_argument("--median", type=float, default=32.0, help="median response length")
    ap.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma of response lengths")
    ap.add_argument("--cap", type=int, default=256, help="longest response")
    ap.add_argument("--max-active", type=int, default=128)
    ap.add_argument("--step-prompt", type=int, default=32, help="prompt length in the step-time sweep")
    ap.add_argument("--step-repeats", type=int, default=16, help="timed decode steps per sweep point")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (on a shared 2-core box, 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help="graphs of the decode step"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-out/engine_throughput.json"))
    ap.add_argument(
        "--smoke", action="store_true", help="a few seconds: tiny model and workload (options given win)"
    )
    args = ap.parse_args(argv)
    if args.smoke:  # the smoke sizes become the defaults, so options given on the command line still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    return args


def workload(args: argparse.Namespace) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(3, 259, size=int(rng.integers(args.prompt_min, args.prompt_max + 1))).astype(np.int32)
        for _ in range(args.n)
    ]
    raw = rng.lognormal(mean=np.log(args.median), sigma=args.sigma, size=args.n)
    lengths = np.clip(np.round(raw), 1, args.cap).astype(int).tolist()
    return prompts, lengths


def make_engine(model_dir: Path, args: argparse.Namespace, slots: int, row_tokens: int) -> Any:
    """The engine under test: rows of `row_tokens` (the longest request of the run), and the keyword
    arguments of `args.engine_options` (the GPU check's `--engine-option`) over this script's own."""
    from actors.engine import SamplingParams
    from actors.engines.torch_engine import TorchEngine

    options = {"cuda_graphs": args.cuda_graphs, "max_seq_len": row_tokens}
    return TorchEngine(
        model_dir,
        slots=slots,
        sampling=SamplingParams(seed=args.seed),
        device=args.device,
        dtype=args.dtype,
        **{**options, **getattr(args, "engine_options", {})},
    )


def run_engine(
    model_dir: Path, args: argparse.Namespace, slots: int, prompts: list[np.ndarray], lengths: list[int]
) -> dict[str, float]:
    from actors.engine import GenerationRequest

    engine = make_engine(model_dir, args, slots, max(len(p) for p in prompts) + max(lengths))
    _drive(engine, prompts[:slots], [4] * min(slots, len(prompts)), GenerationRequest)  # warm-up
    t0 = time.perf_counter()
    steps, tokens = _drive(engine, prompts, lengths, GenerationRequest)
    wall = time.perf_counter() - t0
    engine.close()
    assert tokens == sum(lengths)
    return _figures(wall, tokens, steps)


def _figures(wall: float, tokens: int, steps: int) -> dict[str, float]:
    """One run's row: wall time, tokens, throughput and time per decode step."""
    return {
        "wall_s": wall,
        "useful_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "steps": steps,
        "ms_per_step": 1e3 * wall / steps,
    }


def _drive(engine: Any, prompts: list[np.ndarray], lengths: list[int], request: Any) -> tuple[int, int]:
    """Keep the engine full from the queue until everything finished; return (steps, tokens)."""
    queue, steps, tokens = list(range(len(prompts))), 0, 0
    while queue or engine.active:
        free = engine.slots - engine.active
        if free and queue:
            batch, queue = queue[:free], queue[free:]
            engine.add([request(i, prompts[i], lengths[i]) for i in batch])
        for out in engine.step():
            tokens += len(out.token_ids)
        steps += 1
    return steps, tokens


def run_generate(
    model: Any, args: argparse.Namespace, slots: int, prompts: list[np.ndarray], lengths: list[int]
) -> dict[str, float]:
    import torch

    def batch_generate(ps: list[np.ndarray], new: int) -> None:
        width = max(len(p) for p in ps)
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros(len(ps), width, dtype=torch.long)
        for i, p in enumerate(ps):  # left padding
            ids[i, width - len(p) :] = torch.from_numpy(p.astype(np.int64))
            mask[i, width - len(p) :] = 1
        model.generate(
            ids.to(args.device),
            attention_mask=mask.to(args.device),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
        )

    torch.manual_seed(args.seed)
    batch_generate(prompts[:slots], 4)  # warm-up
    t0, steps = time.perf_counter(), 0
    for start in range(0, len(prompts), slots):
        longest = max(lengths[start : start + slots])
        batch_generate(prompts[start : start + slots], longest)
        steps += longest
    wall = time.perf_counter() - t0
    tokens = sum(lengths)
    return _figures(wall, tokens, steps)


def step_sweep(model_dir: Path, args: argparse.Namespace) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Decode step times at 1, 2, 4, ... active rows, and how the engine ran them."""
    from actors.engine import GenerationRequest

    budget = args.step_repeats + 4
    engine = make_engine(model_dir, args, args.max_active, args.step_prompt + budget)
    rng = np.random.default_rng(args.seed + 1)
    rows, active = [], 1
    while active <= args.max_active:
        engine.add(
            [
                GenerationRequest(i, rng.integers(3, 259, size=args.step_prompt).astype(np.int32), budget)
                for i in range(active)
            ]
        )
        engine.step()  # prefill + first decode (on CUDA: a replay, every shape captured at the start)
        engine.step()
        t0 = time.perf_counter()
        for _ in range(args.step_repeats):
            engine.step()
        dt = (time.perf_counter() - t0) / args.step_repeats
        engine.abort()
        rows.append({"active": active, "ms_per_step": 1e3 * dt, "tokens_per_s": active / dt})
        active *= 2
    plan = engine.cache_plan
    how = {
        "placement": engine.placement,
        "captured_graphs": engine.captured_graphs,
        "kv_cache": plan.describe() if plan is not None else "grown as rows need",
    }
    engine.close()
    return rows, how


def main() -> None:
    args = parse_args()
    from april.hf import load_model, make_tiny_model, set_torch_threads

    set_torch_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="april-bench-")
    model_dir = args.model or make_tiny_model(
        Path(tmp.name) / "model",
        seed=args.seed,
        vocab_size=args.vocab,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
    )
    prompts, lengths = workload(args)
    arr = np.array(lengths)
    dist = {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": int(arr.max()),
        "total": int(arr.sum()),
    }
    print(
        f"response lengths: n={args.n} mean={dist['mean']:.1f} median={dist['median']:.0f} "
        f"p90={dist['p90']:.0f} p99={dist['p99']:.0f} max={dist['max']} (p99/median "
        f"{dist['p99'] / dist['median']:.1f}x); torch threads {args.threads}, device {args.device}"
    )

    model = load_model(model_dir, args.device, args.dtype)
    throughput = []
    for slots in args.slots:
        cb = run_engine(model_dir, args, slots, prompts, lengths)
        st = run_generate(model, args, slots, prompts, lengths)
        ratio = cb["tokens_per_s"] / st["tokens_per_s"]
        throughput.append({"slots": slots, "continuous": cb, "static_generate": st, "ratio": ratio})
    print("\nuseful tokens/s, same prompts and lengths")
    print(
        f"{'slots':>6} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>7} {'engine steps':>13} "
        f"{'generate steps':>15} {'engine ms/step':>15} {'generate ms/step':>17}"
    )
    for r in throughput:
        cb, st = r["continuous"], r["static_generate"]
        print(
            f"{r['slots']:>6} {cb['tokens_per_s']:>13.0f} {st['tokens_per_s']:>15.0f} {r['ratio']:>6.2f}x "
            f"{cb['steps']:>13.0f} {st['steps']:>15.0f} {cb['ms_per_step']:>15.1f} {st['ms_per_step']:>17.1f}"
        )

    sweep, how = step_sweep(model_dir, args)
    print(
        f"\ndecode step time vs active sequences (prompt {args.step_prompt} tokens; engine "
        f"{how['placement']}, {how['captured_graphs']} graphs)"
    )
    print(f"{'active':>7} {'ms/step':>9} {'tokens/s':>9}")
    for row in sweep:
        print(f"{row['active']:>7} {row['ms_per_step']:>9.2f} {row['tokens_per_s']:>9.0f}")

    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "lengths": dist,
        "throughput": throughput,
        "step_sweep": sweep,
        "engine": how,
    }
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
