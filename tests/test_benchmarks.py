"""Every script in benchmarks/ runs at its smoke size (`--smoke`) in a subprocess, and what it writes parses
and has the shape, keys and counts a full run has: a benchmark nothing runs rots. The figures themselves
(throughput, times, accuracy) are never compared with a threshold: the machine may be busy. A new script
in benchmarks/ without a check here fails `test_every_benchmark_has_a_smoke_check`."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
DEADLINE_S = 300  # "did not hang", not "was fast": the smoke sizes take seconds to a minute or two


def run_smoke(
    script: str,
    out: Path,
    cwd: Path,
    verb: str = "",
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> str:
    """`python benchmarks/SCRIPT [VERB] --smoke --out OUT [EXTRA]` with this tree's april first on the
    path (or in `env`); its output."""
    env = env or {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / script),
            *([verb] if verb else []),
            "--smoke",
            "--out",
            str(out),
            *extra,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} --smoke exited {proc.returncode}:\n{output[-4000:]}"
    return output


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def positive(value: Any) -> bool:
    return finite(value) and value > 0


# ------------------------------------------------------------------------------------------- per script


def check_broker_throughput(tmp_path: Path) -> None:
    out = tmp_path / "broker_throughput.json"
    printed = run_smoke("broker_throughput.py", out, tmp_path)
    report = json.loads(out.read_text())
    params = report["params"]
    assert report["benchmark"] == "broker_throughput" and params["smoke"] is True
    assert report["machine"]["cpu_count"] >= 1
    assert all(finite(x) for x in report["load_average"]["start"] + report["load_average"]["end"])
    results = report["results"]
    names = [
        "steady",
        "weights",
        "bounded",
        "streamed",
        "streamed-gathered",
        "flood",
        "flood-gathered",
        "flood-crowd",
        "floor",
        "ceiling",
        "flood-ceiling",
    ]
    assert [r["scenario"] for r in results] == names
    *results, floor, ceiling, flood_ceiling = results
    n = params["rollout_batch_size"] * params["n_samples_per_prompt"]
    for r in results:
        name = r["scenario"]
        assert r["batches"] >= 1, f"{name}: no batch in the window"
        assert r["samples"] == r["batches"] * n, name  # every Batch holds exactly B x n samples
        assert r["batches_total"] >= r["batches"], name
        # every trained sample carries exactly --tokens response tokens (aborted ones are resumed to it)
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * params["tokens"]), name
        for key in ("samples_per_s", "generated_per_s", "mb_per_s_in", "mb_per_s_out", "samples_per_result"):
            assert positive(r[key]), (name, key, r[key])
        for key in (
            "broker_cpu_s",
            "broker_cpu_util",
            "workers_cpu_util",
            "latency_ms_p50",
            "latency_ms_p99",
        ):
            assert finite(r[key]) and r[key] >= 0, (name, key, r[key])
        assert r["latency_ms_p50"] <= r["latency_ms_p99"] <= r["latency_ms_max"], name
        assert r["latency_count"] >= 1 and r["sample_results"] >= 1, name
        assert r["worker_logs"] == params["workers"], name
        assert [x["samples_per_s"] for x in r["repeats"]] == [r["samples_per_s"]], name  # one run: itself
        assert r["learner_errors"] == {}, name  # the broker rejected nothing the scripted learner sent
        assert "Error" not in r["worker_other_messages"], name
        # the learner publishes after every `weights_every`-th batch it acks
        every = r["weights_every"]
        assert r["weights_published"] == (r["batches_total"] // every if every else 0), name
    steady, weights, bounded, streamed, streamed_gathered, flood, gathered, crowd = results
    assert (
        steady["max_staleness"]
        == weights["max_staleness"]
        > bounded["max_staleness"]
        == params["max_staleness"]
    )
    for r in (steady, weights, streamed, streamed_gathered, flood, gathered, crowd):  # admission never holds
        assert r["admission_headroom_groups"] > 0, r
    # streamed: engines' way, one sample a result as each finishes, every result answered by a Lease
    assert streamed["samples_per_result"] == 1.0 and streamed["stream"] is True, streamed
    assert not steady["stream"] and streamed["max_staleness"] == steady["max_staleness"]
    # flood: streamed's way with a shorter hold, so far more is offered
    assert flood["stream"] is True and flood["samples_per_result"] == 1.0, flood
    assert flood["hold_ms"] < streamed["hold_ms"] and flood["max_staleness"] == steady["max_staleness"]
    # streamed and flood send what a real worker sends for a sample: its slot's credit, then its result
    for r in (streamed, flood):
        assert r["messages_per_sample"] == pytest.approx(2.0, rel=0.02) and r["result_hold_ms"] == 0, r
    # the gathered pairs: the same workers and load, each worker's outbox sending what it owes within its
    # hold as one result that carries the credit (never a LeaseRequest of its own: both are owed at once)
    for plain, pair in ((streamed, streamed_gathered), (flood, gathered)):
        assert {k: pair[k] for k in ("stream", "hold_ms", "max_staleness")} == {
            k: plain[k] for k in ("stream", "hold_ms", "max_staleness")
        }
        assert pair["result_hold_ms"] == params["gather_hold_ms"] > 0, pair
        assert pair["messages_per_sample"] <= 1.0 and pair["lease_requests"] == 0, pair
    assert gathered["samples_per_result"] > 1, gathered  # flood's workers finish several within the hold
    # flood-crowd: flood's, with a crowd of one-slot workers the broker counts alive to the end
    assert {k: v for k, v in crowd.items() if k in ("stream", "hold_ms", "max_staleness")} == {
        k: flood[k] for k in ("stream", "hold_ms", "max_staleness")
    }
    assert crowd["crowd"] == params["crowd"] > 0 and flood["crowd"] == 0, crowd
    assert crowd["workers_alive_at_end"] == params["workers"] + params["crowd"], crowd
    assert flood["workers_alive_at_end"] == params["workers"], flood
    # floor: streamed's workers and load against the echo broker, which answers every result (and forms
    # no batches: no learner)
    assert floor["stream"] is True and floor["hold_ms"] == streamed["hold_ms"], floor
    assert floor["samples_per_result"] == 1.0 and floor["batches_total"] == 0, floor
    assert positive(floor["generated_per_s"]) and floor["latency_count"] >= 1, floor
    assert floor["latency_ms_p50"] <= floor["latency_ms_p99"] <= floor["latency_ms_max"], floor
    assert floor["worker_logs"] == params["workers"] and "Error" not in floor["worker_other_messages"]
    # ceiling: steady's workers and load against the echo broker: whole results, every one answered
    assert not ceiling["stream"] and ceiling["hold_ms"] == steady["hold_ms"], ceiling
    assert ceiling["samples_per_result"] > 1 and ceiling["batches_total"] == 0, ceiling
    assert positive(ceiling["generated_per_s"]) and ceiling["latency_count"] >= 1, ceiling
    assert ceiling["worker_logs"] == params["workers"] and "Error" not in ceiling["worker_other_messages"]
    # flood-ceiling: flood's workers and load against the echo broker
    assert flood_ceiling["stream"] is True and flood_ceiling["hold_ms"] == flood["hold_ms"], flood_ceiling
    assert flood_ceiling["batches_total"] == 0 and positive(flood_ceiling["generated_per_s"]), flood_ceiling
    assert "Error" not in flood_ceiling["worker_other_messages"], flood_ceiling
    for name in names:
        assert f"  {name}: " in printed  # the table's per-scenario lines


def check_engine_throughput(tmp_path: Path) -> None:
    out = tmp_path / "engine_throughput.json"
    printed = run_smoke("engine_throughput.py", out, tmp_path)
    report = json.loads(out.read_text())
    config = report["config"]
    assert config["n"] >= 1 and report["machine"]["cpus"] >= 1
    total = report["lengths"]["total"]
    assert total >= config["n"]  # every response at least one token
    assert [row["slots"] for row in report["throughput"]] == config["slots"]
    for row in report["throughput"]:
        cb, st = row["continuous"], row["static_generate"]
        for side in (cb, st):  # both sides generate exactly the drawn lengths
            assert side["useful_tokens"] == total
            assert all(positive(side[k]) for k in ("wall_s", "tokens_per_s", "steps", "ms_per_step"))
            # a step yields at most one token per slot, and the longest response takes its length in steps
            assert side["steps"] * row["slots"] >= total and side["steps"] >= report["lengths"]["max"]
        assert row["ratio"] == pytest.approx(cb["tokens_per_s"] / st["tokens_per_s"])
    sweep = report["step_sweep"]
    actives = [row["active"] for row in sweep]
    assert (
        actives == [2**i for i in range(len(actives))]
        and actives[-1] <= config["max_active"] < 2 * actives[-1]
    )
    assert all(positive(row["ms_per_step"]) and positive(row["tokens_per_s"]) for row in sweep)
    assert "useful tokens/s" in printed and "decode step time" in printed


def check_learner_step(tmp_path: Path) -> None:
    out = tmp_path / "learner_step.json"
    printed = run_smoke("learner_step.py", out, tmp_path)
    report = json.loads(out.read_text())
    args = report["args"]
    assert report["benchmark"] == "learner_step" and args["smoke"] is True
    assert list(report["results"]) == args["backends"] and "torch" in args["backends"]
    assert any(b.startswith("zero") for b in args["backends"])  # DeepSpeed runs too
    for name, r in report["results"].items():
        assert len(r["step_s"]) == args["steps"] * args["rounds"], name  # every timed step of every round
        assert all(positive(t) for t in r["step_s"]), name
        assert r["min_s"] == min(r["step_s"]) and r["min_s"] <= r["median_s"] <= max(r["step_s"]), name
        assert positive(r["publish_s"]) and positive(r["ratio_vs_torch"]), name
    assert report["results"]["torch"]["ratio_vs_torch"] == pytest.approx(1.0)
    assert "median/torch" in printed


def check_learner_memory(tmp_path: Path) -> None:
    out = tmp_path / "learner_memory.json"
    printed = run_smoke("learner_memory.py", out, tmp_path)
    report = json.loads(out.read_text())
    args = report["args"]
    assert report["benchmark"] == "learner_memory" and args["smoke"] is True
    assert args["vocab"] == 151_936  # the real vocabulary even at the smoke size
    assert report["configs"]["before"]["logprob_chunk_tokens"] == 0
    assert report["configs"]["after"]["logprob_chunk_tokens"] > 0  # the defaults chunk
    want = [("before", int(n)) for n in args["before_lengths"].split(",")]
    want += [("after", int(n)) for n in args["after_lengths"].split(",")]
    assert [(r["config"], r["response_len"]) for r in report["rows"]] == want  # one child per point
    for r in report["rows"]:
        assert r["response_tokens"] == args["samples"] * r["response_len"]
        assert r["tokens_per_step"] == r["response_tokens"] + args["samples"] * args["prompt"]
        assert r["micro_batches"] >= 1 and finite(r["loss"]) and positive(r["step_s"])
        assert r["peak_rss_bytes"] >= r["rss_before_step_bytes"] > 0
    after = [r for r in report["rows"] if r["config"] == "after"]
    assert len(report["growth_per_token"]["after"]) == len(after) - 1
    assert "peak RSS" in printed


def check_weight_sync(tmp_path: Path) -> None:
    out = tmp_path / "weight_sync.json"
    printed = run_smoke("weight_sync.py", out, tmp_path)
    report = json.loads(out.read_text())
    args = report["args"]
    assert report["benchmark"] == "weight_sync" and args["smoke"] is True
    stamp = report["provenance"]
    assert (
        stamp["command"].startswith("python benchmarks/weight_sync.py") and "load_avg_1m" in stamp["machine"]
    )
    # every transport asked for is measured, or skipped with its reason (its modules are not in the tree)
    assert set(report["transports"]) | set(report["skipped"]) == {"file", "network", "broadcast"}
    assert "file" in report["transports"]
    (size,) = report["sizes"]
    assert size["size"] == args["sizes"] and size["parameters"] > 0
    lb = size["loopback"]
    assert (
        len(lb["rounds"]) == args["rounds"] and positive(lb["transfer_s"]) and positive(lb["transfer_gbps"])
    )
    assert set(size["transports"]) == set(report["transports"])
    for name, t in size["transports"].items():
        assert len(t["rounds"]) == args["rounds"], name
        # the loopback stream moves exactly as many bytes as the published file holds
        assert all(r.get("file_bytes", r["bytes"]) == lb["bytes"] for r in t["rounds"]), name
        # fp32: 4 bytes a parameter, plus the safetensors header for a file
        assert (
            t["bytes"] == 4 * size["parameters"]
            if name == "broadcast"
            else t["bytes"] > 4 * size["parameters"]
        )
        for key in ("sync_s", "publish_s", "transfer_s"):
            assert positive(t[key]), (name, key)
        assert t["sync_s"] >= t["publish_s"] + t["transfer_s"] - 1e-9, name  # the phases lie within the sync
        assert t["transfer_gbps"] == pytest.approx(t["bytes"] / t["transfer_s"] / 1e9), name
        assert t["vs_loopback"] == pytest.approx(t["transfer_gbps"] / lb["transfer_gbps"]), name
    assert "x loopback" in printed and f"{args['sizes']}      file" in printed

    # the SGLang paths into the rebuilt server, side by side on a Llama-shaped bf16 model
    out = tmp_path / "weight_sync_sglang.json"
    transports = ["sglang-disk", "sglang-broadcast"]
    extra = ["--sizes", "1M-llama", "--transports", ",".join(transports)]
    printed = run_smoke("weight_sync.py", out, tmp_path, extra=extra)
    report = json.loads(out.read_text())
    assert report["transports"] == transports and report["skipped"] == {}
    (size,) = report["sizes"]
    assert size["model"]["arch"] == "llama" and size["parameters"] > 0
    disk, collective = size["transports"]["sglang-disk"], size["transports"]["sglang-broadcast"]
    assert collective["bytes"] == 2 * size["parameters"] < disk["bytes"]  # bf16; the file has a header
    assert all(r["buckets"] >= 1 for r in collective["rounds"])
    for t in (disk, collective):
        assert len(t["rounds"]) == report["args"]["rounds"]
        assert t["sync_s"] >= t["publish_s"] + t["transfer_s"] - 1e-9
    ratios = size["sglang_disk_over_broadcast"]
    assert ratios["sync_s"] == pytest.approx(disk["sync_s"] / collective["sync_s"])
    assert ratios["transfer_s"] == pytest.approx(disk["transfer_s"] / collective["transfer_s"])
    assert "sglang disk / broadcast" in printed


def check_learning_run(tmp_path: Path) -> None:
    """The reasoning-gym run at 2 steps in a mode not its config's: the starting and final policies scored
    on the same held-out questions, the run's books balanced, its curve read."""
    out = tmp_path / "learn"
    extra = ["--config", "configs/spell_backward.toml", "--modes", "async"]
    run_smoke("learning_run.py", out, tmp_path, extra=extra)
    doc = json.loads((out / "learning_run.json").read_text())
    assert doc["modes"] == ["async"] and set(doc["held_out"]) == {"v0", "async"}
    for ev in doc["held_out"].values():
        for mode, samples in (("sampled", 4 * 4), ("greedy", 4)):
            r = ev[mode]
            assert r["samples"] == samples and finite(r["accuracy"]) and 0 <= r["accuracy"] <= 1
            assert 0 <= r["solved"] <= r["accuracy"] <= 1 and 0 <= r["truncated"] <= 1
    for mode in doc["modes"]:
        run = doc["runs"][mode]
        assert run["final_version"] == 2 and f"--mode {mode}" in run["command"]
        ledger = run["summary"]["ledger"]
        assert 0 < ledger["trained"] <= run["summary"]["samples_trained"] // 8  # groups of 8 samples
        assert ledger["issued"] == sum(v for k, v in ledger.items() if k not in ("issued", "dropped")) + sum(
            ledger["dropped"].values()
        )
        curve = run["curve"]
        assert [x["step"] for x in curve["steps"]] == [0, 1]
        assert all(0 <= x["reward_mean"] <= x["accuracy"] <= 1 for x in curve["steps"])
        assert [e["version"] for e in curve["greedy_eval"]][:1] == [0]


