"""Learner memory: peak memory of one RL train step against tokens per step, before and after chunking.

What runs: a random Qwen3-shaped model with the real vocabulary (151,936 tokens; `--hidden 64 --layers 2`,
tied embeddings as Qwen3-4B; built here with transformers, nothing downloaded), one `learner.step.
train_step` (GRPO, the default loss) on `--samples` samples of `--prompt` prompt tokens and a response of
L tokens each, through the training engine (`--backend`, DeepSpeed by default, as the learner runs).
Two configurations:
- `before`: the model's full `[B, T, V]` logits and log-softmax, one micro-batch per step
  (`logprob_chunk_tokens = 0`, `max_tokens_per_micro_batch = 0`, `micro_batches = 1`);
- `after`: the learner's defaults (`april.config.LearnerConfig`): log-probs from the final hidden states
  a chunk at a time, micro-batches by a token budget, no entropy graph when `entropy_coef` is 0.
Each (configuration, L) runs in a fresh child process, so peaks never mix: the peak is the child's
maximum resident set size (`ru_maxrss`; it includes the interpreter, torch and DeepSpeed), and on CUDA
also `torch.cuda.max_memory_allocated`. `before` runs only at the small lengths of `--before-lengths`:
at 16 x 4k tokens it needs tens of GB.

Reported: a table of tokens per step against peak memory per configuration, and the memory added per
token between successive `after` sizes (constant when growth is linear). Not a test: nothing is asserted.
Writes JSON (`--out`).
Usage: python benchmarks/learner_memory.py [--samples 16 --after-lengths 1024,2048,4096,8192]
       python benchmarks/learner_memory.py --smoke       # tiny lengths, plain torch (the suite runs it)
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from april.files import write_json

QWEN3_VOCAB = 151_936
GIB = 1024**3

# --smoke: the real vocabulary, tiny lengths and batch, plain torch (DeepSpeed's start-up is most of a run)
SMOKE: dict[str, Any] = {
    "samples": 4,
    "prompt": 8,
    "before_lengths": "8",
    "after_lengths": "8,16",
    "backend": "torch",
    "out": Path("bench-out/learner_memory-smoke.json"),
}


def lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16, help="samples per step (groups of --group)")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sample")
    ap.add_argument("--before-lengths", default="16,32,64", help="response lengths L for `before`")
    ap.add_argument("--after-lengths", default="64,1024,4096,8192", help="... for `after`")
    ap.add_argument("--backend", choices=("deepspeed", "torch"), default="deepspeed")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (bf16 weights, fp32 optimizer state)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-out/learner_memory.json"))
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny lengths (options given win)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:  # the smoke sizes become the defaults, so options given on the command line still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    if args.samples % args.group:
        ap.error(f"--samples {args.samples} must be a multiple of --group {args.group}")
    return args


def layouts() -> dict[str, dict[str, Any]]:
    """The two configurations, as `learner.*` keys (after: the defaults)."""
    from april.config import LearnerConfig

    lc = LearnerConfig()
    after = {
        "micro_batches": lc.micro_batches,
        "max_tokens_per_micro_batch": lc.max_tokens_per_micro_batch,
        "logprob_chunk_tokens": lc.logprob_chunk_tokens,
        "pack_sequences": lc.pack_sequences,
        "gradient_checkpointing": lc.gradient_checkpointing,
    }
    before = {**after, "micro_batches": 1, "max_tokens_per_micro_batch": 0, "logprob_chunk_tokens": 0}
    return {"before": before, "after": after}


def qwen3_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(1, args.hidden // 16)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=16,
        max_position_embeddings=40_960,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return Qwen3ForCausalLM(config)


def synthetic_batch(args: argparse.Namespace, length: int) -> Any:
    """`--samples` finished samples (groups of `--group`), each `--prompt` + `length` random tokens."""
    import numpy as np

    from april.records import FinishReason, Sample
    from learner.batching import build_train_batch

    rng = np.random.default_rng(args.seed)
    samples = []
    for g in range(args.samples // args.group):
        prompt = rng.integers(3, args.vocab, size=args.prompt).astype(np.int32)
        for i in range(args.group):
            ids = rng.integers(3, args.vocab, size=length).astype(np.int32)
            lps = (-rng.random(length) * 3 - 0.05).astype(np.float32)
            s = Sample(group_id=g, index=i, prompt_ids=prompt).extend(ids, lps, 0, FinishReason.STOP)
            samples.append(s.scored(float(i % 2)))  # half right, half wrong: every advantage nonzero
    return build_train_batch(samples, n_samples_per_prompt=args.group)


def current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(args: argparse.Namespace, name: str, length: int) -> dict[str, Any]:
    """In this (fresh) process: one train step of configuration `name` at response length `length`."""
    import torch

    from april.config import AlgoConfig
    from april.hf import enable_activation_checkpointing, set_torch_threads
    from learner.engine import TrainEngine, TrainSettings
    from learner.losses import LossConfig
    from learner.step import Layout, train_step

    set_torch_threads(args.threads)
    keys = layouts()[name]
    model = qwen3_model(args)
    on_gpu = args.device.startswith("cuda")
    if on_gpu:
        model = model.to(device=args.device, dtype=torch.bfloat16)
    if keys["gradient_checkpointing"]:
        enable_activation_checkpointing(model)
    settings = TrainSettings(backend=args.backend, lr=1e-6, device=args.device, grad_accum_steps=1)
    engine = TrainEngine(model, settings)
    batch = synthetic_batch(args, length)
    layout = Layout(
        micro_batches=keys["micro_batches"],
        max_tokens=keys["max_tokens_per_micro_batch"],
        chunk_tokens=keys["logprob_chunk_tokens"],
        packed=keys["pack_sequences"],
    )
    cfg = LossConfig.from_algo(AlgoConfig(n_samples_per_prompt=args.group))
    rss_ready = current_rss()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    metrics = train_step(engine, batch, cfg, version=0, temperature=1.0, group_size=args.group, layout=layout)
    wall_s = time.perf_counter() - started
    return {
        "config": name,
        "response_len": length,
        "tokens_per_step": batch.tokens,
        "response_tokens": batch.global_tokens,
        "micro_batches": engine.accumulation,
        "rss_before_step_bytes": rss_ready,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
        "step_s": wall_s,
        "loss": metrics["loss"],
    }


def run_child(args: argparse.Namespace, name: str, length: int) -> dict[str, Any]:
    """`measure` in a fresh interpreter (its last stdout line is the JSON result)."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", f"{name}:{length}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(
            f"{name} at L={length} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def per_token_growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peak bytes added per token between successive sizes of one configuration."""
    out = []
    for a, b in itertools.pairwise(rows):
        added = b["peak_rss_bytes"] - a["peak_rss_bytes"]
        tokens = b["tokens_per_step"] - a["tokens_per_step"]
        out.append(
            {"from_tokens": a["tokens_per_step"], "to_tokens": b["tokens_per_step"], "bytes": added / tokens}
        )
    return out


