"""verifiers environments run unchanged (april/envs/verifiers_adapter.py), against the real package
(verifiers 0.3, the classic `load_environment` API): a ToolEnv, a SingleTurnEnv and a MultiTurnEnv played
turn by turn give the reward, observations and stop that verifiers' own `run_rollout` gives for the same
model turns; the state travels as JSON to a fresh instance; a live object in the state fails the episode
with one line; and a real `april up` (sim engine, the tiny model's tokenizer) trains MultiTurnEnv
episodes through APRIL's aborts, every one scored as verifiers scores its transcript."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import verifiers as vf
import verifiers_envs
import verifiers_tool_env
from test_up import check_run, run_up, up_and_kill_a_worker, wait_all_exited

from actors.tokenizer import HFTokenizer
from april.chat import chat_format
from april.envs import verifiers_adapter
from april.envs.verifiers_adapter import INPUT_KEY, VerifiersEnvironment, VerifiersPromptSource
from april.episode import EpisodeError, Message, Role, ToolCall, live_handle
from april.rollouts import OBSERVATION

TOOL_ENV = "verifiers:verifiers_tool_env"


class ScriptedClient(vf.legacy.clients.Client):  # type: ignore[misc]
    """The model for verifiers' own rollout: answers with the given turns, in order."""

    def __init__(self, turns: list[Message]) -> None:
        self.turns = list(turns)

    def setup_client(self, config: Any) -> None:
        return None

    async def to_native_tool(self, tool: Any) -> Any: ...
    async def to_native_prompt(self, messages: Any) -> Any: ...
    async def get_native_response(self, *args: Any, **kwargs: Any) -> Any: ...
    async def raise_from_native_response(self, *args: Any, **kwargs: Any) -> Any: ...
    async def from_native_response(self, *args: Any, **kwargs: Any) -> Any: ...
    async def close(self) -> None: ...

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        turn = self.turns.pop(0)
        calls = [
            # a call the model wrote unreadably reaches verifiers as its raw text: not JSON
            vf.types.ToolCall(
                id=c.id, name=c.name, arguments="not json" if c.error else json.dumps(dict(c.arguments))
            )
            for c in turn.tool_calls
        ]
        message = vf.types.ResponseMessage(
            content=turn.content,
            tool_calls=calls or None,
            finish_reason="tool_calls" if calls else "stop",
            is_truncated=False,
        )
        return vf.types.Response(id="r", created=0, model="m", message=message)


def own_rollout(env: Any, row: dict[str, Any], turns: list[Message]) -> dict[str, Any]:
    """verifiers' own rollout and scoring of `turns` for dataset row `row`."""
    out = asyncio.run(env.run_rollout(row, ScriptedClient(turns), "m", {}))
    return dict(out)


def play(env: VerifiersEnvironment, record: Any, turns: list[Message]) -> tuple[list[Message], float | None]:
    """april's side: reset, then a step per turn, the state crossing as JSON text to a fresh instance
    each step (as it does to another worker). Returns the observations and the reward."""
    step = env.reset(record)
    seen = list(step.observation)
    for turn in turns:
        verifiers_adapter.load.cache_clear()
        step = VerifiersEnvironment(env.spec, env.args).step(step.state, turn)
        seen += step.observation
        if step.done:
            return seen, step.reward
    return seen, None


def call(i: int, a: int, b: int) -> ToolCall:
    return ToolCall(f"call_{i}", "add", {"a": a, "b": b})


@pytest.mark.parametrize(
    ("turns", "reward"),
    [
        ([Message(Role.ASSISTANT, "", (call(0, 2, 5),)), Message(Role.ASSISTANT, "It is 7.")], 1.0),
        ([Message(Role.ASSISTANT, "", (call(0, 2, 5), call(1, 1, 1))), Message(Role.ASSISTANT, "6")], 0.0),
        ([Message(Role.ASSISTANT, "", (ToolCall("c", "nope", {}),)), Message(Role.ASSISTANT, "7")], 1.0),
        ([Message(Role.ASSISTANT, "", (ToolCall("c", "add", {}, error="bad JSON"),))] * 4, 0.0),  # max_turns
    ],
)
def test_a_tool_env_plays_as_its_own_rollout(turns: list[Message], reward: float) -> None:
    source = VerifiersPromptSource(TOOL_ENV, "")
    record = source.get(2)  # "What is 2 + 5?"
    env = VerifiersEnvironment(TOOL_ENV, "")
    assert [t.name for t in env.tools] == ["add"] and not env.tools[0].repeatable
    seen, got = play(env, record, turns)
    own = own_rollout(verifiers_tool_env.load_environment(), json.loads(record.metadata[INPUT_KEY]), turns)
    assert got == own["reward"] == reward
    tool_messages = [m["content"] for m in own["completion"] if m["role"] == "tool"]
    assert [m.content for m in seen if m.role is Role.TOOL] == tool_messages
    assert [m.content for m in seen[:2]] == ["Use add.", "What is 2 + 5?"]  # the prompt, system prompt first