def check_accuracy(tmp_path: Path) -> None:
    out = tmp_path / "accuracy"
    printed = run_smoke("accuracy.py", out, tmp_path)
    result = json.loads((out / "accuracy.json").read_text())
    modes = list(result["modes"])
    steps = result["steps"]
    assert modes[0] == "sync" and len(modes) >= 2 and steps >= 1
    assert set(result["ratios_to_sync"]) == set(modes[1:]) == set(result["paired_ratios_to_sync"])
    v0 = result["sampled_eval"]["v0_accuracy"]
    assert finite(v0) and 0 <= v0 <= 1
    for mode in modes:
        (run,) = result["runs"][mode]  # one seed
        assert run["mode"] == mode and run["steps"] == steps
        for key in (
            "final_train_accuracy",
            "first_train_accuracy",
            "final_eval_accuracy",
            "sampled_eval_accuracy",
        ):
            assert finite(run[key]) and 0 <= run[key] <= 1, (mode, key, run[key])
        assert positive(run["total_wall_s"]) and positive(run["first_step_s"])
        assert all(finite(run[f"median_{k}"]) for k in ("step_s", "wait_s", "learner_s")), run
        assert result["modes"][mode]["seeds"] == [run["seed"]]
        lines = [
            json.loads(x)
            for x in (out / f"{mode}-seed{run['seed']}" / "metrics.jsonl").read_text().splitlines()
        ]
        assert [x["step"] for x in lines] == list(range(steps))
    table = (out / "accuracy.md").read_text()
    assert all(f"| {mode} | 1 |" in table for mode in modes)
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| mode | seeds |" in printed


