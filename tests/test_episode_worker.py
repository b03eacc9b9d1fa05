"""Real `april worker` processes driving episodes (actors/episode_driver.py) against a real broker over
ZeroMQ and the scripted learner: calculator episodes through APRIL's aborts, a worker killed with SIGKILL
while its tool calls run, a broker killed mid-episode, and a worker whose engine fails (nothing lost,
nothing trained twice: every trained episode is whole and scored by the environment from exactly its own
turns). The sim engine (the scripted one for engine failures, the fake SGLang server for SGLang) generates
the turns; the tiny model's tokenizer renders the conversation."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from episode_envs import TURNS
from harness import Cluster, wait_for

from actors.tokenizer import HFTokenizer
from april.chat import chat_format
from april.config import BrokerConfig
from april.episode import EpisodeState

TINY = str(Path(__file__).resolve().parent.parent / "models" / "tiny")
WORKER = {"model": TINY, "sim_lengths": "lognormal:median=6,sigma=0.5,cap=12"}
# the kill tests: async, steps of 0.3 s (SlowCountingEnv); ~20 tokens a sample, 8 a turn, so most turns
# have tokens of their own
SLOW_EPISODES: dict[str, Any] = {
    "run": {"mode": "async"},
    "algo": {
        "max_new_tokens": 400,
        "max_staleness": 4,
        "rollout_batch_size": 2,
        "over_sampling_batch_size": 4,
    },
    "env": {"name": "episode_envs:SlowCountingEnv", "max_turns": 8, "max_turn_tokens": 8},
}
SLOW_WORKER = {**WORKER, "slots": 4, "sim_lengths": "lognormal:median=20,sigma=0.3,cap=40"}


@pytest.fixture
def env_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/ on the PYTHONPATH of the processes a test starts: its workers import the env from there."""
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH")))))


def trained(c: Cluster) -> list[dict[str, Any]]:
    """Every trained sample of the learner's batches: its tokens, spans, reward and episode state."""
    out = []
    for b in c.batches():
        assert b["ok"]
        for i, key in enumerate(b["keys"]):
            out.append(
                {
                    "key": tuple(key),
                    "response": b["responses"][i],
                    "segments": b["segments"][i],
                    "observations": b["observations"][i],
                    "reward": b["rewards"][i],
                    "resumes": b["resumes"][i],
                    "episode": EpisodeState.from_bytes(b["episodes"][i].encode()),
                }
            )
    return out


def assert_tiled(s: dict[str, Any]) -> None:
    spans = sorted([(a, b) for _, a, b in s["segments"]] + [tuple(o) for o in s["observations"]])
    pos = 0
    for a, b in spans:
        assert a == pos and b > a
        pos = b
    assert pos == len(s["response"])


def test_calculator_episodes_train_through_aborts(cluster: Callable[..., Cluster]) -> None:
    c = cluster(
        run={"mode": "april"},
        algo={"max_new_tokens": 96},
        data={"source": "calculator"},
        env={"name": "calculator", "max_turns": 4, "max_turn_tokens": 64},
        # turns of ~0.5 s: the over-sampled groups are still generating when a batch completes
        worker={**WORKER, "sim_lengths": "lognormal:median=30,sigma=0.5,cap=60", "sim_time_scale": 1.0},
    )
    c.start_broker()
    c.start_worker("w0")
    c.start_worker("w1")
    c.start_learner(steps=3, train_s=0.05)
    assert c.wait_exit("learner", 120) == 0
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 12  # groups
    assert status.totals.aborted > 0 and status.totals.resumed > 0
    samples = trained(c)
    assert len({s["key"] for s in samples}) == len(samples) == 24
    for s in samples:
        assert_tiled(s)
        assert s["reward"] in (0.0, 1.0) and s["episode"].owed is None and s["episode"].turns >= 1


