"""OpenEnv environment servers as april environments: `env.name = "openenv:URL"`.

`OpenEnvEnvironment` plays an episode on a session of the OpenEnv server at URL, held by the session
gateway (`april.envs.openenv_gateway`, at `env.gateway`): reset opens the session, each model turn is one
step of it, and april's state is the session's handle plus the rewards so far, so an aborted episode
resumes on any worker while the gateway keeps the session. The model's turn text becomes the action's one
string field (the server's `/schema`, or `env.args` "action_field"); an observation's fields (OpenEnv
sends them without done, reward and metadata) become one user message; the episode's reward is the sum
of its steps' rewards ("reward": "sum") or the last one ("last"). A gateway or server that lost the
session fails the sample with one `env_session_lost` line.

Knows the gateway's messages, not WebSockets; imports nothing of OpenEnv (the server runs its own).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import msgpack
import zmq

from april.data.records import PromptRecord
from april.envs.openenv_gateway import VERSION
from april.episode import EnvFailed, EnvStep, EpisodeError, Message, Role, StepKey, Tool, one_line
from april.failures import Reason
from april.transport import configure

PREFIX = "openenv:"
REWARDS = ("sum", "last")
DEFAULT_TIMEOUT_S = 5.0  # a reset or step on the server; + 1 s for the gateway: under env.step_timeout_s
_ARGS = {"action_field", "observation_fields", "reward", "reset", "timeout_s", "gateway"}


def is_openenv(name: str) -> bool:
    return name.startswith(PREFIX)


def with_gateway(args: str, gateway: str) -> str:
    """`env.args` with `env.gateway` added as "gateway" (how the address reaches the tool runner's
    children, which are given the spec and its args)."""
    try:
        obj = json.loads(args) if args.strip() else {}
    except ValueError:
        return args  # refused with its one line by Settings.parse
    if not isinstance(obj, dict):
        return args
    return json.dumps({**obj, "gateway": gateway} if gateway else obj)


@dataclass(frozen=True, slots=True)
class Settings:
    """`env.args` of an OpenEnv environment (a JSON object; every key optional)."""

    url: str
    gateway: str = ""
    action_field: str = ""  # "": the action schema's one string field
    observation_fields: tuple[str, ...] = ()  # (): every field the observation has
    reward: str = "sum"
    reset: tuple[tuple[str, Any], ...] = ()  # reset's keyword arguments besides the seed
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def parse(cls, spec: str, args: str) -> Settings:
        url = spec.removeprefix(PREFIX)
        parts = urlparse(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise EpisodeError(f"env.name = {spec!r}: expected 'openenv:http://HOST:PORT' (the server's URL)")
        try:
            obj = json.loads(args) if args.strip() else {}
        except ValueError:
            raise EpisodeError(f"env.args = {args[:80]!r}: not JSON, expected an object") from None
        if not isinstance(obj, dict):
            raise EpisodeError(f"env.args = {args[:80]!r}: expected a JSON object")
        unknown = sorted(set(obj) - _ARGS)
        if unknown:
            raise EpisodeError(
                f"env.args: unknown key {unknown[0]!r}, expected some of {', '.join(sorted(_ARGS))}"
            )
        fields = obj.get("observation_fields", [])
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise EpisodeError(f"env.args observation_fields: got {fields!r}, expected a list of field names")
        if obj.get("reward", "sum") not in REWARDS:
            raise EpisodeError(
                f"env.args reward: got {obj['reward']!r}, expected one of {', '.join(REWARDS)}"
            )
        reset = obj.get("reset", {})
        if not isinstance(reset, dict):
            raise EpisodeError(f"env.args reset: got {reset!r}, expected an object of reset's arguments")
        timeout = obj.get("timeout_s", DEFAULT_TIMEOUT_S)
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise EpisodeError(f"env.args timeout_s: got {timeout!r}, expected a number > 0")
        return cls(
            url.rstrip("/"),
            str(obj.get("gateway", "")),
            str(obj.get("action_field", "")),
            tuple(fields),
            str(obj.get("reward", "sum")),
            tuple(sorted(reset.items())),
            float(timeout),
        )


class GatewayClient:
    """Requests to the gateway with a deadline each: a DEALER, answers matched by request id (a late
    answer to an abandoned request is dropped)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = configure(self.ctx.socket(zmq.DEALER))
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.connect(address)
        self._ids = itertools.count(1)

    def call(self, request: dict[str, Any], wait_s: float) -> dict[str, Any]:
        rid = next(self._ids)
        self.sock.send(msgpack.packb({"v": VERSION, "id": rid, **request}, default=str))
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                continue
            answer = msgpack.unpackb(self.sock.recv())
            if isinstance(answer, dict) and answer.get("id") == rid:
                return answer
        raise EnvFailed(
            Reason.ENV_SESSION_LOST,
            f"the OpenEnv gateway at {self.address} did not answer a {request['t']} within {wait_s:g}s "
            "(down or restarting?)",
        )