def check_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    run_smoke("soak.py", out, tmp_path)  # exit 0: every check of the soak held
    summary = json.loads((out / "soak.json").read_text())
    assert summary["ok"] is True and summary["checks"] and all(summary["checks"].values()), summary["checks"]
    assert set(summary["kills"]) == {"worker", "learner", "broker"} and sum(summary["kills"].values()) >= 1
    assert summary["steps"] >= 1 and summary["samples_lost"] == 0
    assert summary["trained_samples"] == summary["expected_samples"] > 0
    ledger = summary["ledger"]
    accounted = sum(ledger[k] for k in ("trained", "complete_waiting", "in_flight", "partial"))
    assert ledger["issued"] == accounted + sum(ledger["dropped"].values())
    assert len(summary["kill_moments"]) == sum(summary["kills"].values())
    # episodes with side effects, the broker killed twice at the default snapshot interval: no step it
    # had on disk when it was killed ran again (a killed worker's unreturned steps do, with their keys)
    # A kill can find the books holding no episode step (right after a batch): such a run checks nothing
    # about them, so it is run again, at most three times in all; every run must pass every check.
    for attempt in range(3):
        out = tmp_path / f"soak-episodes-{attempt}"
        run_smoke("soak.py", out, tmp_path, extra=("--episodes", "--broker-every", "3"))
        summary = json.loads((out / "soak.json").read_text())
        assert summary["ok"] is True and summary["kills"]["broker"] >= 2, summary["checks"]
        episodes = summary["episodes"]
        assert episodes["steps_on_disk_run_again"] == 0
        if episodes["steps_on_disk_at_broker_kills"] > 0:
            break
    assert episodes["steps_run"] > 0 and episodes["steps_on_disk_at_broker_kills"] > 0


