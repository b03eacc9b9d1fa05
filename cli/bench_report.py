"""`april bench`'s outputs: bench.json, bench.md and bench.png, from the per-mode figures.

Owns the file formats: bench.json is `{"modes": {mode: figures}, "speedup": {mode: samples_per_s over
sync's}, "workload": {...}, "machine": {...}}` plus, for the sim engine, `"predicted"` (the simulator's
figures of the same runs, `april simulate`, in simulated seconds) and `"prediction_error"` (measured /
predicted samples_per_s - 1 per mode, the prediction taken to wall time); bench.md is the same as
tables; bench.png shows throughput and slot utilisation per mode and the workload's response-length
histogram (matplotlib, imported here only). Computes no figure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from april import provenance
from broker.sim.figures import Figures

HISTOGRAM_SAMPLES = 20000  # lengths drawn from the workload for its histogram

# (bench.md column, figure name, format)
COLUMNS = (
    ("samples/s", "samples_per_s", "{:.3f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("tok/s", "tokens_per_s", "{:,.0f}"),
    ("eff tok/s", "effective_tokens_per_s", "{:,.0f}"),
    ("slot util", "slot_utilization", "{:.3f}"),
    ("bubble", "bubble_frac", "{:.3f}"),
    ("wasted tok", "wasted_tokens", "{:d}"),
    ("buffered tok", "buffered_tokens", "{:d}"),
    ("off-policy", "offpolicy_token_frac", "{:.3f}"),
    ("stale mean/max", "staleness", "{}"),
    ("aborted", "aborted", "{:d}"),
    ("resumed", "resumed", "{:d}"),
    ("re-prefill", "reprefill_frac", "{:.4f}"),
    ("stale KV", "stale_kv_token_frac", "{:.3f}"),
    ("wall s", "wall_s", "{:.1f}"),
    ("rollout s", "rollout_s", "{:.1f}"),
    ("accuracy", "accuracy_final", "{:.3f}"),
)


def machine() -> dict[str, Any]:
    """Where the numbers were measured (bench.json's `machine`, the schema's names)."""
    here = provenance.machine()
    head, _ = provenance.commit()
    return {
        "cpu_count": here["cpus"],
        "platform": here["platform"],
        "processor": here["processor"],
        "python": here["python"],
        "torch": here["torch"],
        "git_commit": None if head == "unknown" else head,
    }


def _clean(value: Any) -> Any:
    """JSON without NaN (null instead)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def bench_json(
    measured: dict[str, Figures],
    workload: dict[str, Any],
    predicted: dict[str, Figures] | None = None,
    time_scale: float = 1.0,
) -> dict[str, Any]:
    """`predicted` figures are in simulated seconds: `time_scale` wall seconds each."""
    out: dict[str, Any] = {
        "modes": {m: _clean(f.to_json()) for m, f in measured.items()},
        "speedup": {m: f.speedup for m, f in measured.items()},
        "workload": workload,
        "machine": machine(),
        "provenance": provenance.provenance(),
    }
    if predicted is not None:
        out["predicted"] = {m: _clean(f.to_json()) for m, f in predicted.items()}
        out["prediction_error"] = {
            m: measured[m].samples_per_s * time_scale / predicted[m].samples_per_s - 1
            for m in measured
            if m in predicted and predicted[m].samples_per_s > 0
        }
    return out


def _cell(f: Figures, name: str, fmt: str) -> str:
    if name == "staleness":
        return f"{f.staleness_mean:.2f}/{f.staleness_max}"
    value = getattr(f, name)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def table(by_mode: dict[str, Figures]) -> list[str]:
    lines = ["| mode | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for mode, f in by_mode.items():
        lines.append(f"| {mode} | " + " | ".join(_cell(f, name, fmt) for _, name, fmt in COLUMNS) + " |")
    return lines


def bench_markdown(
    doc: dict[str, Any], measured: dict[str, Figures], predicted: dict[str, Figures] | None
) -> str:
    w = doc["workload"]
    lines = [
        f"# april bench: {w['engine']} engine",
        "",
        f"Workload `{w['workload']}` (lengths `{w['lengths']}`); {w['rollout_batch_size']} x "
        f"{w['n_samples_per_prompt']} samples a step, over-sampling {w['over_sampling_batch_size']} groups, "
        f"{w['max_new_tokens']} tokens max, eta {', '.join(map(str, w['async_staleness']))}, "
        f"{w['engines']} engines x {w['slots']} slots, {w['steps']} steps, seed {w['seed']}.",
    ]
    if w["engine"] == "sim":
        lines.append(
            f"Sim cost: decode {w['decode_ms']:g} + {w['decode_ms_per_seq']:g} ms/seq, prefill "
            f"{w['prefill_ms_per_token']:g} ms/token, learner {w['learner_step_s']:g} s, prompts "
            f"{w['prompt_len']} tokens, prefix cache {w['prefix_cache_tokens']:,} tokens an engine, "
            f"resume_kv {w['resume_kv']}, resume affinity {'on' if w['resume_affinity'] else 'off'}; time "
            f"scale {w['time_scale']:.4g} wall s per simulated s (seconds below are wall seconds)."
        )
    m = doc["machine"]
    lines += [
        f"Machine: {m['cpu_count']} CPUs, {m['platform']}, Python {m['python']}, torch {m['torch']}, "
        f"commit {m['git_commit']}.",
        "",
        "## Measured (real broker, workers and learner processes)",
        "",
        *table(measured),
    ]
    if predicted is not None:
        lines += [
            "",
            "## Predicted by `april simulate` (same samples; simulated seconds)",
            "",
            *table(predicted),
            "",
            "samples/s measured / predicted - 1 (predicted scaled to wall time): "
            + ", ".join(f"{mode} {err:+.1%}" for mode, err in doc["prediction_error"].items()),
        ]
    return "\n".join(lines) + "\n"


def bench_png(path: Path, measured: dict[str, Figures], lengths: Any, title: str) -> None:
    """Samples/s and slot utilisation per mode, and the workload's response-length histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(measured)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(modes, [measured[m].samples_per_s for m in modes], color="#4477aa")
    axes[0].set_title("trained samples/s")
    for i, m in enumerate(modes):
        sp = measured[m].speedup
        if sp is not None:
            axes[0].text(i, measured[m].samples_per_s, f"{sp:.2f}x", ha="center", va="bottom")
    util = [measured[m].slot_utilization for m in modes]
    axes[1].bar(modes, [0.0 if math.isnan(u) else u for u in util], color="#228833")
    axes[1].set_ylim(0, 1)
    axes[1].set_title("slot utilisation (rollout phases)")
    drawn = lengths.sample(np.random.default_rng(0), HISTOGRAM_SAMPLES)
    axes[2].hist(drawn, bins=60, color="#aa3377")
    axes[2].set_title("response length (tokens)")
    axes[2].set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
