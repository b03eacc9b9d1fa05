"""The analysis half of benchmarks/accuracy.py on synthetic metrics lines: trailing mean, steps and wall
time to target, final accuracies, the per-mode summary over seeds, the time ratio and the table. Nothing
here runs `april up`."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("accuracy_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


acc = _load()
LAUNCH = 1_000_000.0


def metrics(accuracy: list[float], start_s: float = 30.0, step_s: float = 2.0) -> list[dict[str, Any]]:
    """metrics.jsonl lines: step i written at LAUNCH + start_s + step_s * i."""
    return [
        {"step": i, "accuracy": a, "time": LAUNCH + start_s + step_s * i, "step_time_s": step_s + i % 3}
        for i, a in enumerate(accuracy)
    ]


def curve(accuracy: list[float], seed: int = 0, mode: str = "sync", **kw: Any) -> Any:
    evals = [{"version": 0, "accuracy": 0.9}, {"version": len(accuracy), "accuracy": 0.95}]
    return acc.curve_from_records(mode, seed, metrics(accuracy, **kw), evals, LAUNCH, 500.0)


def naive_trailing(values: list[float], window: int) -> list[float]:
    return [
        sum(values[i - window + 1 : i + 1]) / window if i >= window - 1 else math.nan
        for i in range(len(values))
    ]


def test_trailing_mean_matches_the_naive_window_and_is_nan_before_it_fills() -> None:
    values = [0.1 * (i % 7) + 0.01 * i for i in range(40)]
    got = acc.trailing_mean(values, 10)
    want = naive_trailing(values, 10)
    assert all(math.isnan(x) for x in got[:9])
    assert got[9:] == pytest.approx(want[9:])
    assert acc.trailing_mean([1.0, 2.0], 1) == [1.0, 2.0]
    with pytest.raises(ValueError, match="window"):
        acc.trailing_mean([1.0], 0)


def test_steps_and_time_to_target_use_the_first_full_window_at_or_above_it() -> None:
    # 10 steps at 0.3, then 0.8: the trailing 10-step mean crosses 0.55 once 5 of the 10 are 0.8
    # (0.3 * 5 + 0.8 * 5) / 10 = 0.55 at step index 14
    c = curve([0.3] * 10 + [0.8] * 20)
    s = acc.summarize_run(c, target=0.55, window=10, final_window=10)
    assert s["steps_to_target"] == 15  # steps trained, 1-based
    assert s["time_to_target_s"] == pytest.approx(30.0 + 2.0 * 14)
    assert s["final_train_accuracy"] == pytest.approx(0.8)
    assert s["first_train_accuracy"] == pytest.approx(0.3)
    assert s["final_eval_accuracy"] == pytest.approx(0.95)
    assert s["first_eval_accuracy"] == pytest.approx(0.9)
    assert s["first_step_s"] == pytest.approx(30.0)
    assert s["total_wall_s"] == 500.0
    assert s["median_step_s"] == pytest.approx(3.0)  # 2 + (0, 1, 2, 0, 1, 2, ...)
    assert s["median_wait_s"] is None  # not in these lines


def test_a_single_early_spike_does_not_count_and_not_reached_is_none() -> None:
    c = curve([1.0] + [0.3] * 29)  # step 0 alone is above target; no full window is
    s = acc.summarize_run(c, target=0.55, window=10, final_window=10)
    assert s["steps_to_target"] is None and s["time_to_target_s"] is None
    assert acc.first_reaching([math.nan, 0.2, 0.6, 0.9], 0.55) == 2
    assert acc.first_reaching([math.nan, 0.2], 0.55) is None


def test_final_eval_is_none_when_the_last_evaluation_is_not_at_the_final_version() -> None:
    c = acc.curve_from_records(
        "april", 0, metrics([0.5] * 20), [{"version": 10, "accuracy": 0.9}], LAUNCH, 1.0
    )
    assert acc.final_eval(c) is None
    assert acc.summarize_run(c, 0.5, 10, 10)["final_eval_accuracy"] is None


def test_mode_summary_spread_ratio_and_table() -> None:
    sync = [curve([0.3] * 10 + [0.8] * 20, seed=s, step_s=2.0) for s in (0, 1)]
    fast = [curve([0.3] * 10 + [0.8] * 20, seed=s, mode="async", step_s=1.0) for s in (0, 1)]
    late = [curve([0.3] * 10 + [0.8] * 20, seed=0, mode="april"), curve([0.3] * 30, seed=1, mode="april")]
    runs = {name: [acc.summarize_run(c, 0.55, 10, 10) for c in cs] for name, cs in
            (("sync", sync), ("async", fast), ("april", late))}  # fmt: skip
    summary = {m: acc.summarize_mode(r) for m, r in runs.items()}
    assert summary["sync"]["reached"] == 2 and summary["april"]["reached"] == 1
    assert summary["april"]["final_train_accuracy"]["mean"] == pytest.approx(0.55)
    assert summary["april"]["final_train_accuracy"]["std"] == pytest.approx(math.sqrt(2 * 0.25**2))
    assert summary["april"]["final_train_accuracy"]["min"] == pytest.approx(0.3)
    # async's steps take half the time, after the same 30 s start: (30 + 14) / (30 + 28)
    assert acc.time_ratio(summary, "async") == pytest.approx(44.0 / 58.0)
    assert acc.time_ratio(summary, "april") is None  # one april seed never reached the target
    table = acc.render_table(summary, 0.55)
    assert "(1/2 reached)" in table
    assert "async / sync wall time to 0.55: 0.76x" in table
    assert "april / sync wall time to 0.55: not defined" in table
    paired = acc.paired_time_ratios(runs, "april")
    assert paired[0] == pytest.approx(1.0) and paired[1] is None
    assert acc.paired_time_ratios(runs, "async") == {
        0: pytest.approx(44.0 / 58.0),
        1: pytest.approx(44.0 / 58.0),
    }
    nobody = acc.summarize_mode([acc.summarize_run(curve([0.3] * 30), 0.55, 10, 10)])
    assert "not reached (0/1)" in acc.render_table({"sync": nobody}, 0.55)


def test_read_jsonl_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n" + '{"step": 1, "acc')
    assert acc.read_jsonl(path) == [{"step": 0}]
    assert acc.read_jsonl(tmp_path / "missing.jsonl") == []


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    curves = {
        m: [curve([0.3 + 0.01 * i for i in range(30)], seed=s, mode=m) for s in (0, 1)] for m in acc.MODES
    }
    acc.plot(curves, 0.55, 10, tmp_path / "accuracy.png")
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