def check_results(tmp_path: Path) -> None:
    """`make results`'s orchestrator: its cheap steps at tiny sizes, into a folder of the test's own."""
    out = tmp_path / "docs"
    before = {f: f.stat().st_mtime_ns for f in (REPO / "docs").rglob("*") if f.is_file()}
    run_smoke("results.py", out, tmp_path, verb="run")
    assert {f: f.stat().st_mtime_ns for f in (REPO / "docs").rglob("*") if f.is_file()} == before
    for step, artifact in (("simulate", "simulate.json"), ("fuzz", "fuzz.json")):
        folder = out / "results" / step
        doc = json.loads((folder / artifact).read_text())
        assert doc["modes"] if step == "simulate" else doc["only_protocol_error"] is True
        stamp = json.loads((folder / "provenance.json").read_text())
        assert stamp["command"].startswith(("april simulate", "python tests/codec_fuzz.py")), stamp
        assert {"commit", "dirty", "date", "machine", "wall_s"} <= set(stamp) and positive(stamp["wall_s"])


def check_scheduling(tmp_path: Path) -> None:
    out = tmp_path / "scheduling.json"
    run_smoke("scheduling.py", out, tmp_path)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "scheduling" and doc["params"]["smoke"] is True
    rows = doc["results"]
    settings = {(r["workload"], r["prompt_corr"]) for r in rows}
    assert settings == {(w, c) for w in ("math-long-tail", "short-answer") for c in (0.0, 0.8)}
    for r in rows:
        assert r["command"].startswith(f"april simulate --lengths {r['workload']}"), r["command"]
        assert r["wasted_tokens"] == 0 and r["speedup_min"] <= r["speedup_mean"] <= r["speedup_max"]
        if r["run"] == "sync":
            assert r["speedup_mean"] == 1.0 and r["staleness_max"] == 0
    assert {r["run"] for r in rows} == {"sync", "april", "april-auto128"}