def test_a_single_turn_env_ends_after_one_turn() -> None:
    args = '{"single_turn": true}'
    record = VerifiersPromptSource(TOOL_ENV, args).get(1)
    env = VerifiersEnvironment(TOOL_ENV, args)
    assert env.tools == ()
    for text, reward in (("5", 1.0), ("4", 0.0)):
        turn = Message(Role.ASSISTANT, text)
        _, got = play(env, record, [turn])
        own = own_rollout(
            verifiers_tool_env.load_environment(single_turn=True),
            json.loads(record.metadata[INPUT_KEY]),
            [turn],
        )
        assert got == own["reward"] == reward


def test_a_prompt_from_another_dataset_is_the_rollout_input() -> None:
    import numpy as np

    from april.data import PromptRecord

    record = PromptRecord(5, np.zeros(0, dtype=np.int32), "What is 1 + 2?", {"answer": "3"})
    env = VerifiersEnvironment(TOOL_ENV, "")
    _, got = play(env, record, [Message(Role.ASSISTANT, "3")])
    assert got == 1.0


def test_a_live_object_in_the_state_stays_in_its_process_and_plays_as_its_own_rollout() -> None:
    """The state holds a game object: it stays in the environment's process under a handle, only that
    process can step it, and the reward is verifiers' own for the transcript; an ended episode's state
    is freed, and so is one released."""
    spec, args = "verifiers:verifiers_envs", '{"live": true}'
    source = VerifiersPromptSource(spec, args)
    env = VerifiersEnvironment(spec, args)
    step = env.reset(source.get(3))
    handle = live_handle(step.state)
    assert handle is not None and list(env.live) == [handle]
    turns = [Message(Role.ASSISTANT, t) for t in ("one", "three words here", "and the last")]
    verifiers_adapter.load.cache_clear()
    with pytest.raises(EpisodeError, match="this process keeps no such live state"):
        VerifiersEnvironment(spec, args).step(step.state, turns[0])  # another process: not there
    for turn in turns:
        step = env.step(step.state, turn)
        assert step.done or live_handle(step.state) == handle  # the same handle all along
    assert step.done and not env.live  # freed with the episode
    own = own_rollout(
        verifiers_envs.load_environment(live=True), json.loads(source.get(3).metadata[INPUT_KEY]), turns
    )
    plain = own_rollout(
        verifiers_envs.load_environment(), json.loads(source.get(3).metadata[INPUT_KEY]), turns
    )
    assert step.reward == pytest.approx(own["reward"]) != pytest.approx(plain["reward"])  # the game counted
    env.release(env.reset(source.get(4)).state)
    assert not env.live