@functools.lru_cache(maxsize=8)
def _client(address: str, pid: int) -> GatewayClient:
    """One client per gateway address and process (a forked child makes its own)."""
    return GatewayClient(address)


@functools.lru_cache(maxsize=8)
def action_field(url: str, named: str, timeout_s: float) -> str:
    """The action field the turn text fills: `named`, or the one string field of the server's action
    schema (GET URL/schema, OpenEnv's `SchemaResponse`)."""
    try:
        with urllib.request.urlopen(f"{url}/schema", timeout=timeout_s) as r:
            schema = json.loads(r.read())["action"]
    except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
        raise EnvFailed(
            Reason.ENV_SESSION_LOST, f"cannot read the action schema at {url}/schema: {one_line(exc)}"
        ) from None
    props: dict[str, Any] = schema.get("properties", {})
    if named:
        if named not in props:
            raise EpisodeError(f"env.args action_field = {named!r}: the action has fields {', '.join(props)}")
        return named
    strings = [k for k, v in props.items() if k != "metadata" and v.get("type") == "string"]
    if len(strings) != 1:
        raise EpisodeError(
            f"env.args action_field: the action at {url} has string fields {strings or 'none'}, expected "
            "exactly one (name it with env.args action_field)"
        )
    return strings[0]


class OpenEnvEnvironment:
    """An april `Environment` over sessions of an OpenEnv server (see the module docstring)."""

    tools: tuple[Tool, ...] = ()
    final_step_repeatable = False  # a step changes the server's environment: an abort waits for it

    def __init__(self, spec: str, args: str = "") -> None:
        self.spec = spec
        self.settings = Settings.parse(spec, args)

    def reset(self, prompt: PromptRecord) -> EnvStep:
        s = self.settings
        reset = {"seed": prompt.prompt_index, **dict(s.reset)}  # every sample of a group: the same task
        answer = self._call({"t": "open", "url": s.url, "reset": reset})
        result = answer["result"]
        if result.get("done") is True:
            self._call({"t": "close", "handle": answer["handle"]})
            raise EpisodeError(f"the OpenEnv environment at {s.url} ended the episode at reset")
        state = {"handle": answer["handle"], "rewards": []}
        return EnvStep((self.observation(result),), json.dumps(state))

    def step(self, state: str, turn: Message, key: StepKey | None = None) -> EnvStep:
        s = self.settings
        held = json.loads(state)
        action = {action_field(s.url, s.action_field, s.timeout_s): turn.content}
        request = {"t": "step", "handle": held["handle"], "action": action}
        answer = self._call({**request, "key": None if key is None else str(key)})
        result = answer["result"]
        reward = result.get("reward")
        rewards = [*held["rewards"], float(reward) if isinstance(reward, int | float) else 0.0]
        if result.get("done") is not True:
            return EnvStep((self.observation(result),), json.dumps({**held, "rewards": rewards}))
        total = sum(rewards) if s.reward == "sum" else rewards[-1]
        return EnvStep((), json.dumps({"rewards": rewards}), done=True, reward=total)

    def observation(self, result: dict[str, Any]) -> Message:
        """The observation's fields (those of `observation_fields`, else all) as one user message: a
        single field's text alone, several as `name: value` lines (JSON for what is not text)."""
        obs: dict[str, Any] = result.get("observation") or {}
        names = self.settings.observation_fields or tuple(obs)
        missing = [n for n in names if n not in obs]
        if missing:
            raise EpisodeError(
                f"env.args observation_fields: {missing[0]!r} is not in the observation ({', '.join(obs)})"
            )
        texts = {n: obs[n] if isinstance(obs[n], str) else json.dumps(obs[n], default=str) for n in names}
        text = (
            next(iter(texts.values()))
            if len(texts) == 1
            else "\n".join(f"{n}: {t}" for n, t in texts.items())
        )
        return Message(Role.USER, text)

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        s = self.settings
        if not s.gateway:
            raise EpisodeError("env.gateway is empty: the OpenEnv session gateway's address is needed")
        answer = _client(s.gateway, os.getpid()).call({**request, "timeout_s": s.timeout_s}, s.timeout_s + 1)
        if not answer.get("ok"):
            reason = Reason.ENV_SESSION_LOST if answer.get("lost") else Reason.ENV_ERROR
            raise EnvFailed(reason, f"OpenEnv {request['t']}: {answer.get('error', '?')}")
        return answer
