"""The figures of one real run, read from its run directory: the per-mode figures of bench.json.

Same names and definitions as `broker.sim.figures.Figures` (the simulator's), measured instead:
  - wall_s: from the first lease to the end of the last learner step (the batch's `run_s` when it was
    formed + the learner's time on it); samples_per_s / effective_tokens_per_s: trained samples / their
    response tokens over wall_s; tokens_per_s: tokens the broker received until the last step's ack / wall_s.
  - rollout_s: seconds the learner waited for batches (the first one: from the first lease).
  - slot_utilization, bubble_frac: the workers' slot integrals summed over the steps (broker.usage).
  - wasted_tokens: generated (the broker's total when it stopped, workers having returned their partials)
    - trained - buffered_tokens (still held then: partials, complete groups); 0: nothing thrown away.
  - staleness_mean / staleness_max / offpolicy_token_frac: over the trained samples of every step.
  - aborted / resumed: the broker's totals when the last step was acked; accuracy_final: the last
    evaluation's accuracy, if any (none with the sim engine).
  - reprefill_frac / stale_kv_token_frac: from the sim engines' own cost counters (EngineUsage), summed
    over the steps: re-prefill model seconds / model seconds in decode steps, and tokens drawn attending
    to KV of older weights / tokens generated; None when no engine models its cost (torch).
Reads files only: metrics.jsonl (learner), broker_totals.json (broker), eval.jsonl (broker).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from april.files import read_jsonl
from broker.sim.figures import Figures
from cli.options import UserError


class BenchRunError(UserError):
    """A run directory without the files a finished run leaves; one readable line."""


def run_figures(run_dir: Path) -> Figures:
    lines = read_jsonl(run_dir / "metrics.jsonl")
    if not lines:
        raise BenchRunError(f"{run_dir}: no metrics.jsonl lines (the run trained nothing)")
    try:
        totals = json.loads((run_dir / "broker_totals.json").read_text(encoding="utf-8"))
        at_last, at_stop = totals["at_last_step"], totals["at_stop"]
    except (OSError, ValueError, KeyError) as exc:
        raise BenchRunError(f"{run_dir}: cannot read broker_totals.json ({exc})") from None
    if at_last is None:
        raise BenchRunError(f"{run_dir}: the broker never acked the run's last step")
    last = lines[-1]
    wall = last["run_s"] + last["learner_time_s"] + last["weight_sync_s"]
    samples = sum(x["samples"] for x in lines)
    trained_tokens = sum(x["tokens_trained"] for x in lines)
    busy = sum(x["busy_phase_slot_s"] for x in lines)
    phase = sum(x["phase_slot_s"] for x in lines)
    free = sum(x["free_engine_s"] for x in lines)
    engine = sum(x["engine_s"] for x in lines)
    rollout = lines[0]["run_s"] + sum(x["learner/wait_s"] for x in lines[1:])
    model_busy = sum(x.get("model_busy_s", 0.0) for x in lines)  # 0: no engine models its cost
    reprefill = sum(x.get("reprefill_s", 0.0) for x in lines)
    stale_kv = sum(x.get("stale_kv_tokens", 0.0) for x in lines)
    evals = read_jsonl(run_dir / "eval.jsonl")
    return Figures(
        wall_s=wall,
        rollout_s=rollout,
        samples_per_s=samples / wall,
        tokens_per_s=at_last["tokens_generated"] / wall,
        effective_tokens_per_s=trained_tokens / wall,
        slot_utilization=busy / phase if phase > 0 else math.nan,
        bubble_frac=free / engine if engine > 0 else math.nan,
        wasted_tokens=int(at_stop["tokens_generated"] - trained_tokens - at_stop["buffered_tokens"]),
        buffered_tokens=int(at_stop["buffered_tokens"]),
        offpolicy_token_frac=_weighted(lines, "offpolicy_token_frac", "tokens_trained"),
        staleness_mean=_weighted(lines, "staleness_mean", "samples"),
        staleness_max=int(max(x["staleness_max"] for x in lines)),
        aborted=int(at_last["aborted"]),
        resumed=int(at_last["resumed"]),
        accuracy_final=float(evals[-1]["accuracy"]) if evals else None,
        reprefill_frac=reprefill / model_busy if model_busy > 0 else None,
        stale_kv_token_frac=stale_kv / at_last["tokens_generated"] if model_busy > 0 else None,
    )


def _weighted(lines: list[dict[str, Any]], key: str, weight: str) -> float:
    total = sum(x[weight] for x in lines)
    return sum(x[key] * x[weight] for x in lines) / total if total else 0.0
