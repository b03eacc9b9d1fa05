"""actors.tool_runner: environment steps in killable child processes.

Real child processes run the built-in calculator and a user environment written to tmp_path whose
behaviour is picked by the turn: tools that echo, report the child's pid, nap, or hang (repeatable or
not), and steps that raise, hang, crash, print to stdout, return a wrong type, nap without a tool call or
answer their StepKey. `Final` declares its call-less steps not repeatable.
"""

from __future__ import annotations

import ast
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from actors.tool_runner import ToolResult, ToolRunner, ToolRunnerSettings
from april.data import PromptRecord
from april.envs.calculator import make_example
from april.episode import EpisodeError, Message, ResetRequest, Role, StepKey, StepRequest, ToolCall

LONG_S = 60.0  # a time limit no well-behaved step comes near, however loaded the machine
SHORT_S = 1.0  # the limit of the tests of limits, on steps that hang for an hour

ENV_SOURCE = """
import json
import os
import sys
import time

from april.episode import EnvStep, Tool, call_tools, prompt_messages

if sys.argv[0].endswith("tool_runner.py") and os.environ.get("APRIL_TEST_CHILD_FAILS"):
    raise RuntimeError("only the child fails")


def nap(arguments):
    time.sleep(arguments["s"])
    return str(os.getpid())


def meet(arguments):  # check in at a meeting of n calls, wait up to a minute for all, answer this pid
    folder = arguments["folder"]
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < arguments["n"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return str(os.getpid()) if len(os.listdir(folder)) >= arguments["n"] else "alone"


HANDLERS = {
    "meet": meet,
    "echo": lambda a: json.dumps(a),
    "pid": lambda a: str(os.getpid()),
    "nap": nap,
    "hang": lambda a: time.sleep(3600),
    "charge": nap,
}


class Scripted:
    tools = (
        Tool("echo", "", {}),
        Tool("pid", "", {}),
        Tool("meet", "", {}, timeout_s=120.0),
        Tool("nap", "", {}, timeout_s=60.0),
        Tool("hang", "", {}, timeout_s=float(os.environ.get("APRIL_TEST_HANG_S", "1"))),
        Tool("charge", "", {}, repeatable=False, timeout_s=60.0),
    )

    def reset(self, prompt):
        if prompt.text == "hang":
            time.sleep(3600)
        if prompt.text == "empty":
            return EnvStep((), json.dumps({"n": 0}))
        return EnvStep(prompt_messages(prompt), json.dumps({"n": 0}))

    def step(self, state, turn, key=None):
        if turn.content == "key":
            return EnvStep((), state, done=True, reward=-1.0 if key is None else float(key.step))
        if turn.content.startswith("sleep "):
            time.sleep(float(turn.content.split()[1]))
            return EnvStep((), state, done=True, reward=1.0)
        if turn.content == "raise":
            raise ValueError("bad\\nstep")
        if turn.content == "hang":
            time.sleep(3600)
        if turn.content == "crash":
            os._exit(3)
        if turn.content == "wrong":
            return "not a step"
        if turn.content == "not json":
            return EnvStep(call_tools(turn, HANDLERS), "n=1")
        if turn.content == "print":
            print("noise on stdout")
            print('{"v": 1, "t": "done", "key": 999, "step": {}}', flush=True)
        if not turn.tool_calls:
            return EnvStep((), state, done=True, reward=1.0)
        n = json.loads(state)["n"] + 1
        return EnvStep(call_tools(turn, HANDLERS), json.dumps({"n": n}))


class Final(Scripted):
    final_step_repeatable = False


class BadFinal(Scripted):
    final_step_repeatable = "no"


class NoKey(Scripted):
    def step(self, state, turn):
        return super().step(state, turn)
"""


