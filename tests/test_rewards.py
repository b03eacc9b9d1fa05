"""Tests for actors.rewards (built-ins, spec loading) and actors.reward_runner (the scoring child process).

Built-ins and spec validation are checked in-process. The runner is checked with real child processes and
a user reward module written to tmp_path whose behaviour is chosen by the response text: raise, hang,
crash (os._exit), print to stdout, return a bad value, or echo the answer as a float after a delay.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from actors.reward_runner import RewardResult, RewardRunner, score_now
from actors.rewards import (
    RewardError,
    check_reward_value,
    exact_reward,
    extract_final_answer,
    load_reward,
    normalise_answer,
)

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
needs_math_verify = pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify not installed")
# A reward timeout no well-behaved reward in these tests comes near, however loaded the machine; the test
# of the timeout itself uses a short one, on a reward that hangs for an hour.
RUNNER_TIMEOUT_S = 60.0
HANG_TIMEOUT_S = 2.0

MODULE = "april_test_user_rewards"
MODULE_SOURCE = '''
import os
import time


def scripted(response_text, answer, metadata):
    """Behaviour picked by the response text; otherwise float(answer) after metadata['sleep'] seconds."""
    if response_text == "raise":
        raise ValueError("bad\\nthing")
    if response_text == "hang":
        time.sleep(3600)  # longer than any test: only a kill ends it
    if response_text == "pid":
        return float(os.getpid())
    if response_text == "crash":
        os._exit(3)
    if response_text == "print":
        print("noise on stdout")
        print('{"v": 1, "t": "done", "key": 999, "reward": 5.0, "error": ""}', flush=True)
    if response_text == "nan":
        return float("nan")
    if response_text == "str":
        return "1.0"
    if response_text == "none":
        return None
    time.sleep(float(metadata.get("sleep", "0")))
    return float(answer)


def as_bool(response_text, answer, metadata):
    return response_text == answer


def two_args(response_text, answer):
    return 1.0


def with_default(response_text, answer, metadata, extra=1):
    return 1.0


class Holder:
    @staticmethod
    def method(response_text, answer, metadata):
        return 0.25


NOT_CALLABLE = 3
'''

BROKEN_SOURCE = "raise RuntimeError('broken at import')\n"

# Loads fine in the test process, fails in the runner's child (whose argv[0] is reward_runner.py).
CHILD_ONLY_FAILURE_SOURCE = """
import sys
if sys.argv[0].endswith("reward_runner.py"):
    raise RuntimeError("only the child fails")
def fn(response_text, answer, metadata):
    return 1.0
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    sources = {
        MODULE: MODULE_SOURCE,
        MODULE + "_broken": BROKEN_SOURCE,
        MODULE + "_child_only": CHILD_ONLY_FAILURE_SOURCE,
    }
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))  # the runner's child inherits sys.path via PYTHONPATH
    yield MODULE
    for name in sources:
        sys.modules.pop(name, None)


@pytest.fixture
def runner(user_module: str) -> Iterator[RewardRunner]:
    r = RewardRunner(f"{user_module}:scripted", timeout_s=RUNNER_TIMEOUT_S)
    yield r
    r.close()


def collect(runner: RewardRunner, n: int, within_s: float = 120.0) -> dict[int, RewardResult]:
    """Poll until `n` results arrived; fail the test (not hang) otherwise."""
    out: dict[int, RewardResult] = {}
    deadline = time.monotonic() + within_s
    while len(out) < n:
        assert time.monotonic() < deadline, f"got {len(out)} results within {within_s}s, expected {n}"
        for r in runner.poll(wait_s=0.05):
            assert r.key not in out, f"key {r.key} reported twice"
            out[r.key] = r
    return out


def child_pid(runner: RewardRunner) -> int:
    """The pid of the runner's scoring child, as the child reports it (and the child is up after this)."""
    runner.submit(-1, "pid", "0", {})
    return int(collect(runner, 1)[-1].reward or 0)