def main() -> None:
    args = parse_args()
    if args.child:
        name, length = args.child.split(":")
        print(json.dumps(measure(args, name, int(length))))
        return
    plan = [("before", n) for n in lengths(args.before_lengths)] + [
        ("after", n) for n in lengths(args.after_lengths)
    ]
    rows = []
    for name, length in plan:
        row = run_child(args, name, length)
        rows.append(row)
        print(
            f"{name:<7} L={length:>6} tokens/step {row['tokens_per_step']:>8} micro-batches "
            f"{row['micro_batches']:>3} peak RSS {row['peak_rss_bytes'] / GIB:6.2f} GiB "
            f"(before the step {row['rss_before_step_bytes'] / GIB:5.2f}) {row['step_s']:7.1f} s",
            flush=True,
        )
    from april.provenance import machine

    growth = {name: per_token_growth([r for r in rows if r["config"] == name]) for name in layouts()}
    for name, steps in growth.items():
        for g in steps:
            print(
                f"{name}: {g['from_tokens']} -> {g['to_tokens']} tokens: "
                f"{g['bytes'] / 1024:.1f} KiB per token"
            )
    report = {
        "benchmark": "learner_memory",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
        "configs": layouts(),
        "platform": machine(),
        "target_bytes": 4 * GIB,
        "rows": rows,
        "growth_per_token": growth,
    }
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
