"""Running one mode of `april bench` as a real `april up` run: broker, workers and learner processes.

Owns only what a benchmark run adds to `april up` (cli.up_cmd, whose launch, supervision and stop it
reuses as they are): the run's config file in OUT/runs/MODE.toml, free loopback ports (a run elsewhere on
the default ports must not meet this one), and the figures read back from OUT/runs/MODE/.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from april.config import write_config
from april.ports import free_ports
from broker.sim.figures import Figures
from cli.bench_figures import BenchRunError, run_figures
from cli.bench_plan import BenchRun, BenchSetting, run_config
from cli.up_cmd import UpOptions, run_up


def run_mode(setting: BenchSetting, bench_run: BenchRun, out: Path) -> tuple[Figures, float]:
    """Run one mode to its last step; returns its figures and the seconds the whole run took (start-up
    and stop included)."""
    label = bench_run.label
    config = run_config(setting, bench_run, f"bench-{label}")
    worker_port, learner_port, pub_port = free_ports(3)
    broker = dataclasses.replace(
        config.broker, worker_port=worker_port, learner_port=learner_port, pub_port=pub_port
    )
    config = dataclasses.replace(config, broker=broker)
    runs = out / "runs"
    run_dir = runs / label
    if run_dir.exists() and any(run_dir.iterdir()):
        raise BenchRunError(f"{run_dir} already holds a run: choose another --out")
    path = runs / f"{label}.toml"
    write_config(config, path)
    print(f"april bench: {label}: {setting.engines} x `april worker` + broker + learner", file=sys.stderr)
    started = time.monotonic()
    code = run_up(
        UpOptions(config=path, workers=setting.engines, run_dir=run_dir, headless=True, steps=setting.steps)
    )
    took = time.monotonic() - started
    if code != 0:
        raise BenchRunError(f"{label}: april up exited {code} (logs in {run_dir / 'logs'})")
    return run_figures(run_dir), took
