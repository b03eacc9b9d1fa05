"""Starting and stopping real SGLang servers for the SGLang adapter (one server per GPU or TP group).

`server_command` is the one place that says how a server is started: the launch command (`python -m
sglang.launch_server`, or a command line of the user's own, e.g. SGLang's own virtualenv) and the flags
RL needs (token ids only, a weight version, a bound on running requests, the engine's GPUs as its TP
size). Every flag parses with SGLang 0.5.23's own parser (sglang/srt/server_args.py:
prepare_server_args). `launch` starts servers in-process for an `SGLangEngine`, which stops them on close;
`april up` starts them as supervised children instead (cli/sglang_servers.py). Needs a GPU machine with
sglang installed to run a real server.

A server inherits this process's environment; one with SGLANG_RETURN_ORIGINAL_LOGPROB set would report
log-probs before temperature (sglang/srt/layers/sampler.py), so `server_command` refuses to build it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from actors.engine import EngineError
from actors.engines.sglang_engine import SGLangEngine, stop_server
from actors.engines.sglang_http import http_call

ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def check_server_env(env: Mapping[str, str]) -> None:
    """Refuse an environment that would make a server report log-probs the learner cannot match."""
    value = env.get(ORIGINAL_LOGPROB_ENV, "")
    if value.strip().lower() in ("1", "true"):  # sglang/srt/utils/common.py: get_bool_env_var
        raise EngineError(
            f"{ORIGINAL_LOGPROB_ENV}={value} is set: an SGLang server started with it reports log-probs "
            "before temperature, which the learner does not recompute (unset it)"
        )


def launch_prefix(launch: str = "") -> list[str]:
    """The command that starts a server, before its flags: `launch` split as a shell would (e.g.
    "/opt/sglang/bin/python -m sglang.launch_server"), or this interpreter's `-m sglang.launch_server`."""
    return shlex.split(launch) or [sys.executable, "-m", "sglang.launch_server"]


def server_command(
    model_path: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    slots: int = 8,
    version: int = 0,
    extra: Sequence[str] = (),
    deterministic: bool = False,
    launch: str = "",
    tp_size: int = 1,
    mem_fraction: float | None = None,
    seed: int | None = None,
) -> list[str]:
    """The command line for one server (token ids only), started by `launch` (see `launch_prefix`).
    With `deterministic`, sampling_seed is honoured (--enable-deterministic-inference), so a run's seed
    makes sampling reproducible. `tp_size`: the GPUs the server spans; `mem_fraction`: its share of each
    GPU's memory (None: SGLang's own choice, for a GPU it has to itself); `seed`: its --random-seed (None:
    SGLang's). `extra` comes last, so a flag given there wins over april's (argparse keeps the last
    value). EngineError if this environment would spoil the server's log-probs."""
    check_server_env(os.environ)
    flags = ["--enable-deterministic-inference"] if deterministic else []
    if mem_fraction is not None:
        flags += ["--mem-fraction-static", f"{mem_fraction:g}"]
    if seed is not None:
        flags += ["--random-seed", str(seed)]
    return [
        *launch_prefix(launch),
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--skip-tokenizer-init",
        "--max-running-requests", str(slots),
        "--weight-version", str(version),
        "--tp-size", str(tp_size),
        *flags,
        *extra,
    ]  # fmt: skip


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Poll /server_info until the server answers; EngineError if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise EngineError(
                f"sglang server for {url} exited with code {proc.returncode} during start-up "
                "(is the sglang extra installed? pip install .[sglang])"
            )
        try:
            http_call(url, "GET", "/server_info", timeout_s=5.0)
            return
        except EngineError as e:
            if time.monotonic() > deadline:
                raise EngineError(f"sglang server {url} not ready after {timeout_s:g}s: {e}") from None
        time.sleep(1.0)


def launch(
    model_path: str,
    *,
    port: int = 30000,
    gpus: Sequence[str] = (),
    slots: int = 8,
    version: int = 0,
    extra_args: Sequence[str] = (),
    deterministic: bool = False,
    startup_timeout_s: float = 900.0,
    log_dir: Path | None = None,
    **engine_kw: Any,
) -> SGLangEngine:
    """Start one server per entry of `gpus` (its CUDA_VISIBLE_DEVICES, e.g. "0" or "2,3" with
    `--tp-size 2` in extra_args; none: one server on the visible devices) on ports port, port+1, ...,
    wait until they answer, and return an engine that stops them on `close`."""
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for i, gpu in enumerate(list(gpus) or [None]):
            env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            cmd = server_command(
                model_path,
                port=port + i,
                slots=slots,
                version=version,
                extra=extra_args,
                deterministic=deterministic,
            )
            if log_dir is None:
                procs.append(subprocess.Popen(cmd, env=env))
            else:
                with open(log_dir / f"sglang-{port + i}.log", "ab") as log:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port + i}")
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc, startup_timeout_s)
        return SGLangEngine(urls, slots=slots, version=version, processes=procs, **engine_kw)
    except BaseException:
        for proc in procs:
            stop_server(proc)
        raise