def assert_whole(s: dict[str, Any], tokenizer: HFTokenizer) -> list[int]:
    """A trained CountingEnv episode is whole: its spans tile the response, every turn was stepped once
    (a turn the sim engine ends at once leaves two observations adjacent, one span), each turn the
    environment stepped is one in the transcript, in order, none lost or repeated, nothing is owed, and
    the reward recomputes from exactly its turns. Returns its turns' lengths."""
    assert_tiled(s)
    state = json.loads(s["episode"].env_state)
    assert s["episode"].turns == state["k"] == TURNS and s["episode"].owed is None
    lengths = turn_lengths(s, tokenizer)
    assert [n for n in state["lens"] if n] == [n for n in lengths if n]
    assert np.isclose(s["reward"], (sum(lengths) % 10) / 10 + 0.05)
    return lengths


def turn_lengths(s: dict[str, Any], tokenizer: HFTokenizer) -> list[int]:
    """The content length of each model turn of a trained sample (its tokens between observations)."""
    chat = chat_format(tokenizer.tok)
    bounds = [0, *(x for o in s["observations"] for x in o), len(s["response"])]
    turns = [s["response"][a:b] for a, b in zip(bounds[::2], bounds[1::2], strict=True)]
    return [len(chat.parse_turn(chat.turn_text(t)).content) for t in turns]


def assert_trained_once_and_whole(c: Cluster, samples: int) -> None:
    """`samples` trained, each once, some of them resumed, and every one a whole episode with turns of
    its own."""
    tokenizer = HFTokenizer(TINY)
    got = trained(c)
    assert len({s["key"] for s in got}) == len(got) == samples
    assert any(s["resumes"] for s in got)
    for s in got:
        assert any(assert_whole(s, tokenizer))


