"""Scripted environments for the episode driver's tests, importable as `episode_envs:Class` (tests/ is on
the path of the test processes and of the tool runner's children they start).

`CountingEnv` answers every model turn with one tool message that depends on the turn's text, and ends
the episode after `TURNS` turns with a reward computed from every turn's length, so a transcript that
lost or repeated anything scores differently. The model need not call a tool: any turn is answered.
`SlowCountingEnv` takes `STEP_S` seconds per step (an abort catches it running). Its `commit` tool is not
repeatable: a turn that calls it cannot be killed by an abort (the tests inject such a turn).

`EffectEnv` is a CountingEnv whose every step has an effect: it appends a line `KEY PPID` (its StepKey and
the worker's pid) to the file `$APRIL_TEST_EFFECTS`, so a test counts how often each step ran and who
ran it; its call-less steps are declared not repeatable. With `$APRIL_TEST_GATES` set, a step stops at
two gates in that folder: while `hold-before` exists before its effect (having written `at-before-KEY`),
while `hold-after` exists after it (having written `at-after-KEY`). `SlowEffectEnv` takes `STEP_S` per
step; `RepeatableEffectEnv` declares its call-less steps repeatable (an abort may kill and re-run them).
The broken ones fail as users' environments were found to: a step that raises (`BrokenEnv`), a step
that answers a state that is not JSON (`NotJsonStateEnv`), a reset that answers no messages
(`EmptyResetEnv`), a tool that hangs past its timeout (`HangingToolEnv`'s `wait`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from april.data import PromptRecord
from april.episode import EnvStep, Message, Role, StepKey, Tool

TURNS = 3
STEP_S = 0.3
_ARGS = {"type": "object", "properties": {}}


class CountingEnv:
    tools: tuple[Tool, ...] = (
        Tool("note", "Write a note.", _ARGS, repeatable=True, timeout_s=30.0),
        Tool("commit", "Commit the notes.", _ARGS, repeatable=False, timeout_s=30.0),
    )
    step_s = 0.0

    def reset(self, prompt: PromptRecord) -> EnvStep:
        return EnvStep((Message(Role.USER, f"count for {prompt.text}"),), json.dumps({"k": 0, "chars": 0}))

    def step(self, state: str, turn: Message) -> EnvStep:
        time.sleep(self.step_s)
        s = json.loads(state)
        k, chars = s["k"] + 1, s["chars"] + len(turn.content) + 7 * len(turn.tool_calls)
        new = json.dumps({"k": k, "chars": chars, "lens": [*s.get("lens", []), len(turn.content)]})
        if k >= TURNS:
            return EnvStep((), new, done=True, reward=(chars % 10) / 10 + 0.05)
        text = f"obs {k}: {len(turn.content)} {len(turn.tool_calls)}"
        return EnvStep((Message(Role.TOOL, text, tool_call_id="call_0", name="note"),), new)


class SlowCountingEnv(CountingEnv):
    step_s = STEP_S


class BrokenEnv(CountingEnv):
    def step(self, state: str, turn: Message) -> EnvStep:
        raise ValueError("the environment broke")


class EffectEnv(CountingEnv):
    final_step_repeatable = False

    def step(self, state: str, turn: Message, key: StepKey | None = None) -> EnvStep:
        gates = os.environ.get("APRIL_TEST_GATES")
        self._gate(gates, "before", key)
        with open(os.environ["APRIL_TEST_EFFECTS"], "a") as f:
            f.write(f"{key} {os.getppid()}\n")
        self._gate(gates, "after", key)
        return super().step(state, turn)

    @staticmethod
    def _gate(gates: str | None, where: str, key: StepKey | None) -> None:
        if not gates:
            return
        (Path(gates) / f"at-{where}-{key}").touch()
        deadline = time.monotonic() + 300  # a test that forgot its gate fails, it does not hang
        while (Path(gates) / f"hold-{where}").exists() and time.monotonic() < deadline:
            time.sleep(0.005)


class SlowEffectEnv(EffectEnv):
    step_s = STEP_S


class RepeatableEffectEnv(EffectEnv):
    final_step_repeatable = True


class NotJsonStateEnv(CountingEnv):
    def step(self, state: str, turn: Message) -> EnvStep:
        return EnvStep((Message(Role.TOOL, "ok", tool_call_id="call_0", name="note"),), "k=1")


class EmptyResetEnv(CountingEnv):
    def reset(self, prompt: PromptRecord) -> EnvStep:
        return EnvStep((), json.dumps({"k": 0, "chars": 0}))


HANG_TOOL_S = 0.2


class HangingToolEnv(CountingEnv):
    tools = (*CountingEnv.tools, Tool("wait", "Wait.", _ARGS, timeout_s=HANG_TOOL_S))

    def step(self, state: str, turn: Message) -> EnvStep:
        if any(call.name == "wait" for call in turn.tool_calls):
            time.sleep(3600)
        return super().step(state, turn)


class PlanEnv:
    """Answers each step as `april simulate` plays it (april/sim/episode_plans.py): the plan drawn for the
    sample (its StepKey's group and index) from the workload in `$APRIL_TEST_PLAN` (JSON: turns,
    turn_tokens, tool_ms, observations length specs, seed, max_turns, max_turn_tokens, repeatable).
    A step after the plan's last turn ends the episode (reward 0.0); any other answers an observation of
    the planned length in bytes (one token each in the sim engine's byte chat). No latency: the test that
    uses it decides when an answer is seen."""

    tools: tuple[Tool, ...] = ()

    def __init__(self) -> None:
        from actors.lengths import LengthSpec
        from april.sim.episode_plans import DrawnEpisodes, EpisodePlans, EpisodeWorkload

        spec = json.loads(os.environ["APRIL_TEST_PLAN"])
        obs = LengthSpec.parse(spec["observations"])
        sampler = DrawnEpisodes(
            LengthSpec.parse(spec["turns"]),
            LengthSpec.parse(spec["turn_tokens"]),
            LengthSpec.parse(spec["tool_ms"]),
            obs,
        )
        workload = EpisodeWorkload(sampler, obs)
        self.plans = EpisodePlans(workload, spec["seed"], spec["max_turns"], spec["max_turn_tokens"])
        self.final_step_repeatable = bool(spec["repeatable"])

    def reset(self, prompt: PromptRecord) -> EnvStep:
        return EnvStep((Message(Role.USER, prompt.text),), "{}")

    def step(self, state: str, turn: Message, key: StepKey) -> EnvStep:
        from april.records import Sample

        empty = np.zeros(0, dtype=np.int32)
        plan = self.plans(Sample(group_id=key.group_id, index=key.index, prompt_ids=empty))
        if plan.ends_after(key.step):
            return EnvStep((), state, done=True, reward=0.0)
        return EnvStep((Message(Role.TOOL, "x" * plan.observations[key.step]),), state)