def test_the_tool_runner_steps_a_live_state_in_the_process_that_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two environment processes: every step of a live state runs in the one that answered its reset; an
    abort never kills that process; a state whose process died fails its step with one line."""
    from actors.tool_runner import ToolRunner, ToolRunnerSettings
    from april.episode import ResetRequest, StepKey, StepRequest

    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH")))))
    spec, args = "verifiers:verifiers_envs", '{"live": true}'
    source = VerifiersPromptSource(spec, args)

    def answers(runner: ToolRunner, keys: set[int]) -> dict[int, Any]:
        got: dict[int, Any] = {}
        for _ in range(600):
            got |= {r.key: r for r in runner.poll(wait_s=0.1)}
            if set(got) == keys:
                return got
        raise AssertionError(f"no answer for {keys - set(got)}")

    def step(key: int, state: str, turn: int) -> StepRequest:
        return StepRequest(state, Message(Role.ASSISTANT, f"turn {turn}"), StepKey(key, 0, turn))

    with ToolRunner(spec, ToolRunnerSettings(processes=2), args) as runner:
        for _ in range(600):  # both processes up (loading verifiers takes a while)
            runner.poll()
            if all(slot is not None and slot.ready for slot in runner._slots):
                break
            time.sleep(0.1)
        for key in (0, 1, 2, 3):  # at once: both processes answer some
            runner.submit(key, ResetRequest(source.get(key)))
        states = {k: r.step.state for k, r in answers(runner, {0, 1, 2, 3}).items()}
        assert runner.live_states == 4
        homes = {key: runner._homes[str(live_handle(s))] for key, s in states.items()}
        assert len(set(map(id, homes.values()))) == 2, "both processes should keep a state"
        for turn in range(2):  # every step finds its state: none is "not kept here"
            for key, state in states.items():
                runner.submit(10 + key, step(key, state, turn))
            results = answers(runner, {10, 11, 12, 13})
            assert all(r.ok for r in results.values()), [r.error for r in results.values()]
            states = {k - 10: r.step.state for k, r in results.items()}
        runner.submit(20, step(0, states[0], 2))
        assert runner.cancel(20) is False  # its process keeps live states: waited for, never killed
        assert answers(runner, {20})[20].step.done
        runner.release(states[1])
        assert runner.live_states == 2
        doomed = homes[2]
        os.kill(doomed.proc.pid, signal.SIGKILL)  # the process that keeps state 2 dies
        doomed.proc.wait(timeout=60)
        for _ in range(600):  # the runner reads its end
            runner.poll()
            if str(live_handle(states[2])) not in runner._homes:
                break
            time.sleep(0.1)
        runner.submit(30, step(2, states[2], 2))
        result = answers(runner, {30})[30]
        assert not result.ok and "environment state lost" in result.error and "\n" not in result.error
        assert runner.live_states == sum(1 for k in (2, 3) if homes[k] is not doomed)


@pytest.mark.parametrize(
    ("spec", "args", "expected"),
    [
        ("verifiers:no_such_module", "", "importing 'no_such_module' failed: ModuleNotFoundError"),
        ("verifiers:json", "", "module 'json' has no load_environment()"),
        (TOOL_ENV, "[1]", "env.args = '[1]': expected a JSON object"),
        (TOOL_ENV, '{"nope": 1, "n": "x"}', "load_environment raised TypeError"),
    ],
)
def test_bad_specs_are_one_line(spec: str, args: str, expected: str) -> None:
    with pytest.raises(EpisodeError) as info:
        VerifiersEnvironment(spec, args)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    verifiers_adapter.load.cache_clear()
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(EpisodeError, match=r"install it: pip install 'april-rl\[verifiers\]'"):
        VerifiersEnvironment(TOOL_ENV, "")


def model_turns(row: dict[str, Any], chat: Any) -> list[Message]:
    """A recorded episode's model turns, parsed as the worker parsed them: the response split at its
    observations (an empty turn between two adjacent observations included)."""
    turns: list[list[int]] = [[]]
    for piece in row["pieces"]:
        if piece["kind"] == OBSERVATION:
            turns.append([])
        else:
            turns[-1] += row["response_ids"][piece["start"] : piece["end"]]
    return [chat.parse_turn(chat.turn_text(ids)) for ids in turns]


def vf_run_config(tmp_path: Path, args: str, module: str = "verifiers_envs") -> tuple[Path, dict[str, str]]:
    """An april run of `verifiers:MODULE` (its `load_environment` arguments `args`): sim engines
    on two workers, the tiny model's tokenizer; and the environment its processes need (tests/ on the
    path)."""
    from april.hf import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    cfg = tmp_path / "vf.toml"
    cfg.write_text(
        '[run]\nmode = "april"\n'
        "[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 8\nn_samples_per_prompt = 4\n"
        f"max_new_tokens = 256\n[env]\nname = \"verifiers:{module}\"\nargs = '{args}'\n"
        "max_turns = 8\nmax_turn_tokens = 8\ntool_processes = 1\n"
        f'[worker]\nengine = "sim"\nslots = 4\nmodel = "{model}"\n'
        # responses (observations included) longer than a whole episode: every turn has 8 tokens
        'sim_lengths = "lognormal:median=120,sigma=0.2,cap=160"\nsim_time_scale = 1.0\nsim_decode_ms = 15.0\n'
        f'[learner]\nmodel = "{model}"\nbackend = "sim"\nsim_step_s = 0.2\n'
    )
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH"))))}
    return cfg, env


def trained_rows(run_dir: Path, steps: int, live: bool) -> list[dict[str, Any]]:
    """The run's trained episodes, each checked against verifiers' own rollout of its transcript: finished
    by the environment after `TURNS` turns, with the reward verifiers' rubric gives."""
    rows = [
        r
        for f in sorted((run_dir / "rollouts" / "train").glob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    assert len(rows) == steps * 8
    assert any(r["aborts"] > 0 and r["turns"] > 1 for r in rows), "no episode was aborted mid-episode"
    chat = chat_format(HFTokenizer(str(run_dir.parent / "tiny")).tok)
    reference = verifiers_envs.load_environment(n=40, live=live)
    for row in rows:
        assert row["finish_reason"] == "stop" and row["status"] == "finished", (
            row["finish_reason"],
            row["error"],
        )
        turns = model_turns(row, chat)
        assert len(turns) == verifiers_envs.TURNS
        own = own_rollout(reference, json.loads(json.loads(row["metadata"])[INPUT_KEY]), turns)
        assert row["reward"] == pytest.approx(own["reward"]), turns
    return rows


def test_april_up_trains_verifiers_episodes_through_aborts(tmp_path: Path) -> None:
    cfg, env = vf_run_config(tmp_path, '{"n": 40}')
    run_dir = tmp_path / "run"
    code, out, children = run_up(["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "3"], 300, env)
    assert code == 0, out
    assert "env verifiers:verifiers_envs: a state written down in full travels as JSON" in out  # dashboard's
    check_run(run_dir, 3, samples=8)  # the books balance at every step
    rows = trained_rows(run_dir, 3, live=False)
    moved = [r for r in rows if len({p["worker"] for p in r["pieces"] if p["worker"]}) > 1]
    assert all(r["aborts"] for r in moved)  # (plain states may resume on either worker)
    assert not wait_all_exited(children)


def test_april_up_keeps_live_object_episodes_with_their_worker(tmp_path: Path) -> None:
    """A state holding a game object: every episode stays with the worker that started it across APRIL's
    aborts (the two workers both train some), scores as verifiers scores its transcript, and nothing
    is restarted while no worker dies."""
    cfg, env = vf_run_config(tmp_path, '{"n": 40, "live": true}')
    run_dir = tmp_path / "run"
    code, out, children = run_up(["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "3"], 300, env)
    assert code == 0, out
    assert "a state holding live objects stays with its worker" in out
    check_run(run_dir, 3, samples=8)
    rows = trained_rows(run_dir, 3, live=True)
    workers = [{p["worker"] for p in r["pieces"] if p["worker"]} for r in rows]
    assert all(len(w) == 1 for w in workers), workers  # each episode on one worker from start to end
    assert len(set().union(*workers)) == 2  # both workers played episodes
    resumed = [r for r in rows if r["aborts"] > 0 and r["turns"] > 1]
    assert resumed, "no live episode was aborted mid-episode and resumed"
    # (the workers leaving at the end restart what is pinned to them then: the totals of the last step)
    totals = json.loads((run_dir / "broker_totals.json").read_text())["at_last_step"]
    assert totals["restarted"] == 0 and totals["resumed"] > 0, totals
    assert not wait_all_exited(children)


def test_a_killed_worker_s_live_episodes_restart_from_their_prompt(tmp_path: Path) -> None:
    """One worker is killed mid-run (`april up` starts it again under its id): the episodes whose live
    state it held restart from their prompt, counted; the run finishes, the books balance at every step,
    and every trained episode still scores as verifiers scores it."""
    cfg, env = vf_run_config(tmp_path, '{"n": 40, "live": true}')
    run_dir = tmp_path / "run"
    up_and_kill_a_worker(cfg, run_dir, steps=5, after_steps=1, env=env)
    check_run(run_dir, 5, samples=8)  # balanced at every step, with the restarts
    totals = json.loads((run_dir / "broker_totals.json").read_text())["at_last_step"]
    assert totals["restarted"] > 0 and totals["tokens_restarted"] > 0, totals
    assert "pinned partials restarted from their prompt" in (run_dir / "logs" / "broker-0.log").read_text()
    trained_rows(run_dir, 5, live=True)
