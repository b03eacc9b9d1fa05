"""Launching a script as the ranks of one torch.distributed run, for the learner tests.

Each rank is `python SCRIPT SPEC_FILE` with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (what
torchrun sets), logging to its own file; a rank that fails or hangs fails the test with its log's tail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 600  # "did not hang": a rank loads torch, DeepSpeed and a model on a loaded machine


def launch_ranks(script: str, spec_files: list[Path], logs: list[Path]) -> None:
    """Run `script` once per spec file, as ranks 0..n-1 of one run, and wait for all of them."""
    from april.ports import free_ports

    port, procs = str(free_ports(1)[0]), []
    for rank, (spec_file, log_path) in enumerate(zip(spec_files, logs, strict=True)):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(len(spec_files)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        log = open(log_path, "wb")  # noqa: SIM115  closed below
        cmd = [sys.executable, script, str(spec_file)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            rc = proc.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        if rc != 0:
            tail = logs[rank].read_text(errors="replace")[-3000:]
            failed.append(f"rank {rank} of {len(procs)} exited {rc}:\n{tail}")
    assert not failed, "\n".join(failed)
