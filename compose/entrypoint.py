"""Container entrypoint of the april image: set up what one container's april process needs, then exec it.

Owns the two things compose/docker-compose.yml cannot say itself:

- A worker id per replica. Workers share the broker's network namespace (``network_mode:
  service:broker``), hence its hostname, and each is the same PID in its own container, so the default
  id ``<hostname>-<pid>`` would be the same for every replica of ``--scale worker=N`` (and the id is the
  worker's ZeroMQ identity). Unless ``APRIL_WORKER_WORKER_ID`` is given, ``april worker`` gets a random one.
- With ``LOCAL_SGLANG=1`` (the GPU profile), the worker's SGLang server: started in this container on a
  free loopback port for the model and slots of the worker config in the environment, extra server flags
  from ``LOCAL_SGLANG_ARGS``, waited for (``LOCAL_SGLANG_TIMEOUT_S``, default 900), and handed to the
  worker as ``APRIL_WORKER_SGLANG_URLS``. The server outlives this process (exec replaces it with april)
  and stops with the container.

Does not own: any other configuration. Every other command runs unchanged: ``exec "$@"``.
"""

import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import MutableMapping, Sequence


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_sglang(env: MutableMapping[str, str]) -> str:
    """Start one SGLang server for the worker configured in `env`; its URL once it answers."""
    from actors.engines.sglang_launch import server_command, wait_ready
    from april.config import load_config

    cfg = load_config(env=env).worker
    if not cfg.model:
        raise SystemExit("april entrypoint: LOCAL_SGLANG=1 needs APRIL_WORKER_MODEL (the model to serve)")
    port = free_port()
    extra = shlex.split(env.get("LOCAL_SGLANG_ARGS", ""))
    command = server_command(cfg.model, port=port, slots=cfg.slots, extra=extra)
    server = subprocess.Popen(command, env=dict(env))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, server, float(env.get("LOCAL_SGLANG_TIMEOUT_S", "900")))
    return url


def prepare(argv: Sequence[str], env: MutableMapping[str, str]) -> None:
    """Set the variables the command in `argv` needs in `env` (starting its SGLang server if asked)."""
    if list(argv[:2]) != ["april", "worker"]:
        return
    env.setdefault("APRIL_WORKER_WORKER_ID", f"worker-{uuid.uuid4().hex[:12]}")
    if env.get("LOCAL_SGLANG") == "1":
        env["APRIL_WORKER_SGLANG_URLS"] = start_sglang(env)


def main(argv: Sequence[str]) -> None:
    if not argv:
        raise SystemExit("april entrypoint: no command given (expected e.g. `april worker ...`)")
    from actors.engine import EngineError
    from april.config import ConfigError

    env = dict(os.environ)
    try:
        prepare(argv, env)
    except (ConfigError, EngineError) as exc:  # one readable line, not a trace
        raise SystemExit(f"april entrypoint: {exc}") from None
    os.execvpe(argv[0], list(argv), env)


if __name__ == "__main__":
    main(sys.argv[1:])