def wait_exited(pid: int, within_s: float = 60.0) -> None:
    """Wait until process `pid` has exited (gone, or a zombie not yet reaped); fail if it never does."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return
        except OSError:
            return
        assert time.monotonic() < deadline, f"process {pid} still running after {within_s}s"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------
# exact


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("so the result is \\boxed{42}.", "42", 1.0),
        ("\\boxed{1} first, then \\boxed{2}", "2", 1.0),  # the last box wins
        ("\\boxed{1} first, then \\boxed{2}", "1", 0.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
        ("work\n\n   Paris.  \n\n", "paris", 1.0),  # last non-empty line, case, trailing period
        ("NEW   \t York", "new york", 1.0),  # whitespace runs collapse
        ("Answer: 7\nhope that helps", "7", 1.0),  # answer: beats the last line
        ("answer : 3\nANSWER:  8 ", "8", 1.0),  # the last answer: wins
        ("42.", "42", 1.0),
        ("4.2", "42", 0.0),
        ("41", "42", 0.0),
        ("", "42", 0.0),
        ("the answer is 42", "42", 0.0),  # no box, no "answer:", so the whole last line is compared
        # verl's GSM8K prompts ask for the answer after "####"; its ground truth is the number alone
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("so the total is $1,080\n#### $1,080", "1080", 1.0),  # commas and "$" dropped, as verl does
        ("#### 72\n", "71", 0.0),
        ("#### 1. Setup\n3 + 4\nso 7", "so 7", 1.0),  # a numbered heading earlier is not an answer
    ],
)
def test_exact(response: str, answer: str, expected: float) -> None:
    assert exact_reward(response, answer, {}) == expected


def test_extract_and_normalise_rules() -> None:
    assert extract_final_answer("x \\boxed{12") == "12"  # truncated response: unterminated box
    assert extract_final_answer("answer:\nfinal line") == "final line"  # empty answer: falls through
    assert extract_final_answer("\n \n") == ""
    assert normalise_answer("  A  B..  ") == "a b"


# ---------------------------------------------------------------------------------------------------
# math


@needs_math_verify
@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("the answer:\n2.0", "2", 1.0),
        ("\\boxed{3}", "2", 0.0),
        ("no number here", "2", 0.0),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),  # verl's GSM8K
    ],
)
def test_math(response: str, answer: str, expected: float) -> None:
    assert load_reward("math")(response, answer, {}) == expected


@needs_math_verify
def test_math_unparseable_gold_is_an_error_not_zero() -> None:
    result = score_now("math", "\\boxed{3}", "not math at all", {}, timeout_s=RUNNER_TIMEOUT_S)
    assert result.reward is None and "cannot parse the gold answer" in result.error


def test_math_without_math_verify_is_a_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(RewardError, match="pip install math-verify"):
        load_reward("math")


# ---------------------------------------------------------------------------------------------------
# loading module:function


def test_load_user_rewards(user_module: str) -> None:
    assert load_reward(f"{user_module}:scripted")("x", "0.5", {}) == 0.5
    assert load_reward(f"{user_module}:as_bool")("a", "a", {}) == 1.0  # bool converted
    assert load_reward(f"{user_module}:with_default")("a", "b", {}) == 1.0
    assert load_reward(f"{user_module}:Holder.method")("a", "b", {}) == 0.25


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("april_no_such_module_xyz:fn", "module 'april_no_such_module_xyz' not found"),
        ("{m}:missing", "has no attribute 'missing'"),
        ("{m}:NOT_CALLABLE", "is a int, not callable"),
        ("{m}:two_args", "cannot take 3 positional arguments"),
        ("{m}_broken:fn", "failed: RuntimeError: broken at import"),
        ("exactly", "expected one of exact, math, reasoning_gym or 'module:function'"),
        ("{m}:", "expected one of"),
        (":fn", "expected one of"),
        ("a:b:c", "expected one of"),
    ],
)
def test_load_errors(user_module: str, spec: str, message: str) -> None:
    with pytest.raises(RewardError) as info:
        load_reward(spec.format(m=user_module))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_runner_validates_spec_at_start_up() -> None:
    with pytest.raises(RewardError, match="not found"):
        RewardRunner("april_no_such_module_xyz:fn", timeout_s=1.0)


@pytest.mark.parametrize(
    ("value", "expected"), [(True, 1.0), (False, 0.0), (3, 3.0), (np.float32(0.5), 0.5), (-1.5, -1.5)]
)
def test_check_reward_value_accepts(value: object, expected: float) -> None:
    assert check_reward_value(value) == expected


@pytest.mark.parametrize("value", [math.nan, math.inf, "1.0", None, [1.0]])
def test_check_reward_value_rejects(value: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        check_reward_value(value)


# ---------------------------------------------------------------------------------------------------
# the runner: real child processes


def test_score_now_exact() -> None:
    assert score_now("exact", "\\boxed{Paris}", "paris", {}, timeout_s=RUNNER_TIMEOUT_S) == RewardResult(
        0, 1.0, ""
    )


def test_results_keyed_when_several_in_flight(runner: RewardRunner) -> None:
    sleeps = {10: "0.05", 11: "0", 12: "0.02", 13: "0", 14: "0.01"}
    for key, sleep in sleeps.items():
        runner.submit(key, "ok", str(key / 100), {"sleep": sleep})
    assert runner.pending == 5
    results = collect(runner, 5)
    assert {k: r.reward for k, r in results.items()} == {k: k / 100 for k in sleeps}
    assert runner.pending == 0


def test_raising_reward_is_an_error_not_zero(runner: RewardRunner) -> None:
    runner.submit(1, "raise", "0", {})
    runner.submit(2, "ok", "0.75", {})
    results = collect(runner, 2)
    assert results[1] == RewardResult(1, None, "reward_error: reward raised ValueError: bad thing")
    assert results[2].reward == 0.75  # the child survives a raising reward


@pytest.mark.parametrize(("text", "message"), [("nan", "nan"), ("str", "(str)"), ("none", "(NoneType)")])
def test_bad_reward_values_are_errors(runner: RewardRunner, text: str, message: str) -> None:
    runner.submit(1, text, "0", {})
    result = collect(runner, 1)[1]
    assert result.reward is None and result.error.startswith("reward_error: reward returned")
    assert message in result.error


def test_stdout_noise_does_not_corrupt_the_protocol(runner: RewardRunner) -> None:
    runner.submit(1, "print", "0.5", {})
    assert collect(runner, 1) == {1: RewardResult(1, 0.5, "")}


def test_hanging_reward_times_out_and_runner_recovers(user_module: str) -> None:
    with RewardRunner(f"{user_module}:scripted", timeout_s=HANG_TIMEOUT_S) as runner:
        hung = child_pid(runner)
        runner.submit(1, "hang", "0", {})
        runner.submit(2, "ok", "0.5", {})  # queued behind the hung one: re-submitted to the new child
        results = collect(runner, 2)  # well before the hour the hang would take
        assert results[1] == RewardResult(1, None, "reward_timeout: reward timed out after 2s")
        assert results[2].reward == 0.5
        assert child_pid(runner) != hung  # a new child scores now ...
        wait_exited(hung)  # ... and the hung one was killed
        runner.submit(3, "ok", "0.25", {})
        assert collect(runner, 1)[3].reward == 0.25


def test_cancel_all_while_hung_returns_at_once(runner: RewardRunner) -> None:
    hung = child_pid(runner)
    runner.submit(1, "hang", "0", {})
    runner.submit(2, "ok", "0.5", {})
    assert runner.poll(wait_s=0.3) == []  # the hang has started
    start = time.monotonic()
    runner.cancel_all()
    assert time.monotonic() - start < 60  # did not wait on the hung reward (an hour) nor its timeout
    assert runner.pending == 0 and runner.poll() == []
    wait_exited(hung)  # the busy child was killed, not waited on
    runner.submit(1, "ok", "0.125", {})  # a cancelled key may be used again
    assert collect(runner, 1) == {1: RewardResult(1, 0.125, "")}


def test_child_crash_fails_the_running_sample_and_recovers(runner: RewardRunner) -> None:
    runner.submit(1, "ok", "0.5", {})
    runner.submit(2, "crash", "0", {})
    runner.submit(3, "ok", "0.25", {})
    results = collect(runner, 3)
    assert results[1].reward == 0.5
    assert (
        results[2].reward is None
        and results[2].error == "reward_crashed: reward process died (exit code 3) while scoring"
    )
    assert results[3].reward == 0.25  # re-submitted to the restarted child
    runner.submit(4, "ok", "1", {})
    assert collect(runner, 1)[4].reward == 1.0


def test_child_that_cannot_load_fails_samples_clearly(user_module: str) -> None:
    with RewardRunner(f"{user_module}_child_only:fn", timeout_s=1.0) as r:
        r.submit(1, "ok", "0", {})
        error = collect(r, 1)[1].error
        assert error.startswith("reward_crashed: reward process could not load")
        assert "only the child fails" in error
        r.submit(2, "ok", "0", {})  # later submissions fail at once with the same error
        assert r.poll() == [RewardResult(2, None, error)]


def test_duplicate_pending_key_is_rejected(runner: RewardRunner) -> None:
    runner.submit(1, "ok", "0", {"sleep": "0.2"})
    with pytest.raises(ValueError, match="already pending"):
        runner.submit(1, "ok", "0", {})


def test_closed_runner_rejects_submissions(runner: RewardRunner) -> None:
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(1, "ok", "0", {})


def test_no_pickle_on_the_reward_path() -> None:
    import actors.reward_runner
    import actors.rewards

    forbidden = {"pickle", "cPickle", "dill", "cloudpickle", "multiprocessing", "marshal", "shelve"}
    for module in (actors.rewards, actors.reward_runner):
        assert module.__file__ is not None
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & forbidden, f"{module.__name__} imports {imported & forbidden}"
