"""The episode driver (actors/episode_driver.py) with each engine (the torch engine and vLLM on models/tiny,
the SGLang adapter against the fake server) and a real tool
runner running the scripted environments of tests/episode_envs.py: turns and observations tile the
response, observations are masked, the environment's reward is the score; an abort mid-turn, mid-step
(repeatable: killed and owed; not repeatable: waited for) and a resume give exactly the transcript of an
uninterrupted run (greedy decoding).

`Loop` does for the driver what actors/worker.py does around it (engine add/step/abort, the order of
slots), so that the driver is tested with the real engine and runner without a broker."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from episode_envs import HANG_TOOL_S, TURNS

from actors.engine import Engine, GenerationOutput, GenerationRequest, SamplingParams
from actors.episode_driver import EpisodeDriver, open_episode_driver
from actors.tokenizer import HFTokenizer
from actors.tool_runner import ToolRunnerSettings
from actors.worker import apply_output, interrupted
from april.chat import chat_format
from april.config import ConfigError, EnvConfig
from april.episode import EpisodeState, Message, Role, ToolCall
from april.records import FinishReason, Sample, SampleStatus
from april.worker_core import Decision, Phase, Settle, StartTurn

torch = pytest.importorskip("torch")
from actors.engines.torch_engine import TorchEngine  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
MAX_NEW = 200
ENV = EnvConfig(name="episode_envs:CountingEnv", max_turns=8, max_turn_tokens=12)


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizer:
    return HFTokenizer(TINY)


@pytest.fixture(scope="module", params=["torch", "sglang", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request: pytest.FixtureRequest, tokenizer: HFTokenizer) -> Iterator[Engine]:
    """Each engine, greedy, two slots: the torch engine and vLLM on models/tiny; the SGLang adapter on the
    fake server rebuilt from SGLang's source (a deterministic toy model over the tiny vocabulary, so a
    resumed request continues exactly where an uninterrupted one would have gone; it never stops by
    itself, so every turn of it is cut by `max_turn_tokens`)."""
    sampling = SamplingParams(temperature=1.0, stop_token_ids=tokenizer.eos_token_ids, seed=0)
    if request.param == "torch":
        yield TorchEngine(TINY, 2, sampling, device="cpu", dtype="float32", greedy=True, cuda_graphs=False)
    elif request.param == "sglang":
        from sglang_runtime import ToyModel
        from sglang_server import FakeSGLangServer

        from actors.engines.sglang_engine import SGLangEngine

        toy = ToyModel(vocab_size=len(tokenizer.tok), eos_token_id=tokenizer.eos_token_ids[0])
        # a token every 20 ms: a test's few ticks land mid-turn, as they do on the torch engine
        with FakeSGLangServer(max_running_requests=2, model=toy, token_delay_s=0.02) as server:
            sglang = SGLangEngine([server.url], slots=2, sampling=sampling, control_timeout_s=10.0)
            yield sglang
            sglang.close()
    else:
        pytest.importorskip("vllm")
        from actors.engines.vllm_engine import VLLMEngine, VLLMSettings

        vllm = VLLMEngine(
            TINY, slots=2, sampling=sampling, greedy=True, settings=VLLMSettings(max_model_len=1024)
        )
        yield vllm
        vllm.close()


@pytest.fixture
def make_driver(tokenizer: HFTokenizer) -> Iterator[object]:
    made: list[EpisodeDriver] = []

    def make(env: EnvConfig = ENV) -> EpisodeDriver:
        driver = open_episode_driver(env, tokenizer, 2, ToolRunnerSettings(processes=1))
        assert driver is not None
        made.append(driver)
        return driver

    yield make
    for d in made:
        d.close()


class Loop:
    """The worker's part: leases in, answered episodes' turns into free slots, turns out to the driver,
    settled samples collected; `abort` returns what the engine and the driver hold."""

    def __init__(self, driver: EpisodeDriver, engine: Engine) -> None:
        self.driver, self.engine = driver, engine
        self.held: dict[int, Sample] = {}
        self.out: dict[int, Sample] = {}

    def lease(self, lease_id: int, sample: Sample) -> None:
        self.carry_out(self.driver.lease(lease_id, MAX_NEW - sample.response_len, True, sample))

    def carry_out(self, decisions: Sequence[Decision]) -> None:
        for d in self.driver.run_steps(list(decisions)):
            if isinstance(d, StartTurn):
                self.held[d.lease_id] = d.sample
                self.engine.add([GenerationRequest(d.lease_id, d.sample.resume_input(), d.budget, d.greedy)])
            elif isinstance(d, Settle):
                self.out[d.lease_id] = d.sample
                self.driver.forget([(d.lease_id, d.sample)])

    def tick(self) -> None:
        self.drive()
        self.generate()

    def drive(self) -> None:
        """The steps that answered, then the free slots filled."""
        self.carry_out(self.driver.poll())
        self.carry_out(self.driver.core.fill())

    def generate(self) -> None:
        """One engine step (a token on the torch engine; up to the engine's poll time on vLLM)."""
        if self.engine.active:
            for o in self.engine.step():
                self.turn_ended(self.held.pop(o.request_id), o)
        elif self.driver.busy:
            time.sleep(0.01)

    def turn_ended(self, sample: Sample, o: GenerationOutput) -> None:
        turn = apply_output(sample, dataclasses.replace(o, finish_reason=FinishReason.NONE))
        self.carry_out(self.driver.core.turn_ended(o.request_id, turn, o.finish_reason))

    def run(self, until: object = None, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.driver.core.held or self.held:
            if callable(until) and until():
                return
            assert time.monotonic() < deadline, "episodes did not settle"
            self.drive()
            if callable(until) and until():  # before the engine steps: a turn just started has no token
                return
            self.generate()

    def abort(self) -> list[int]:
        """Every unfinished episode back (self.out); returns the leases waited for."""
        for o in self.engine.abort():
            sample = self.held.pop(o.request_id)
            if o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):  # it ended before the abort
                self.turn_ended(sample, o)
            else:
                self.out[o.request_id] = interrupted(sample, o)
                self.driver.core.forget(o.request_id)
                self.driver.forget([(o.request_id, self.out[o.request_id])])
        back, waited = self.driver.abort()
        self.carry_out(back)
        return waited


def fresh(index: int) -> Sample:
    empty = np.zeros(0, dtype=np.int32)
    return Sample(
        group_id=index,
        index=0,
        prompt_ids=empty,
        prompt_text=f"item {index}",
        metadata={"prompt_index": str(index)},
    ).resumed()


def play(driver: EpisodeDriver, engine: Engine, samples: dict[int, Sample]) -> dict[int, Sample]:
    loop = Loop(driver, engine)
    for lease_id, s in samples.items():
        loop.lease(lease_id, s)
    loop.run()
    return loop.out


def assert_same_transcript(got: Sample, want: Sample) -> None:
    assert got.status == want.status == SampleStatus.FINISHED
    np.testing.assert_array_equal(got.prompt_ids, want.prompt_ids)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    assert got.observations == want.observations
    assert [(s.start, s.end) for s in got.segments] == [(s.start, s.end) for s in want.segments]
    assert got.reward == want.reward and got.finish_reason == want.finish_reason
    assert got.episode == want.episode


def test_the_env_section_sizes_the_tool_runner(tokenizer: HFTokenizer) -> None:
    driver = open_episode_driver(dataclasses.replace(ENV, tool_processes=3, step_timeout_s=2.5), tokenizer, 2)
    assert driver is not None
    try:
        assert driver.runner.settings == ToolRunnerSettings(processes=3, step_timeout_s=2.5)
    finally:
        driver.close()
    with pytest.raises(ConfigError, match=r"env\.tool_processes"):
        dataclasses.replace(ENV, tool_processes=0)


def test_episodes_tile_the_response_and_score_the_env_reward(make_driver, engine, tokenizer) -> None:
    driver = make_driver()
    out = play(driver, engine, {1: fresh(1), 2: fresh(2), 3: fresh(3)})
    assert set(out) == {1, 2, 3}
    for s in out.values():
        s.check()  # segments and observations tile the response
        assert s.status == SampleStatus.FINISHED and s.finish_reason == FinishReason.STOP
        state = EpisodeState.from_bytes(s.episode)
        assert state.turns == 3 and state.owed is None
        assert len(s.observations) == 2 and len(s.segments) == 3  # turn, obs, turn, obs, turn
        # the score is the environment's: from the lengths of the parsed turns' texts
        chat = driver.chat
        turns = [s.response_ids[seg.start : seg.end].tolist() for seg in s.segments]
        chars = sum(len(chat.parse_turn(chat.turn_text(t)).content) for t in turns)
        assert s.reward == pytest.approx((chars % 10) / 10 + 0.05)
        assert s.model_tokens == sum(seg.end - seg.start for seg in s.segments) < s.response_len
        # observations: the environment's text, as the chat format renders it, with log-prob 0
        first = s.observations[0]
        assert "obs 1:" in tokenizer.decode(s.response_ids[first.start : first.end])
        assert not s.response_logprobs[first.start : first.end].any()
        # the prompt is the reset's first observation, rendered
        assert tokenizer.decode(s.prompt_ids).startswith(f"count for item {s.group_id}")
        assert all(seg.end - seg.start <= ENV.max_turn_tokens for seg in s.segments)


def test_budget_and_max_turns_cut_an_episode_off(make_driver, engine) -> None:
    short = play(make_driver(), engine, {1: fresh(1)})
    full = short[1].response_len
    loop = Loop(make_driver(), engine)
    loop.driver.lease(1, full - 5, True, fresh(1))  # not room for the last turn
    loop.run()
    cut = loop.out[1]
    assert cut.status == SampleStatus.FINISHED and cut.finish_reason == FinishReason.LENGTH
    assert cut.reward == 0.0 and cut.response_len <= full - 5
    one_turn = play(make_driver(dataclasses.replace(ENV, max_turns=2)), engine, {1: fresh(1)})[1]
    assert one_turn.finish_reason == FinishReason.LENGTH and one_turn.reward == 0.0
    assert EpisodeState.from_bytes(one_turn.episode).turns == 2 and len(one_turn.segments) == 2


def test_a_failing_environment_fails_the_sample(make_driver, engine) -> None:
    env = dataclasses.replace(ENV, name="episode_envs:BrokenEnv")
    s = play(make_driver(env), engine, {1: fresh(1)})[1]
    assert s.status == SampleStatus.FAILED
    assert s.error == "env_error: environment step raised ValueError: the environment broke"


def test_a_tool_past_its_timeout_is_carried_by_the_sample(engine, tokenizer) -> None:
    """Found by a user: a tool past its timeout was seen by the model alone ("error: tool timed out").
    The episode goes on, and the sample carries the time-out (a tool_timeout) for the broker to count."""
    turn = Message(Role.ASSISTANT, "wait", (ToolCall("call_0", "wait", {}),))
    chat = chat_format(tokenizer.tok)
    ids = chat.turn_ids(turn)
    s = dataclasses.replace(fresh(5), prompt_ids=np.asarray(chat.prompt_ids((Message(Role.USER, "x"),))))
    s = s.extend(ids, np.full(len(ids), -0.5, np.float32), 0, FinishReason.ABORT)
    owing = s.with_episode(EpisodeState('{"k": 0, "chars": 0}', 0, turn).to_bytes())
    env = dataclasses.replace(ENV, name="episode_envs:HangingToolEnv")
    driver = open_episode_driver(env, tokenizer, 2, ToolRunnerSettings(processes=1, step_timeout_s=0.5))
    assert driver is not None
    try:
        done = play(driver, engine, {1: resume(owing)})[1]
    finally:
        driver.close()
    assert done.status == SampleStatus.FINISHED and EpisodeState.from_bytes(done.episode).turns == TURNS
    assert done.error == f"tool_timeout: tool call of wait timed out after {HANG_TOOL_S:g} s"


def resume(partial: Sample) -> Sample:
    """The partial as the broker leases it again."""
    assert partial.status == SampleStatus.INTERRUPTED and partial.finish_reason == FinishReason.ABORT
    return partial.resumed()


@pytest.mark.parametrize("turn", [0, 1])
def test_abort_mid_turn_then_resume_is_the_uninterrupted_transcript(make_driver, engine, turn) -> None:
    """The first turn is cut by max_turn_tokens (its resume must get only the turn's tokens left); the
    second follows an observation. Every try's resume must give the uninterrupted transcript, and one
    try must land mid-turn. The torch engine makes a token a tick, so three ticks land mid-turn; vLLM's
    engine generates in a process of its own, so a turn may end, or not have begun, by the abort, and
    how many tokens a wait brings depends on the machine's load. The wait before the abort is searched:
    halved after a try that came too late (the turn had ended; a step that had answered is waited for
    and applied, never dropped), doubled after one too early (not a token of the turn yet)."""
    want = play(make_driver(), engine, {1: fresh(1)})[1]
    assert want.segments[0].end == ENV.max_turn_tokens  # the first turn was cut by its budget
    ticks, wait_s, tries = 3, 0.0, []
    for _ in range(24):
        loop = Loop(make_driver(), engine)
        loop.lease(1, fresh(1))
        loop.run(until=lambda lp=loop: 1 in lp.held and len(lp.held[1].observations) == turn)
        for _ in range(ticks):  # a few tokens into the turn
            loop.tick()
        time.sleep(wait_s)
        if loop.abort():  # a step that had answered: applied once it is read
            loop.run()
        partial = loop.out.pop(1)
        if partial.status == SampleStatus.FINISHED:  # the episode ended before the abort came
            assert_same_transcript(partial, want)
            tries.append("late")
        else:
            start = partial.observations[-1].end if partial.observations else 0
            np.testing.assert_array_equal(partial.response_ids, want.response_ids[: partial.response_len])
            assert EpisodeState.from_bytes(partial.episode).turns == len(partial.observations)
            assert_same_transcript(play(make_driver(), engine, {7: resume(partial)})[7], want)
            if len(partial.observations) > turn:
                tries.append("late")
            else:
                tries.append("caught" if partial.response_len > start else "early")
        if tries[-1] == "caught":
            break
        if tries[-1] == "late":
            ticks, wait_s = 0, wait_s / 2
        else:
            wait_s = max(2 * wait_s, 0.002)
    assert tries[-1] == "caught", f"no abort landed mid-turn: {tries}"


def test_abort_mid_repeatable_step_kills_it_and_the_resume_owes_it(make_driver, engine) -> None:
    want = play(make_driver(), engine, {1: fresh(1)})[1]
    slow = dataclasses.replace(ENV, name="episode_envs:SlowCountingEnv")
    loop = Loop(make_driver(slow), engine)
    loop.lease(1, fresh(1))
    loop.run(until=lambda: 1 in loop.driver.core.held and loop.driver.core.held[1].phase is Phase.STEP)
    deadline = time.monotonic() + 60
    while not step_running(loop.driver):
        assert loop.driver.runner.poll() == [] and time.monotonic() < deadline
        time.sleep(0.01)
    assert loop.abort() == []  # killed, not waited for: the sample comes back at once, owing the step
    assert not step_running(loop.driver)
    partial = loop.out.pop(1)
    state = EpisodeState.from_bytes(partial.episode)
    assert state.owed is not None and state.turns == 0 and not partial.observations
    assert_same_transcript(play(make_driver(), engine, {7: resume(partial)})[7], want)


def step_running(driver: EpisodeDriver) -> bool:
    """Whether a child of the driver's tool runner is running a request."""
    return driver.runner.running > 0


def committed(tokenizer: HFTokenizer) -> Sample:
    """A partial the broker could hold: one model turn that calls the non-repeatable `commit` tool, its
    step owed."""
    turn = Message(Role.ASSISTANT, "done", (ToolCall("call_0", "commit", {}),))
    chat = chat_format(tokenizer.tok)
    ids = chat.turn_ids(turn)
    prompt = chat.prompt_ids((Message(Role.USER, "count for item 5"),))
    s = dataclasses.replace(fresh(5), prompt_ids=np.asarray(prompt, dtype=np.int32))
    s = s.extend(ids, np.full(len(ids), -0.5, np.float32), 0, FinishReason.ABORT)
    state = EpisodeState('{"k": 0, "chars": 0}', 0, turn)  # CountingEnv's state after its reset
    return s.with_episode(state.to_bytes())


def test_abort_mid_step_that_cannot_be_killed_waits_and_keeps_its_result(
    make_driver, engine, tokenizer
) -> None:
    leased = resume(committed(tokenizer))
    want = play(make_driver(), engine, {1: leased})[1]
    assert EpisodeState.from_bytes(want.episode).turns == 3
    slow = dataclasses.replace(ENV, name="episode_envs:SlowCountingEnv")
    loop = Loop(make_driver(slow), engine)
    loop.lease(1, leased)
    assert loop.driver.core.held[1].phase is Phase.STEP  # the owed step is submitted at once
    deadline = time.monotonic() + 60
    while not step_running(loop.driver):  # handed to a child (a queued one would just be dropped)
        assert loop.driver.runner.poll() == [] and time.monotonic() < deadline
        time.sleep(0.01)
    assert loop.abort() == [1]  # not repeatable: waited for
    assert 1 not in loop.out
    loop.run()
    partial = loop.out.pop(1)
    assert partial.status == SampleStatus.INTERRUPTED and len(partial.observations) == 1
    state = EpisodeState.from_bytes(partial.episode)
    assert state.owed is None and state.turns == 1  # the step's result is kept, not owed
    assert_same_transcript(play(make_driver(), engine, {7: resume(partial)})[7], want)


# ---------------------------------------------------------------------- exactly once across aborts


@pytest.fixture(scope="module")
def torch_engine(tokenizer: HFTokenizer) -> Engine:
    sampling = SamplingParams(temperature=1.0, stop_token_ids=tokenizer.eos_token_ids, seed=0)
    return TorchEngine(TINY, 2, sampling, device="cpu", dtype="float32", greedy=True, cuda_graphs=False)


class Effects:
    """EffectEnv's side-effect log and gates (tests/episode_envs.py), in a temporary folder."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log, self.gates = folder / "effects", folder / "gates"
        self.gates.mkdir()
        monkeypatch.setenv("APRIL_TEST_EFFECTS", str(self.log))
        monkeypatch.setenv("APRIL_TEST_GATES", str(self.gates))

    def runs(self) -> Counter[str]:
        """How many times each step key ran."""
        lines = self.log.read_text().split("\n") if self.log.exists() else []
        return Counter(line.split()[0] for line in lines if line)

    def hold(self, where: str, on: bool) -> None:
        gate = self.gates / f"hold-{where}"
        gate.touch() if on else gate.unlink(missing_ok=True)

    def at(self, where: str, key: str) -> bool:
        return (self.gates / f"at-{where}-{key}").exists()


def answered_in_pipe(driver: EpisodeDriver) -> None:
    """Wait until a request runs (handed to a child that has started) and has written its answer to its
    pipe, which nobody has read."""
    import select

    deadline = time.monotonic() + 60
    while not driver.runner.running:  # the moment lies inside the runner: hand the request over
        assert time.monotonic() < deadline, "no request started"
        driver.runner._pump()
        time.sleep(0.005)
    for slot in driver.runner._slots:
        if slot is not None and slot.job is not None:
            assert select.select([slot.child.fileno()], [], [], 60)[0], "the step did not answer"


# where the abort lands in the step of episode 1's first turn (episode 2's step queues behind it)
POINTS = ["queued", "before_effect", "after_effect", "answered", "read", "applied"]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("env_name", ["EffectEnv", "RepeatableEffectEnv"])
def test_an_abort_at_any_point_of_a_step_runs_it_once(
    make_driver, torch_engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str, env_name: str
) -> None:
    """Two episodes share one tool process; the abort lands at `point` of episode 1's first step (the
    second's step waits in the queue behind it). Each aborted episode is then resumed to its end, and
    the side-effect log counts every step key: each ran once, except a repeatable step killed after its
    effect (by declaration running it again is harmless), which may run twice, and never more."""
    fx = Effects(tmp_path, monkeypatch)
    env = dataclasses.replace(ENV, name=f"episode_envs:{env_name}")
    loop = Loop(make_driver(env), torch_engine)
    first, second = "1-0-0", "2-0-0"  # (group, index, step) of each episode's first step
    fx.hold("before", True)  # the first step to run waits before its effect; the other queues
    loop.lease(1, fresh(1))
    loop.lease(2, fresh(2))
    steps = loop.driver.core.held

    def stepping() -> bool:
        return all(i in steps and steps[i].phase is Phase.STEP for i in (1, 2))

    loop.run(until=stepping)
    wait_for(lambda: fx.at("before", first) or fx.at("before", second), "a step to start")
    if fx.at("before", second):  # the runner took episode 2's step first: the roles swap
        first, second = second, first
    if point not in ("queued", "before_effect"):
        fx.hold("after", True)
        fx.hold("before", False)
        wait_for(lambda: fx.at("after", first), "the effect")
        if point != "after_effect":
            fx.hold("before", True)  # the queued step, once it runs, waits before its effect
            fx.hold("after", False)
    if point in ("answered", "read"):
        answered_in_pipe(loop.driver)  # nobody polled the runner: the other step is still queued
    if point == "read":
        assert loop.driver.runner.cancel(-1)  # reads the answer on the way (as an abort's first cancel)
    if point == "applied":
        wait_for(lambda: any(s.phase is Phase.READY for s in steps.values()), "the step applied", loop)
    waited = loop.abort()
    fx.hold("before", False)
    fx.hold("after", False)
    loop.run()  # the steps waited for answer and settle
    back = dict(loop.out)
    assert set(back) == {1, 2}
    assert all(s.status == SampleStatus.INTERRUPTED for s in back.values()), [
        (s.status, s.error, s.response_len, EpisodeState.from_bytes(s.episode)) for s in back.values()
    ]
    finished = play(make_driver(env), torch_engine, {10 + i: resume(s) for i, s in back.items()})
    for s in finished.values():
        state = EpisodeState.from_bytes(s.episode)
        assert s.status == SampleStatus.FINISHED and state.turns == 3 and state.owed is None
    runs = fx.runs()
    keys = {f"{g}-0-{t}" for g in (1, 2) for t in range(3)}
    assert set(runs) == keys, runs
    killed_after_effect = env_name == "RepeatableEffectEnv" and point == "after_effect"
    twice = {first} if killed_after_effect else set()
    assert {k for k, n in runs.items() if n > 1} == twice, (runs, waited)
    assert max(runs.values()) <= 2


def wait_for(check: object, what: str, loop: Loop | None = None) -> None:
    """Poll `check` (ticking `loop`'s driver, if given) for up to a minute: did not hang."""
    deadline = time.monotonic() + 60
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if loop is not None:
            for settled in loop.driver.poll():
                loop.out[settled.lease_id] = settled.sample
        time.sleep(0.005)


def test_an_abort_after_a_reset_answered_keeps_it(make_driver, torch_engine) -> None:
    """A reset that answered (read by the runner, not yet applied) when an abort comes is kept: the
    episode is waited for and comes back with the prompt the reset made, and resumes to its end."""
    loop = Loop(make_driver(), torch_engine)
    loop.lease(1, fresh(1))
    assert loop.driver.core.held[1].phase is Phase.RESET
    answered_in_pipe(loop.driver)
    assert loop.driver.runner.cancel(-1)  # reads the answer (as an abort's first cancel would)
    assert loop.driver.runner.pending == 1 and loop.driver.runner.running == 0
    assert loop.abort() == []  # the answered reset is applied before the abort gives it back
    back = loop.out.pop(1)
    assert back.status == SampleStatus.INTERRUPTED and back.prompt_ids.shape[0] > 0 and back.episode
    done = play(make_driver(), torch_engine, {2: resume(back)})[2]
    assert done.status == SampleStatus.FINISHED and EpisodeState.from_bytes(done.episode).turns == 3
    # the same when the answer is read during the abort itself (between its poll and its cancel)
    loop = Loop(make_driver(), torch_engine)
    loop.lease(3, fresh(3))
    answered_in_pipe(loop.driver)
    driver = loop.driver
    driver.poll = lambda: []  # type: ignore[method-assign]  # the abort's own poll finds nothing yet
    assert loop.abort() == [3]  # the cancel read it: waited for, delivered by the next poll
    del driver.poll
    loop.run()
    back = loop.out.pop(3)
    assert back.status == SampleStatus.INTERRUPTED and back.prompt_ids.shape[0] > 0 and back.episode
