"""`april openenv-gateway`, and the OpenEnv children of `april up`: the gateway, and the server command.

The command runs the OpenEnv session gateway as a process of its own until SIGINT/SIGTERM: on several
nodes, run it where the workers can reach it and set `env.gateway` to its address. It opens sessions only
on the server `env.name` names, and binds a non-loopback address only when told (`--allow-remote`):
anyone reaching the port can play sessions. For `april up` (`cli.up_cmd`): `openenv_specs` (a gateway on
a free loopback port unless `env.gateway` is set; the server when `env.server_command` is), `check_openenv`
(its preflight) and `server_answers` (the health check it waits on before starting workers).
"""

from __future__ import annotations

import logging
import shlex
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from april.config import Config, EnvConfig
from april.envs.openenv_adapter import PREFIX, is_openenv
from april.envs.openenv_gateway import Gateway, GatewayError, package, serve
from april.episode import one_line
from april.ports import free_ports, is_loopback
from cli.options import UserError
from cli.process import setup_logging, stop_requested
from cli.supervisor import ChildSpec

GATEWAY = "openenv-gateway"  # april up's children
SERVER = "openenv-server"


class GatewayStartError(UserError):
    """The gateway cannot start as asked; the message is one line."""


def check_bind(address: str, allow_remote: bool) -> None:
    parts = urlparse(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise GatewayStartError(f"--bind {address!r}: expected tcp://HOST:PORT")
    if not is_loopback(parts.hostname) and not allow_remote:
        raise GatewayStartError(
            f"--bind {address!r}: not a loopback address; anyone who reaches it can play sessions on the "
            "server, so say --allow-remote to bind it (on a private network)"
        )


def run_gateway(config: Config, bind: str, allow_remote: bool) -> None:
    if not is_openenv(config.env.name):
        raise GatewayStartError(f"env.name = {config.env.name!r}: expected '{PREFIX}http://HOST:PORT'")
    check_bind(bind, allow_remote)
    try:
        gateway = Gateway((config.env.name.removeprefix(PREFIX),), config.env.session_idle_s)
    except GatewayError as exc:
        raise GatewayStartError(str(exc)) from None
    setup_logging()
    log = logging.getLogger("april.openenv_gateway")
    log.info("OpenEnv gateway epoch %s on %s for %s", gateway.epoch, bind, config.env.name)
    try:
        serve(gateway, bind, stop_requested())
    except GatewayError as exc:
        raise GatewayStartError(str(exc)) from None
    log.info("OpenEnv gateway stopped (%d sessions closed for idleness)", gateway.closed_idle)


def server_url(env: EnvConfig) -> str:
    return env.name.removeprefix(PREFIX).rstrip("/")


def server_answers(url: str) -> bool:
    """Whether the OpenEnv server answers GET URL/health (OpenEnv's `HealthResponse`) with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as r:
            return int(r.status) == 200
    except OSError:
        return False


def check_openenv(env: EnvConfig) -> None:
    """`april up`'s preflight of an `openenv:URL` run, one line each: the gateway's package where it
    would start one, a command that does not parse, and a server that should run already but does not."""
    if not is_openenv(env.name):
        return
    if not env.gateway:
        try:
            package()
        except GatewayError as exc:
            raise GatewayStartError(f"env.name = {env.name!r}: {exc}") from None
    if env.server_command:
        try:
            if not shlex.split(env.server_command):
                raise ValueError("it is empty")
        except ValueError as exc:
            raise GatewayStartError(f"env.server_command: {one_line(exc)}") from None
    elif not server_answers(server_url(env)):
        raise GatewayStartError(
            f"env.name = {env.name!r}: no OpenEnv server answers {server_url(env)}/health (start it, or set "
            "env.server_command for `april up` to)"
        )


def openenv_specs(
    config: Config, config_path: Path, run_dir: Path, max_restarts: int
) -> tuple[list[ChildSpec], str]:
    """The children an `openenv:URL` run needs (the server when `env.server_command` is set, a gateway
    unless `env.gateway` is), and the gateway address its workers are given."""
    env = config.env
    specs = []
    logs = run_dir / "logs"
    if env.server_command:
        command = shlex.split(env.server_command)
        argv = tuple(command[1:])
        specs.append(
            ChildSpec(SERVER, argv, argv, logs / f"{SERVER}.log", max_restarts, program=(command[0],))
        )
    gateway = env.gateway
    if not gateway:
        gateway = f"tcp://127.0.0.1:{free_ports(1)[0]}"
        argv = (GATEWAY, "--config", str(config_path), "--bind", gateway)
        specs.append(ChildSpec(GATEWAY, argv, argv, logs / f"{GATEWAY}.log", max_restarts))
    return specs, gateway
