"""The environment of `benchmarks/soak.py --episodes`: every step has an effect, logged with its key.

`StepLedger` answers each model turn with one tool message and ends the episode after `TURNS` steps, its
reward from the turns' lengths. Each step sleeps a while (so kills land inside steps) and appends a line
`KEY PPID` (its StepKey, the worker's pid) to the file `$APRIL_SOAK_EFFECTS`, from which the soak counts
how often each step ran and who ran it. Nothing of it may run twice by the environment's own account:
its call-less steps are declared not repeatable, so an abort waits for them. Importable as
`step_ledger:StepLedger` with benchmarks/envs/ on the path (the soak puts it there for the processes it
starts).
"""

from __future__ import annotations

import json
import os
import random
import time

from april.data import PromptRecord
from april.episode import EnvStep, Message, Role, StepKey, Tool

TURNS = 3
STEP_S = (0.02, 0.3)  # a step's duration, uniform


class StepLedger:
    tools: tuple[Tool, ...] = ()
    final_step_repeatable = False

    def reset(self, prompt: PromptRecord) -> EnvStep:
        return EnvStep((Message(Role.USER, f"count for {prompt.text}"),), json.dumps({"k": 0, "chars": 0}))

    def step(self, state: str, turn: Message, key: StepKey | None = None) -> EnvStep:
        time.sleep(random.uniform(*STEP_S))
        with open(os.environ["APRIL_SOAK_EFFECTS"], "a") as f:
            f.write(f"{key} {os.getppid()}\n")
        s = json.loads(state)
        k, chars = s["k"] + 1, s["chars"] + len(turn.content)
        new = json.dumps({"k": k, "chars": chars})
        if k >= TURNS:
            return EnvStep((), new, done=True, reward=float(chars % 2))
        return EnvStep((Message(Role.USER, f"step {k}: {len(turn.content)}"),), new)