def load_benchmark(name: str) -> Any:
    """A module of benchmarks/ imported as its script imports its neighbours (benchmarks/ on the path)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def check_gpu_check(tmp_path: Path) -> None:
    """Every phase of the GPU check at its smoke size on the CPU, through the same code as on a GPU, with
    only what the GPU image's python3 can import (tests/image_python.py: uvicorn, pyarrow, ... cannot);
    an engine option bound on the way (`prefill_tokens`, a keyword TorchEngine has)."""
    from image_python import image_env

    out = tmp_path / "gpu-check"
    extra = ["--engine-option", "prefill_tokens=64"]
    printed = run_smoke("gpu_check.py", out, tmp_path, extra=extra, env=image_env(tmp_path / "image"))
    a = json.loads((out / "gpu_check.json").read_text())
    phases = a["phases"]
    assert a["benchmark"] == "gpu_check" and a["smoke"] is True and a["device"]["device"] == "cpu"
    assert list(phases) == ["device", "learner-torch", "up", "engine", "gpu-tests", "up-placed"]
    placed = phases.pop("up-placed")  # needs 2 GPUs: on this CPU, skipped with its reason
    assert (placed["status"], placed["reason"]) == ("skipped", "needs 2 GPUs, the device phase saw 0"), placed
    for name, e in phases.items():  # every phase ran to its end, without an error
        assert (e["status"], e["errors"], e["exit_code"]) == ("ok", [], 0), (name, e)
        assert 0 < e["wall_s"] <= e["timeout_s"] <= e["budget_s"], name
    assert 0 < a["wall_s"] <= a["budget_s"] and positive(a["device"]["matmul_tflops"])
    assert a["device"]["libraries"]["torch"] and a["device"]["libraries"]["deepspeed"]

    learner = phases["learner-torch"]["result"]
    model, params = learner["model"], phases["learner-torch"]["params"]
    assert learner["engine"]["optimizer"] == ["AdamW"]  # what the engine holds on the CPU
    assert [
        [r["samples"], r["response_len"], len(r["warmup_s"]), len(r["step_s"])] for r in learner["sizes"]
    ] == (params["sizes"])
    for r in learner["sizes"]:
        seqs = [r["prompt_len"] + r["response_len"]] * r["samples"]
        assert r["tokens"] == sum(seqs) and r["response_tokens"] == r["samples"] * r["response_len"]
        assert r["weight_flops"] == 6 * model["matmul_weights"] * r["tokens"]
        assert r["attention_flops"] == 6 * model["layers"] * model["heads"] * model["head_dim"] * sum(
            t * (t + 1) for t in seqs
        )
        assert (
            r["median_s"] == statistics.median(r["step_s"])
            and positive(r["tokens_per_s"])
            and finite(r["loss"])
        )
        measured = a["device"]["matmul_tflops"] * 1e12
        assert r["mfu"]["measured"]["weights"] == pytest.approx(r["weight_flops"] / r["median_s"] / measured)
        assert r["mfu"]["spec"] == {"weights": None, "with_attention": None}  # no data-sheet peak for a CPU

    run = phases["up"]["result"]["run"]
    assert run["exit_code"] == 0 and run["steps"] == 1 and run["samples_per_step"] == [2 * 2]
    assert 0 < run["first_step_s"] <= run["wall_s"] and positive(run["samples_per_s"])
    assert phases["up"]["result"]["command"].startswith("april up --headless --steps 1 --workers 1")

    engine = phases["engine"]["result"]
    assert engine["engine_options"] == {"prefill_tokens": 64}
    assert list(engine["decode"]) == ["tiny", "qwen3-smoke"]
    for d in engine["decode"].values():
        assert [r["active"] for r in d["rows"]] == [1, 2] and all(
            positive(r["ms_per_step"]) for r in d["rows"]
        )
    b = engine["batching"]
    assert b["continuous"]["useful_tokens"] == b["static_generate"]["useful_tokens"] == b["lengths"]["total"]
    assert b["ratio"] == pytest.approx(b["continuous"]["tokens_per_s"] / b["static_generate"]["tokens_per_s"])

    tests = phases["gpu-tests"]["result"]
    assert tests["files"][-1] == "tests/test_gpu.py" and "tests/test_sglang_engine.py" in tests["files"]
    assert len(tests["tests"]) == sum(tests["counts"].values()) >= 1 and tests["not_run"] == []
    assert tests["counts"]["failed"] == tests["counts"]["error"] == 0
    (sglang,) = (t for t in tests["tests"] if t["test"].startswith("tests/test_sglang_engine.py"))
    assert sglang["outcome"] == "skipped" and re.fullmatch(
        r"not collected: it imports (uvicorn|fastapi), absent on the GPU image", sglang["message"]
    ), sglang
    assert all(a["packages"][n].startswith(f"packages: {n}: ok") for n in phases), a["packages"]
    assert "; without sglang (the real SGLang server test skips); vllm (" in a["packages"]["gpu-tests"]
    assert "; uvicorn (tests/test_sglang_engine.py, whose fake server needs it" in a["packages"]["gpu-tests"]
    assert f"gpu-check: {a['packages']['up']}" in printed

    targets = {t["target"]: t for t in a["targets"]}
    assert len(targets) == 3 and all(t["met"] is None for n, t in targets.items() if "64 rows" in n)
    (cb,) = (t for n, t in targets.items() if "continuous" in n)
    assert cb["measured"] == b["ratio"] and cb["met"] == (b["ratio"] >= 5)

    stamp = json.loads((out / "provenance.json").read_text())
    assert stamp["command"] == (
        "python benchmarks/gpu_check.py --smoke --out docs/results/gpu-check "
        "--engine-option prefill_tokens=64"
    )
    assert {"commit", "dirty", "date", "machine", "wall_s"} <= set(stamp) and "gpu" in stamp["machine"]
    assert "===== up: ok" in (out / "gpu_check.log").read_text()
    assert "learner-torch      ok" in printed
    results = load_benchmark("results")
    block = results.block_gpu_check(out)  # docs/bench.md's section from this artifact
    assert all(f"| {name} | ok |" in block for name in phases) and "Source: " in block
    skipped = tests["counts"]["skipped"]
    assert "| torch (AdamW) | 4 x (8 + 16) | 1 |" in block and f"{skipped} skipped" in block

    # the same artifact as a run with both optimizers and a failed phase renders both, and says which won
    phases["learner-deepspeed"] = variant = json.loads(json.dumps(phases["learner-torch"]))
    variant["result"]["engine"]["adam_impl"] = "deepspeed"
    for row in variant["result"]["sizes"]:
        row["median_s"] /= 2
    phases["up"].update(status="error", errors=["phase: RuntimeError: april up exited 1"])
    a["optimizers"] = load_benchmark("gpu_check").optimizer_comparison(phases)
    assert [c["fastest"] for c in a["optimizers"]] == ["deepspeed", "deepspeed"]
    (out / "gpu_check.json").write_text(json.dumps(a))
    block = results.block_gpu_check(out)
    assert "| deepspeed (AdamW) | 8 x (8 + 16) |" in block and "(deepspeed the faster)" in block
    assert "| up | error |" in block and "april up exited 1" in block


HUNG_TESTS = """
import time