def test_worker_killed_mid_tool_call_loses_nothing_and_replays_steps_under_their_keys(
    cluster: Callable[..., Cluster], env_on_path: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL a worker while its tool steps run: its leases go back as they were leased and another
    worker plays them on, so every group is trained once and every trained episode is whole. What the
    dead worker had not returned runs again: at least once, and under the same StepKey. EffectEnv's
    side-effect log shows it: only steps the victim ran run twice, each at most twice (its run, then the
    replay), and the keys run are exactly the steps of the episodes played (an environment that applies
    each key's effect once would have applied every effect once)."""
    log = tmp_path / "effects"
    monkeypatch.setenv("APRIL_TEST_EFFECTS", str(log))
    c = cluster(
        **{**SLOW_EPISODES, "env": {**SLOW_EPISODES["env"], "name": "episode_envs:SlowEffectEnv"}},
        worker=SLOW_WORKER,
    )
    c.start_broker()
    victim = c.start_worker("victim")
    # turns take milliseconds, steps 0.3 s: a worker holding episodes is almost always in their steps
    wait_for(lambda: any(w.leases for w in c.status().workers), 60, "the victim to hold leases")
    time.sleep(1.0)  # some episodes are past their first step: their progress is lost with the worker
    held = {w.id: w.leases for w in c.status().workers}["victim"]
    victim_pid = c.procs["victim"].pid
    c.kill("victim")  # SIGKILL: its tool-runner children die with it
    c.start_worker("w2")
    c.start_learner(steps=4, train_s=0.05)  # async aborts at each version: later batches hold resumes
    assert c.wait_exit("learner", 120) == 0
    status = c.status()
    assert held > 0 and status.ledger_balanced and status.ledger.trained == 8  # groups
    assert "worker victim silent for" in (c.tmp / "broker.log").read_text(), victim.read_text()[-2000:]
    assert_trained_once_and_whole(c, 16)
    runs = effects(log)
    by_key: dict[str, list[int]] = {}
    for key, pid in runs:
        by_key.setdefault(key, []).append(pid)
    again = {key: pids for key, pids in by_key.items() if len(pids) > 1}
    assert again, "no step of the victim ran again (the kill caught none in flight)"
    assert all(len(pids) == 2 and pids[0] == victim_pid != pids[1] for pids in again.values()), again
    for s in trained(c):  # every trained episode's steps ran, under their keys
        g, i = s["key"]
        assert {f"{g}-{i}-{t}" for t in range(TURNS)} <= set(by_key)
    assert all(int(key.split("-")[2]) < TURNS for key in by_key)


def test_a_worker_whose_engine_fails_mid_episode_loses_nothing(
    cluster: Callable[..., Cluster], env_on_path: None
) -> None:
    """As for single-turn samples (tests/test_engine_failures.py), with episodes: the scripted engine goes
    down mid-turn (its probe fails once), again in the first abort, and fails one request in four half-way
    (a partial). The engine's episodes come back as partials with their transcripts and states, those
    between turns go back when their next turn meets the down engine, steps already running finish, the
    same worker process serves again, and every trained episode is whole."""
    c = cluster(**SLOW_EPISODES, worker=SLOW_WORKER)
    c.start_broker()
    # 20-40 tokens a sample in turns of at most 8: every turn has tokens of its own
    log = c.start_scripted_worker(
        "w0",
        length_min=20,
        length_max=40,
        down_at_steps=[12],
        probe_failures=1,
        down_on_abort=1,
        transient_every=4,
    )
    c.start_learner(steps=4, train_s=0.05)
    assert c.wait_exit("learner", 180) == 0, log.read_text()[-3000:]
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 8  # groups
    (w0,) = status.workers
    assert w0.returned_by_engine >= 1 and w0.engine_ok
    text = log.read_text()
    assert text.count("engine down (") >= 2 and text.count("engine serves again") >= 2  # a step, an abort
    assert "Traceback" not in text and c.procs["w0"].poll() is None  # one worker process throughout
    assert_trained_once_and_whole(c, 16)


def effects(path: Path) -> list[tuple[str, int]]:
    """EffectEnv's side-effect log: (step key, pid of the worker whose tool process ran it) per run, in
    the order they ran (whole lines: a step may be writing one)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]
    return [(key, int(pid)) for key, pid in (line.split() for line in lines if line)]


def durable_steps(c: Cluster) -> set[str]:
    """The steps of every episode in the books a restart restores from the broker's files now (its last
    state file and the journal after it): the broker acknowledged no result that is not among them.
    benchmarks/soak.py counts them the same way, with the same function."""
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    steps: set[str] = importlib.import_module("soak").durable_steps(c.run_dir, c.config_path)
    return steps


def test_broker_killed_twice_mid_episode_reruns_no_step_it_had(
    cluster: Callable[..., Cluster], env_on_path: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the default snapshot interval, SIGKILL the broker twice while episodes are partial in its buffer
    and restart it with --resume: the partials come back from its state file and the journal after it
    (their transcripts and episode states), the workers send again what was not acknowledged, the
    counters run on, every group is trained once and every trained episode is whole. EffectEnv's
    side-effect log counts each step's runs: no step of the books the broker restores (which hold every
    result it acknowledged) runs again after its kill. (A lease granted in the last milliseconds before a
    kill, its journal not yet on disk, may be leased again before its worker's result comes back: the
    steps made under it run again, with their keys; they were never acknowledged.)"""
    log = tmp_path / "effects"
    monkeypatch.setenv("APRIL_TEST_EFFECTS", str(log))
    c = cluster(
        **{**SLOW_EPISODES, "env": {**SLOW_EPISODES["env"], "name": "episode_envs:SlowEffectEnv"}},
        worker=SLOW_WORKER,
        broker={"snapshot_interval_s": BrokerConfig().snapshot_interval_s},  # the default, as users run
    )
    c.start_broker()
    c.start_worker("w0")
    c.start_worker("w1")
    steps = 20
    c.start_learner(steps=steps, train_s=0.3)

    def partials_with_progress() -> bool:
        assert c.procs["learner"].poll() is None, "the run ended before the broker was killed"
        s = c.status()
        return s.ledger.partial > 0 and s.totals.resumed + s.totals.aborted > 0

    # In async, partials are leased again as soon as a worker has a free slot, so the buffer may be empty
    # by the time of a kill: the broker is killed while it holds partials, twice, and (at most 5 times in
    # all) until a restart has restored some.
    kills, restored = 0, 0
    durable: list[tuple[set[str], int]] = []  # at each kill: the steps the broker's files held, steps run
    while kills < 2 or (restored == 0 and kills < 5):
        wait_for(partials_with_progress, 120, "episode partials in the broker's buffer")
        before = c.status()
        c.kill("broker")
        kills += 1
        durable.append((durable_steps(c), len(effects(log))))
        c.start_broker(resume=True)
        after = c.status()
        assert after.epoch == before.epoch + 1 and after.ledger_balanced, after.ledger
        assert after.round.id >= before.round.id - 1  # abort rounds go on (the last may not be durable)
        # the run's counters, not this process' (the kill may come before any partial was resumed)
        assert after.totals.aborted + after.totals.resumed > 0, after.totals
        restored += after.ledger.partial
    assert restored > 0  # episodes restored unfinished, with their transcripts and states
    assert c.wait_exit("learner", 240) == 0, (c.tmp / "broker.log").read_text()[-3000:]
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == steps * 2  # groups
    tokenizer = HFTokenizer(TINY)
    by_batch = {b["batch"]: b for b in c.batches()}  # a batch sent again after a restart counts once
    assert len(by_batch) == steps
    firsts = {s["key"]: s for s in trained(c)}
    assert len(firsts) == steps * 2 * c.config["algo"]["n_samples_per_prompt"]
    assert any(s["resumes"] for s in firsts.values())
    for s in firsts.values():
        assert_whole(s, tokenizer)
    order = [key for key, _ in effects(log)]
    rerun = {key for held, ran in durable for key in order[ran:] if key in held}
    assert rerun == set(), f"steps the broker had on disk ran again after its kill: {rerun}"
    assert all(held <= set(order) for held, _ in durable) and any(held for held, _ in durable)


def test_sglang_worker_runs_episodes_one_request_a_turn(
    cluster: Callable[..., Cluster], env_on_path: None
) -> None:
    """A real worker drives episodes through the SGLang adapter against the fake server rebuilt from
    SGLang's source: each turn is one /generate request of the whole context so far (prompt, earlier
    turns, observations), and every episode trains whole through APRIL's aborts."""
    from sglang_runtime import ToyModel
    from sglang_server import FakeSGLangServer

    toy = ToyModel(vocab_size=259, eos_token_id=2, eos_per_mille=30)  # the tiny tokenizer's ids
    with FakeSGLangServer(max_running_requests=4, model=toy, token_delay_s=0.01) as server:
        c = cluster(
            run={"mode": "april"},
            algo={"max_new_tokens": 200},
            env={"name": "episode_envs:CountingEnv", "max_turns": 8, "max_turn_tokens": 16},
            worker={"engine": "sglang", "sglang_urls": server.url, "slots": 4, "model": TINY},
        )
        c.start_broker()
        c.start_worker("sw0")
        c.start_learner(steps=2, train_s=0.05)
        assert c.wait_exit("learner", 120) == 0, (c.tmp / "sw0.log").read_text()[-3000:]
        inputs = [len(b["input_ids"]) for b in server.rt.generate_bodies]
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 2 * c.config["algo"]["rollout_batch_size"]
    tokenizer = HFTokenizer(TINY)
    samples = trained(c)
    assert len({s["key"] for s in samples}) == len(samples)
    for s in samples:
        assert_whole(s, tokenizer)
        assert len(s["observations"]) == TURNS - 1
    # one request a turn: at least a request per turn of every trained episode, later ones longer
    assert len(inputs) >= TURNS * len(samples) and max(inputs) > min(inputs)