@pytest.fixture
def env_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "april_test_tool_envs"
    (tmp_path / f"{name}.py").write_text(ENV_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the children inherit sys.path via PYTHONPATH
    monkeypatch.setenv("APRIL_TEST_HANG_S", str(SHORT_S))
    yield f"{name}:Scripted"
    sys.modules.pop(name, None)


@pytest.fixture
def runner(env_spec: str) -> Iterator[ToolRunner]:
    r = ToolRunner(env_spec, ToolRunnerSettings(processes=2, step_timeout_s=LONG_S))
    yield r
    r.close()


def calls(*specs: tuple[str, dict[str, object]]) -> Message:
    return Message(Role.ASSISTANT, "", tuple(ToolCall(f"call_{i}", n, a) for i, (n, a) in enumerate(specs)))


def step(*specs: tuple[str, dict[str, object]], state: str = '{"n": 0}') -> StepRequest:
    return StepRequest(state, calls(*specs))


def said(text: str) -> StepRequest:
    return StepRequest('{"n": 0}', Message(Role.ASSISTANT, text))


def collect(runner: ToolRunner, n: int, within_s: float = 120.0) -> dict[int, ToolResult]:
    """Poll until `n` results arrived; fail the test (not hang) otherwise."""
    out: dict[int, ToolResult] = {}
    deadline = time.monotonic() + within_s
    while len(out) < n:
        assert time.monotonic() < deadline, f"got {len(out)} results within {within_s}s, expected {n}"
        for r in runner.poll(wait_s=0.05):
            assert r.key not in out, f"key {r.key} reported twice"
            out[r.key] = r
    return out


def observed(result: ToolResult) -> list[str]:
    assert result.step is not None, result.error
    return [m.content for m in result.step.observation]


def pids(runner: ToolRunner, n: int = 2) -> set[int]:
    """The pids of `n` children, each answering one of `n` calls that wait for each other: so all `n`
    children are up and idle afterwards."""
    folder = tempfile.mkdtemp(prefix="april-meet-")
    for k in range(n):
        runner.submit(-1 - k, step(("meet", {"folder": folder, "n": n})))
    answers = {observed(r)[0] for r in collect(runner, n).values()}
    assert "alone" not in answers, "a call waited for the others in vain: they did not run at the same time"
    return {int(a) for a in answers}


def test_the_calculator_runs_reset_steps_and_the_end() -> None:
    ex = make_example(0, 2)
    with ToolRunner("calculator", ToolRunnerSettings(processes=1, step_timeout_s=LONG_S)) as runner:
        assert [t.name for t in runner.tools] == ["add"]
        runner.submit(1, ResetRequest(ex.record()))
        first = collect(runner, 1)[1].step
        assert first is not None
        assert first.observation == (Message(Role.USER, ex.prompt), Message(Role.USER, "next 40"))
        runner.submit(2, StepRequest(first.state, calls(("add", {"n": 40}))))
        runner.submit(3, StepRequest(first.state, Message(Role.ASSISTANT, f"Answer: {ex.answer}")))
        got = collect(runner, 2)
        assert observed(got[2]) == ["69", "all added"]  # the register held 29
        assert got[3].step is not None and got[3].step.done and got[3].step.reward == 1.0


def test_results_are_keyed_and_the_state_is_the_environments(runner: ToolRunner) -> None:
    for key in range(6):
        runner.submit(key, step(("echo", {"k": key}), ("echo", {"twice": key}), state=json.dumps({"n": key})))
    got = collect(runner, 6)
    for key, result in got.items():
        assert observed(result) == [json.dumps({"k": key}), json.dumps({"twice": key})]
        assert result.step is not None and json.loads(result.step.state) == {"n": key + 1}
    assert runner.pending == 0


def test_requests_run_in_parallel_in_separate_children(runner: ToolRunner) -> None:
    assert len(pids(runner, 2)) == 2


def test_a_tool_that_hangs_is_answered_with_a_timeout_observation(env_spec: str) -> None:
    with ToolRunner(env_spec, ToolRunnerSettings(processes=1, step_timeout_s=SHORT_S)) as runner:
        before = pids(runner, 1)
        runner.submit(1, step(("echo", {"x": 1}), ("hang", {}), state='{"n": 5}'))
        runner.submit(2, step(("echo", {"x": 2})))  # queued behind it: runs in the next child
        got = collect(runner, 2)
        assert got[1].timed_out and got[1].step is not None
        assert got[1].error == f"tool_timeout: tool call of echo, hang timed out after {5 + SHORT_S:g} s"
        # the calls' time was echo's 5 s (the default) and hang's 1 s
        assert observed(got[1]) == [f"error: tool timed out after {5 + SHORT_S:g} s"] * 2
        assert got[1].step.state == '{"n": 5}' and not got[1].step.done  # the state did not advance
        assert [m.tool_call_id for m in got[1].step.observation] == ["call_0", "call_1"]
        assert observed(got[2]) == ['{"x": 2}']
        assert pids(runner, 1).isdisjoint(before)  # the hung child was killed and replaced


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (
            ResetRequest(PromptRecord(0, np.zeros(0, dtype=np.int32), "hang", {})),
            "env_timeout: environment reset timed out after 1s",
        ),
        (said("hang"), "env_timeout: environment step timed out after 1s"),
    ],
)
def test_env_code_that_hangs_fails_the_request(
    env_spec: str, request_: ResetRequest | StepRequest, error: str
) -> None:
    with ToolRunner(env_spec, ToolRunnerSettings(processes=1, step_timeout_s=SHORT_S)) as runner:
        runner.submit(1, request_)
        runner.submit(2, step(("echo", {"x": 1})))
        got = collect(runner, 2)
        assert (got[1].step, got[1].error) == (None, error)
        assert observed(got[2]) == ['{"x": 1}']


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("raise", "env_error: environment step raised ValueError: bad step"),
        ("wrong", "env_error: environment step returned str, expected an EnvStep"),
        ("crash", "env_crashed: environment process died (exit code 3) during a step"),
        # found by a user: accepted, and the next step failed reading it (JSONDecodeError)
        ("not json", "env_bad_state: environment step answered state 'n=1': not JSON"),
    ],
)
def test_env_failures_fail_one_request_and_the_runner_recovers(
    runner: ToolRunner, text: str, error: str
) -> None:
    runner.submit(1, said(text))
    runner.submit(2, step(("echo", {"x": 1})))
    runner.submit(3, step(("echo", {"x": 2})))
    got = collect(runner, 3)
    assert (got[1].step, got[1].error) == (None, error)
    assert observed(got[2]) == ['{"x": 1}'] and observed(got[3]) == ['{"x": 2}']


