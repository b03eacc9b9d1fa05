"""A scripted engine for the worker's engine-failure tests: implements `actors.engine.Engine` with
deterministic responses, and fails on cue the ways actors/engine.py says an engine may fail.

It stands in for the engine, never for the thing under test (the worker, the broker): a request the engine
fails (an error output with finish reason NONE), a transient failure (ABORT with an error, after some
tokens), the engine down (`EngineUnavailable` from any call, carrying every held request's partial), a
plain `EngineError` no request is blamed for, and `probe` failing until the engine serves again.

Responses: a sample (identified through the worker's `identify` hook, as the sim engine is) always gets
the same tokens, one per step, `length_min..length_max` of them ending in the stop token, so a resumed
sample continues exactly where it stopped.

As a process: `python tests/scripted_engine.py CONFIG WORKER_ID SCRIPT_JSON` runs `april worker`'s own
code (`cli.worker_cmd.run_worker`) with this engine in place of the configured one; a test against
another engine (an SGLang server killed and restarted) differs only in the engine.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from actors.engine import (
    EngineError,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
)
from actors.engines.sim_engine import Identify
from april.records import FinishReason

LOGPROB = -0.5


@dataclass(frozen=True)
class EngineScript:
    step_s: float = 0.01  # wall seconds one step takes (one token for every active request)
    length_min: int = 3  # a sample's whole response length, drawn from its identity
    length_max: int = 12
    fail_every: int = 0  # samples with identity key % fail_every == 0: failed by the engine (NONE + error)
    transient_every: int = 0  # requests with id % transient_every == 0: ABORT + error after half their tokens
    down_file: str = ""  # while this file exists the engine is down (every call, probe included)
    down_at_steps: tuple[int, ...] = ()  # the engine goes down at these step counts...
    probe_failures: int = 0  # ...and its probe then fails this many times
    down_on_abort: int = 0  # the first N aborts raise EngineUnavailable
    down_on_load: int = 0  # the first N weight loads raise EngineUnavailable
    error_at_steps: tuple[int, ...] = ()  # step raises a plain EngineError at these step counts


def fails(key: int, script: EngineScript) -> bool:
    """Whether the engine fails every request of the sample with identity `key`."""
    return script.fail_every > 0 and key % script.fail_every == 0


def response_length(key: int, script: EngineScript) -> int:
    return script.length_min + key % (script.length_max - script.length_min + 1)


@dataclass
class _Request:
    request_id: int
    key: int
    done: int  # response tokens the sample had when added
    budget: int
    version: int
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class ScriptedEngine:
    name = "scripted"
    can_reuse_kv = False

    def __init__(
        self, script: EngineScript, slots: int, sampling: SamplingParams, identify: Identify, version: int = 0
    ) -> None:
        self.script = script
        self.slots = slots
        self.stop = sampling.stop_token_ids[0] if sampling.stop_token_ids else 2
        self.identify = identify
        self.version = version
        self.requests: dict[int, _Request] = {}
        self.steps = 0
        self.down_cued = False  # a scripted down (down_at_steps) not yet raised
        self.probes_to_fail = 0
        self.aborts = self.loads = 0
        self.probes: list[float] = []  # monotonic time of every probe (in-process tests read them)

    @property
    def placement(self) -> str:
        return "scripted"

    @property
    def active(self) -> int:
        return len(self.requests)

    # -- failures

    def _file_down(self) -> bool:
        return bool(self.script.down_file) and Path(self.script.down_file).exists()

    def _raise_if_down(self) -> None:
        if self._file_down() or self.down_cued:
            self.down_cued = False
            self.probes_to_fail = self.script.probe_failures
            self._go_down()

    def _go_down(self) -> None:
        partials = [self._output(r, FinishReason.ABORT) for r in self.requests.values()]
        self.requests.clear()
        raise EngineUnavailable("scripted: connection refused (server down)", partials)

    # -- the Engine protocol

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        self._raise_if_down()
        if self.active + len(requests) > self.slots:
            raise EngineError(f"scripted: {self.active} active + {len(requests)} > {self.slots} slots")
        for req in requests:
            identity = self.identify(req)
            done = int(np.asarray(req.input_ids).shape[0]) - identity.prompt_len
            self.requests[req.request_id] = _Request(
                req.request_id, identity.key, done, req.max_new_tokens, self.version
            )

    def step(self) -> list[GenerationOutput]:
        self._raise_if_down()
        self.steps += 1
        if self.steps in self.script.down_at_steps:
            self.down_cued = True
        if self.steps in self.script.error_at_steps:
            raise EngineError("scripted: malformed answer from the server")
        time.sleep(self.script.step_s)
        out: list[GenerationOutput] = []
        for r in list(self.requests.values()):
            reason = self._advance(r)
            if reason is not None:
                del self.requests[r.request_id]
                error = "" if reason in (FinishReason.STOP, FinishReason.LENGTH) else self._error_of(r)
                out.append(self._output(r, reason, error))
        return out

    def _advance(self, r: _Request) -> FinishReason | None:
        """One token for `r`, or why it ends now (None: it goes on)."""
        if fails(r.key, self.script):
            return FinishReason.NONE  # refused before any token, as a prompt over the context is
        total = response_length(r.key, self.script)
        every = self.script.transient_every
        if every and r.request_id % every == 0 and len(r.tokens) >= max(1, (total - r.done) // 2):
            return FinishReason.ABORT
        if len(r.tokens) >= r.budget:
            return FinishReason.LENGTH
        position = r.done + len(r.tokens)
        token = self.stop if position >= total - 1 else 3 + (r.key * 31 + position * 7) % 200
        r.tokens.append(token)
        r.versions.append(self.version)
        if token == self.stop:
            return FinishReason.STOP
        return FinishReason.LENGTH if len(r.tokens) >= r.budget else None

    def _error_of(self, r: _Request) -> str:
        if fails(r.key, self.script):
            return "scripted: the prompt is longer than the context (400)"
        return "scripted: out of memory, request aborted (503)"

    def _output(self, r: _Request, reason: FinishReason, error: str = "") -> GenerationOutput:
        return GenerationOutput.of(
            r.request_id, r.tokens, [LOGPROB] * len(r.tokens), r.versions, reason, error=error
        )

    def abort(self) -> list[GenerationOutput]:
        self._raise_if_down()
        self.aborts += 1
        if self.aborts <= self.script.down_on_abort:
            self._go_down()
        out = [self._output(r, FinishReason.ABORT) for r in self.requests.values()]
        self.requests.clear()
        return out

    def load_weights(self, path: Path, version: int) -> None:
        self._raise_if_down()
        self.loads += 1
        if self.loads <= self.script.down_on_load:
            self._go_down()
        self.version = version

    def probe(self) -> None:
        self.probes.append(time.monotonic())
        if self._file_down():
            raise EngineUnavailable("scripted: connection refused (server down)")
        if self.probes_to_fail > 0:
            self.probes_to_fail -= 1
            raise EngineUnavailable("scripted: connection refused (server restarting)")

    def close(self) -> None:
        self.requests.clear()


def main() -> None:
    from april.config import load_config
    from cli.worker_cmd import run_worker

    config_path, worker_id, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    script = EngineScript(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})
    config = load_config(config_path, overrides={"worker.worker_id": worker_id})
    run_worker(
        config,
        lambda cfg, sampling, identify, version: ScriptedEngine(
            script, cfg.slots, sampling, identify, version
        ),
    )


if __name__ == "__main__":
    main()