import pytest

pytestmark = pytest.mark.gpu


def test_quick():
    pass


def test_skips():
    pytest.skip("no second GPU")


def test_hangs():
    time.sleep(600)


def test_after():
    pass
"""


def test_a_gpu_tests_phase_killed_at_its_timeout_keeps_the_outcomes_it_had(tmp_path: Path) -> None:
    """The phase records each test as it ends: killed while a test hangs, it still has the passed and the
    skipped ones, and names the two that did not get to run."""
    gpu_check = load_benchmark("gpu_check")
    tests = tmp_path / "test_hung.py"
    tests.write_text(HUNG_TESTS)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    phase = gpu_check.Phase("gpu-tests", "gpu_tests", 60, 1, {"files": [str(tests)]})
    entry = gpu_check.run_phase(phase, tmp_path, env, time.monotonic() + 600)
    assert entry["status"] == "timeout", entry
    r = entry["result"]
    assert r["counts"] == {"passed": 1, "failed": 0, "error": 0, "skipped": 1, "not_run": 2}, r
    assert {t["test"].split("::")[1]: t["outcome"] for t in r["tests"]} == {
        "test_quick": "passed",
        "test_skips": "skipped",
    }
    assert [t.split("::")[1] for t in r["not_run"]] == ["test_hangs", "test_after"]


def test_a_collection_error_is_a_skip_only_for_a_package_the_image_lacks() -> None:
    gpu_tests = load_benchmark("gpu.gpu_tests")
    lines = [
        {"collected": ["tests/test_b.py::test_one"]},
        {"test": "tests/test_a.py", "when": "collect", "outcome": "error",
         "message": "ModuleNotFoundError: No module named 'uvicorn'"},
        {"test": "tests/test_c.py", "when": "collect", "outcome": "error",
         "message": "ModuleNotFoundError: No module named 'actors.gone'"},
        {"test": "tests/test_b.py::test_one", "when": "call", "outcome": "passed", "message": ""},
        {"test": "tests/test_b.py::test_one", "when": "teardown", "outcome": "error", "message": "boom"},
    ]  # fmt: skip
    rows, not_run = gpu_tests.outcomes(lines)
    assert {r["test"]: r["outcome"] for r in rows} == {
        "tests/test_a.py": "skipped",
        "tests/test_c.py": "error",
        "tests/test_b.py::test_one": "error",  # the worst of its reports
    }
    assert rows[0]["message"] == "not collected: it imports uvicorn, absent on the GPU image" and not not_run


def test_the_image_imitation_keeps_what_setuptools_vendors_once_this_process_imported_it(
    tmp_path: Path,
) -> None:
    """setuptools puts its `_vendor` folder (jaraco, more_itertools, ...) on sys.path when imported; those
    copies go with setuptools, which the image has, so a child under the imitation that imports setuptools
    (DeepSpeed does) finds them, while a blocked package stays unimportable."""
    import setuptools
    from image_python import image_env

    assert any(p.endswith("_vendor") for p in sys.path), setuptools.__file__
    child = (
        "import setuptools, jaraco.functools, more_itertools\n"
        "try:\n    import uvicorn\nexcept ModuleNotFoundError as e:\n    print('blocked', e.name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", child],
        env=image_env(tmp_path / "image"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "blocked uvicorn", proc.stderr[-2000:]


def test_the_packages_preflight_says_what_each_phase_lacks_and_a_phase_without_gpus_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = load_benchmark("gpu.image")
    gpu_check = load_benchmark("gpu_check")
    monkeypatch.setattr(image, "lacking", lambda modules: [m for m in modules if m in ("zmq", "sglang")])
    lacks, line = image.preflight_line("up", image.PHASE_NEEDS["up_run"])
    assert lacks == ["zmq"] and line == "packages: up: lacks zmq (carried by make gpu-wheels: installed?)"
    lacks, line = image.preflight_line("gpu-tests", image.PHASE_NEEDS["gpu_tests"])
    assert lacks == ["zmq"] and line.endswith("; without sglang (the real SGLang server test skips)")
    placed = gpu_check.Phase("up-placed", "up_run", 60, 30, {}, gpus=2)
    device = {"device": {"result": {"identity": {"gpus": 1}}}}
    assert gpu_check.gpu_shortfall(placed, device) == "needs 2 GPUs, the device phase saw 1"
    assert gpu_check.gpu_shortfall(placed, {"device": {"result": {"identity": {"gpus": 8}}}}) == ""
    assert gpu_check.gpu_shortfall(gpu_check.Phase("up", "up_run", 60, 30, {}), device) == ""


def test_the_gpu_checks_full_size_is_the_issues() -> None:
    """What `make gpu-check` runs on a GPU (the smoke runs the same code smaller): the phases in order,
    the second optimizer last, the issue's shapes and sizes, budgets that fit the 6 minutes' plan."""
    gpu_check = load_benchmark("gpu_check")
    plan = gpu_check.plan(gpu_check.parse_args(["--out", "x"]))
    names = [p.name for p in plan]
    assert names == ["device", "learner-deepspeed", "up", "engine", "gpu-tests", "up-placed", "learner-torch"]
    by = {p.name: p.params for p in plan}
    placed = next(p for p in plan if p.name == "up-placed")
    assert placed.gpus == 2 and by["up-placed"]["placed"] is True  # skipped on one GPU, april up places
    up_run = load_benchmark("gpu.up_run")
    args = up_run.command(by["up-placed"])
    assert "--workers" not in args and not any(a.endswith(".device=cuda") for a in args), args
    assert "--workers" in up_run.command(by["up"])  # the single-GPU run: one worker, devices named
    assert all(p["device"] == "cuda" for p in by.values())
    assert all(p.gpus == 1 for p in plan if p.name != "up-placed")
    assert by["learner-deepspeed"]["shape"] == "qwen3-1.7b" and by["learner-torch"]["adam_impl"] == "torch"
    assert [s[:2] for s in by["learner-deepspeed"]["sizes"]] == [[16, 8192], [64, 8192]]
    assert by["up"] == {"device": "cuda", "steps": 3, "sets": []}
    assert [d["name"] for d in by["engine"]["decode"]] == ["tiny", "qwen3-0.6b"] and by["engine"][
        "prompt"
    ] == 128
    assert by["engine"]["max_rows"] == 64 and by["engine"]["batching"]["model"] == "tiny"
    budget = gpu_check.parse_args(["--out", "x"]).budget_s
    assert budget == 360 and all(p.least_s <= p.budget_s for p in plan)
    assert sum(p.budget_s for p in plan[:5]) <= budget  # every phase fits; the second learner if time allows


def test_the_engine_phase_hands_its_engine_options_to_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--engine-option cuda_graphs=false` reaches the engines the phase measures, over
    engine_throughput.py's own `cuda_graphs=True`: with graphs "supported" on the CPU and captured as a
    stand-in that re-runs its step, the default phase's engine replays graphs and the eager one has none.
    An option TorchEngine does not take is refused before anything runs."""
    from types import SimpleNamespace

    from actors.engines import cuda_graphs

    decode = load_benchmark("gpu.engine_decode")
    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda device: True)
    monkeypatch.setattr(cuda_graphs, "capture", lambda step, pool, stream: SimpleNamespace(replay=step))
    params = {"max_rows": 2, "prompt": 4, "repeats": 1, "device": "cpu"}
    shapes = {"bucketed": True}  # as on CUDA
    graphs = decode.decode_sweep(REPO / "models" / "tiny", {**params, "engine_options": shapes})
    off = {**shapes, "cuda_graphs": False}
    eager = decode.decode_sweep(REPO / "models" / "tiny", {**params, "engine_options": off})
    assert graphs["placement"] == "cpu, cuda graphs" and graphs["captured_graphs"] > 0, graphs
    assert eager["placement"] == "cpu, eager (cuda graphs off)" and eager["captured_graphs"] == 0, eager
    assert graphs["kv_cache"] == eager["kv_cache"] == "2 rows x 9 tokens, 0.00 GiB"  # prompt 4 + 1 + 4
    with pytest.raises(ValueError, match=r"engine option\(s\) \['bogus'\]: TorchEngine does not take them"):
        decode.check_options({"bogus": 1})