def test_a_reset_without_messages_fails_with_a_reason_of_its_own(runner: ToolRunner) -> None:
    """Found by a user: a reset that answered no messages gave a prompt of no tokens, which every engine
    refused, sample after sample ("got 0 ids"), and nothing named the reset."""
    runner.submit(1, ResetRequest(PromptRecord(0, np.zeros(0, dtype=np.int32), "empty", {})))
    got = collect(runner, 1)[1]
    assert (got.step, got.error) == (
        None,
        "env_empty_reset: environment reset answered no messages: there is no prompt",
    )


def test_stdout_noise_does_not_corrupt_the_protocol(runner: ToolRunner) -> None:
    runner.submit(1, said("print"))
    result = collect(runner, 1)[1]
    assert result.step is not None and result.step.done and result.step.reward == 1.0


def test_cancel_drops_queued_requests(env_spec: str) -> None:
    with ToolRunner(env_spec, ToolRunnerSettings(processes=1, step_timeout_s=LONG_S)) as runner:
        runner.submit(1, step(("nap", {"s": 1.0})))
        runner.submit(2, step(("echo", {"x": 2})))
        assert runner.cancel(2)
        assert set(collect(runner, 1)) == {1}
        assert runner.poll(wait_s=0.5) == [] and runner.pending == 0


def test_cancel_kills_a_running_repeatable_step(runner: ToolRunner) -> None:
    before = pids(runner, 2)  # both children are up: the next request is handed over at once
    runner.submit(1, step(("nap", {"s": 3600})))
    assert runner.cancel(1)
    assert runner.pending == 0 and runner.poll(wait_s=0.5) == []
    after = pids(runner, 2)
    assert len(after & before) == 1  # one child was killed and replaced, the other serves on


def test_cancel_leaves_a_running_unrepeatable_step_to_finish(runner: ToolRunner) -> None:
    pids(runner, 2)  # both children are up: the next request is handed over at once
    runner.submit(1, step(("charge", {"s": 1.0}), ("echo", {"x": 1})))
    assert not runner.cancel(1)
    assert observed(collect(runner, 1)[1])[1] == '{"x": 1}'


def answered(runner: ToolRunner) -> None:
    """Wait until every running request has written its answer to its pipe (not read yet)."""
    import select

    children = [s.child for s in runner._slots if s is not None and s.job is not None]
    for child in children:
        assert select.select([child.fileno()], [], [], LONG_S)[0], "a child did not answer"