def test_the_gpu_check_stops_without_a_gpu_and_takes_its_commit_from_the_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine without CUDA the full check measures nothing on the CPU: the device phase fails and
    the rest are skipped, exit 1. Where the tree has no git (the device's copy), provenance.json takes the
    commit that `make gpu-wheels` wrote."""
    out = tmp_path / "out"
    source = tmp_path / "source.json"
    source.write_text(json.dumps({"commit": "a" * 40, "dirty": False}))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    argv = ["--out", str(out), "--phases", "device,up", "--source-stamp", str(source), "--device", "cuda:0"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), *argv],
        cwd=tmp_path,
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    a = json.loads((out / "gpu_check.json").read_text())
    assert a["phases"]["device"]["status"] == "error"
    assert a["phases"]["up"] == {"status": "skipped", "reason": "the device phase failed", "wall_s": 0.0}
    stamp = json.loads((out / "provenance.json").read_text())
    assert (
        stamp["commit"]
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    )  # git wins where there is one

    gpu_check = load_benchmark("gpu_check")
    args = gpu_check.parse_args(["--out", str(out), "--source-stamp", str(source)])
    unknown = {"command": "", "commit": "unknown", "dirty": False, "machine": {}}
    monkeypatch.setattr(gpu_check, "provenance", lambda command: dict(unknown, command=" ".join(command)))
    stamp = gpu_check.stamp(args, ["--out", str(out), f"--source-stamp={source}"], {"name": "G"}, 1.0)
    assert stamp["commit"] == "a" * 40 and stamp["commit_from"] == "source.json of make gpu-wheels"
    assert stamp["command"] == "python benchmarks/gpu_check.py --out docs/results/gpu-check"
    assert stamp["machine"]["gpu"]["name"] == "G"


def test_the_gpu_wheels_check_names_what_the_machine_would_miss(tmp_path: Path) -> None:
    """`make gpu-wheels`' check of its folder, on wheels written here: a requirement neither the folder
    nor the image provides (markers and extras judged for CPython 3.12 on Linux), a second wheel of one
    package, a wheel for another platform, a version other than the pin."""
    import zipfile

    wheels = load_benchmark("gpu.wheels")

    def wheel(name: str, version: str, tags: str, *requires: str) -> None:
        dist = f"{name.replace('-', '_')}-{version}"
        with zipfile.ZipFile(tmp_path / f"{dist}-{tags}.whl", "w") as z:
            lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
            z.writestr(f"{dist}.dist-info/METADATA", "\n".join(lines) + "\n")

    wheel(
        "alpha",
        "1.0",
        "py3-none-any",
        "beta>=2",
        "torch",
        "gamma; extra == 'docs'",
        "delta; python_version < '3.10'",
    )
    wheel("beta", "2.0", "cp312-cp312-manylinux_2_17_x86_64")
    wheel("epsilon", "1.0", "py3-none-any", "zeta; sys_platform == 'linux'")
    assert wheels.requirement_gaps(tmp_path) == [
        'epsilon-1.0-py3-none-any.whl needs zeta; sys_platform == "linux"'
    ]
    wheel("beta", "2.1", "cp311-cp311-win_amd64")
    problems = wheels.check(tmp_path, {"alpha": "1.0", "beta": "2.0", "epsilon": "1.0", "omega": "3"})
    assert "two wheels of beta" in problems and "no wheel of omega==3" in problems
    assert "beta-2.1-cp311-cp311-win_amd64.whl: not a cp312 manylinux x86-64 or pure wheel" in problems
    assert any(p.endswith('needs zeta; sys_platform == "linux"') for p in problems)


def test_a_failing_or_overrunning_gpu_check_phase_keeps_what_it_measured(tmp_path: Path) -> None:
    """The GPU check's runner: a phase that raises records its error, one killed at its timeout keeps what
    it had recorded (the device's identity, before its matmul), and one with too little of the check's
    budget left is skipped; each is judged on its own."""
    gpu_check = load_benchmark("gpu_check")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    deadline = time.monotonic() + 600
    no_gpu = gpu_check.Phase(
        "d", "hardware", 120, 1, {"device": "cuda", "matmul_n": 8, "matmul_reps": 1, "rounds": 1}
    )
    failed = gpu_check.run_phase(no_gpu, tmp_path, env, deadline)
    assert failed["status"] == "error" and failed["exit_code"] == 1, failed
    assert failed["errors"] == [
        "phase: RuntimeError: device cuda: torch sees no CUDA device (torch "
        f"{failed['result']['identity']['libraries']['torch']})"
    ]
    assert failed["result"]["identity"]["cuda_available"] is False and "log_tail" in failed

    huge = {"device": "cpu", "matmul_n": 4096, "matmul_reps": 10_000, "rounds": 1}
    slow = gpu_check.run_phase(gpu_check.Phase("s", "hardware", 20, 1, huge), tmp_path, env, deadline)
    assert slow["status"] == "timeout" and slow["exit_code"] is None, slow
    assert slow["errors"] == ["timed out after 20 s"] and slow["result"]["identity"]["device"] == "cpu"
    assert "matmul" not in slow["result"] and 20 <= slow["wall_s"] < 20 + 45

    late = gpu_check.run_phase(
        gpu_check.Phase("l", "hardware", 60, 30, huge), tmp_path, env, time.monotonic() + 5
    )
    assert late["status"] == "skipped" and late["reason"].startswith("out of time") and late["wall_s"] == 0.0


CHECKS: dict[str, Callable[[Path], None]] = {
    "broker_throughput.py": check_broker_throughput,
    "engine_throughput.py": check_engine_throughput,
    "learner_step.py": check_learner_step,
    "learner_memory.py": check_learner_memory,
    "weight_sync.py": check_weight_sync,
    "accuracy.py": check_accuracy,
    "learning_run.py": check_learning_run,
    "soak.py": check_soak,
    "scheduling.py": check_scheduling,
    "results.py": check_results,
    "gpu_check.py": check_gpu_check,
}


def test_every_benchmark_has_a_smoke_check() -> None:
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert scripts == sorted(CHECKS), "a benchmark without a smoke check here (or a check of a removed one)"


def test_the_benchmarks_readme_gives_each_smoke_and_full_command() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    for script in CHECKS:
        assert f"## `{script}`" in readme, script
        assert re.search(rf"benchmarks/{re.escape(script)}( [a-z]+)? --smoke", readme), script


@pytest.mark.parametrize("script", sorted(CHECKS))
def test_smoke_run(script: str, tmp_path: Path) -> None:
    CHECKS[script](tmp_path)


def test_every_measured_block_in_the_docs_is_rendered_from_its_artifact() -> None:
    """README.md and docs/*.md quote measurements only inside `<!-- measured:NAME -->` blocks, rendered by
    `benchmarks/results.py render` from the artifacts committed under docs/: a block edited by hand, or an
    artifact rerun without rendering, fails here."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "results.py"), "render", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_artifact_folder_says_how_it_was_made() -> None:
    """Each folder of measurements under docs/ carries its provenance: the command and the commit."""
    folders = sorted({p.parent for p in (REPO / "docs").rglob("*.json")} - {REPO / "docs"})
    assert folders, "no artifacts under docs/"
    for folder in folders:
        stamp = json.loads((folder / "provenance.json").read_text())
        assert stamp["command"] and len(stamp["commit"]) == 40, folder