@pytest.mark.parametrize("tool", ["echo", "charge"])
def test_cancel_never_drops_a_result_that_has_been_read(runner: ToolRunner, tool: str) -> None:
    """A step that answered has run: cancelling it must not drop its result (the driver would run it
    again on resume), whether the runner read the answer before the cancel (while serving another key)
    or finds it in the pipe during the cancel, and whether its tool is repeatable or not."""
    pids(runner, 2)  # both children are up: the next requests are handed over at once
    runner.submit(1, step((tool, {"s": 0.0} if tool == "charge" else {"x": 1})))
    runner.submit(2, step((tool, {"s": 0.0} if tool == "charge" else {"x": 2})))
    answered(runner)
    assert runner.cancel(99)  # unknown: nothing to withdraw, but the answers are read on the way
    assert runner.running == 0 and runner.pending == 2
    assert not runner.cancel(1)  # read before the cancel
    assert runner.pending == 2
    got = collect(runner, 2)
    assert got[1].ok and got[2].ok
    runner.submit(3, step((tool, {"s": 0.0} if tool == "charge" else {"x": 3})))
    answered(runner)
    assert not runner.cancel(3)  # answered in the pipe, read by the cancel
    assert collect(runner, 1)[3].ok


def test_a_step_receives_its_key_when_its_env_takes_one(env_spec: str) -> None:
    key = StepKey(7, 1, 4)
    assert str(key) == "7-1-4" and StepKey.from_json(key.to_json()) == key
    # Scripted's step takes a key (and answers with its step index), NoKey's does not (called without)
    for cls, want in (("Scripted", 4.0), ("NoKey", -1.0)):
        spec = env_spec.replace(":Scripted", f":{cls}")
        with ToolRunner(spec, ToolRunnerSettings(processes=1, step_timeout_s=LONG_S)) as runner:
            runner.submit(1, StepRequest('{"n": 0}', Message(Role.ASSISTANT, "key"), key))
            runner.submit(2, StepRequest('{"n": 0}', Message(Role.ASSISTANT, "key")))  # no key to pass
            got = collect(runner, 2)
            assert got[1].step is not None and got[2].step is not None, (got[1].error, got[2].error)
            assert (got[1].step.reward, got[2].step.reward) == (want, -1.0)


def test_an_env_declares_whether_its_call_less_step_may_run_again(env_spec: str) -> None:
    """A turn without tool calls runs only the environment's own step code: repeatable (killed by a
    cancel) unless the environment says `final_step_repeatable = False` (a scoring step with effects)."""
    for cls, killed in (("Scripted", True), ("Final", False)):
        spec = env_spec.replace(":Scripted", f":{cls}")
        with ToolRunner(spec, ToolRunnerSettings(processes=1, step_timeout_s=LONG_S)) as runner:
            assert runner.final_step_repeatable is killed
            pids(runner, 1)  # the child is up: the step is handed over at once
            runner.submit(1, said("sleep 1.0"))
            assert runner.running == 1
            assert runner.cancel(1) is killed
            if killed:
                assert runner.pending == 0 and runner.poll(wait_s=0.5) == []
            else:
                assert collect(runner, 1)[1].ok
    with pytest.raises(EpisodeError, match=r"final_step_repeatable is 'no', expected True or False"):
        ToolRunner(env_spec.replace(":Scripted", ":BadFinal"))


def test_a_bad_spec_is_refused_at_construction() -> None:
    with pytest.raises(EpisodeError) as err:
        ToolRunner("nope")
    assert str(err.value) == "env: got 'nope', expected one of calculator, python or 'module:Class'"


def test_a_child_that_cannot_load_fails_every_request(env_spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APRIL_TEST_CHILD_FAILS", "1")
    with ToolRunner(env_spec, ToolRunnerSettings(processes=2, step_timeout_s=LONG_S)) as runner:
        runner.submit(1, step(("echo", {})))
        error = collect(runner, 1)[1].error
        assert error.startswith(f"env_crashed: environment process could not load {env_spec!r}: ")
        assert "RuntimeError: only the child fails" in error and "\n" not in error
        runner.submit(2, step(("echo", {})))
        assert collect(runner, 1, within_s=1.0)[2].error == error


def test_duplicate_keys_and_closed_runners_are_refused(runner: ToolRunner) -> None:
    runner.submit(1, step(("nap", {"s": 0.5})))
    with pytest.raises(ValueError, match="key 1 is already pending"):
        runner.submit(1, step(("echo", {})))
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(2, step(("echo", {})))


def test_no_pickle_on_the_tool_path() -> None:
    import actors.child_process
    import actors.tool_runner
    import april.episode

    for module in (actors.child_process, actors.tool_runner, april.episode):
        tree = ast.parse(Path(module.__file__ or "").read_text())
        names = {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names
        }
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "pickle" not in names | modules, module.__name__
