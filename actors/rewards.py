"""What a reward is: the built-in rewards, user `module:function` rewards, and their start-up validation.

A reward scores one finished response against the prompt's gold answer. Every reward, built-in or not, is
called as

    fn(response_text: str, answer: str, metadata: dict[str, str]) -> float   (a bool is accepted: 1.0 / 0.0)

`metadata` is the prompt's metadata (strings only). The value must be a finite real number; anything else
(None, a string, NaN, inf) is an error, never a silent 0. A reward that raises is an error too.

`load_reward(spec)` resolves a spec once, at start-up, and raises a one-line `RewardError` if it cannot:

- `exact`: normalised string match of the final answer (see `extract_final_answer`, `normalise_answer`).
- `math`: math-verify equivalence of the final answer with the gold answer (needs `pip install math-verify`).
- `reasoning_gym`: the reasoning-gym task's own `score_answer` on the entry the prompt came from
  (`data.source = "reasoning_gym:TASK"`, `april.envs.reasoning_gym`), given the last `<answer>...</answer>`
  or else the final answer as `exact` reads it.
- `module:function` (also `module:Class.attr`): imported with importlib, never evaluated; the object must
  be callable with three positional arguments.

This module calls rewards in-process and knows nothing about timeouts: `actors.reward_runner` runs them in
a child process that can be killed when a reward hangs, so the worker never blocks on one.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from april.data.fields import GSM8K_MARK

RewardFn = Callable[[str, str, dict[str, str]], float | bool]

BUILTIN_REWARDS = ("exact", "math", "reasoning_gym")

_BOXED = "\\boxed"
_ANSWER_LINE = re.compile(r"answer\s*:\s*(.*)", re.IGNORECASE)
_GSM8K_FINAL = re.compile(re.escape(GSM8K_MARK) + r"\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


class RewardError(Exception):
    """A reward spec cannot be used (unknown name, module not found, not callable, ...). One line."""


@dataclass(frozen=True, slots=True)
class Reward:
    """A resolved reward: the spec it came from and the function to call."""

    spec: str
    fn: RewardFn

    def __call__(self, response_text: str, answer: str, metadata: dict[str, str]) -> float:
        """Score one response; raises whatever the function raises, or `TypeError`/`ValueError` when the
        value is not a finite number (see `check_reward_value`)."""
        return check_reward_value(self.fn(response_text, answer, metadata))


def check_reward_value(value: object) -> float:
    """The reward as a float: bools become 1.0 / 0.0; non-numbers and non-finite numbers are rejected."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward returned {_short_repr(value)} ({type(value).__name__}), expected a float")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward returned {out}, expected a finite number")
    return out


# ---------------------------------------------------------------------------------------------------
# final-answer extraction, shared by `exact` and `math`


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (nested braces matched), or None if there is none.

    An unterminated last box (`\\boxed{12` at the end of a truncated response) yields everything after
    its opening brace."""
    start = text.rfind(_BOXED + "{")
    if start == -1:
        return None
    i = j = start + len(_BOXED) + 1
    depth = 1
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else text[i:]


def extract_final_answer(response_text: str) -> str:
    """The part of a response that is compared with the gold answer. The rule, first match wins:

    1. the content of the last `\\boxed{...}` anywhere in the response;
    2. else the text after the last `answer:` (case-insensitive, any spacing before the colon), up to the
       end of that line, if that text is non-empty;
    3. else the last non-empty line, or, when it holds GSM8K's mark `####` followed by a number (what
       verl's GSM8K prompts ask for; a `$` between allowed), that number with its commas dropped, as
       GSM8K's and verl's answers are written;
    4. else the empty string.
    """
    boxed = last_boxed(response_text)
    if boxed is not None:
        return boxed
    lines = response_text.splitlines()
    for line in reversed(lines):
        matches = _ANSWER_LINE.findall(line)
        if matches and matches[-1].strip():
            return str(matches[-1])
    for line in reversed(lines):
        if line.strip():
            numbers = _GSM8K_FINAL.findall(line)
            return str(numbers[-1]).replace(",", "") if numbers else line
    return ""


def normalise_answer(text: str) -> str:
    """Strip, casefold, collapse every whitespace run to one space, then drop trailing periods."""
    out = " ".join(text.casefold().split())
    return out.rstrip(".").rstrip()


def exact_reward(response_text: str, answer: str, metadata: dict[str, str]) -> float:
    """1.0 if the response's final answer equals the gold answer after normalisation, else 0.0.

    The gold answer is normalised as a whole (no extraction); the response's final answer is chosen by
    `extract_final_answer`."""
    del metadata
    return float(normalise_answer(extract_final_answer(response_text)) == normalise_answer(answer))


def math_reward(response_text: str, answer: str, metadata: dict[str, str]) -> float:
    """1.0 if math-verify finds the response's final answer equivalent to the gold answer, else 0.0.

    A gold answer math-verify cannot parse raises `ValueError` (a dataset problem, reported as a failed
    sample); a prediction it cannot parse scores 0.0 (the model gave no usable answer)."""
    del metadata
    math_verify = importlib.import_module("math_verify")  # lazy: sympy is heavy; only this reward needs it
    parse, verify = math_verify.parse, math_verify.verify
    gold = parse(answer)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {_short_repr(answer)}")
    prediction = parse(extract_final_answer(response_text))
    return float(bool(prediction) and verify(gold, prediction))


def reasoning_gym_reward(response_text: str, answer: str, metadata: dict[str, str]) -> float:
    """The reasoning-gym task's own `score_answer` on the prompt's entry, regenerated from its metadata;
    the answer it is given is the response's last `<answer>...</answer>`, else `extract_final_answer`'s."""
    del answer  # the entry carries its own, and some tasks accept more than one
    from april.envs import reasoning_gym  # lazy: only this reward imports the package

    tagged = reasoning_gym.tagged_answer(response_text)
    return reasoning_gym.score(extract_final_answer(response_text) if tagged is None else tagged, metadata)


# ---------------------------------------------------------------------------------------------------
# start-up validation


def load_reward(spec: str) -> Reward:
    """Resolve `spec` ("exact", "math" or "module:function") to a callable reward, or raise RewardError."""
    if spec == "exact":
        return Reward(spec, exact_reward)
    if spec == "math":
        try:
            importlib.import_module("math_verify")
        except ImportError as exc:
            raise RewardError(
                f"reward 'math' needs the math-verify package ({exc}); install it: pip install math-verify"
            ) from None
        return Reward(spec, math_reward)
    if spec == "reasoning_gym":
        from april.envs.reasoning_gym import ReasoningGymError, package

        try:
            package()
        except ReasoningGymError as exc:
            raise RewardError(f"reward 'reasoning_gym': {exc}") from None
        return Reward(spec, reasoning_gym_reward)
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise RewardError(
            f"reward: got {spec!r}, expected one of {', '.join(BUILTIN_REWARDS)} or 'module:function'"
        )
    fn = _resolve(spec, _import(spec, module_name), attr_path)
    _check_signature(spec, fn)
    return Reward(spec, fn)


def _import(spec: str, module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise RewardError(f"reward {spec!r}: module {module_name!r} not found") from None
        failure: Exception = exc
    except Exception as exc:  # the user's module raised at import time: a start-up error, one line
        failure = exc
    raise RewardError(f"reward {spec!r}: importing {module_name!r} failed: {one_line_error(failure)}")


def _resolve(spec: str, module: object, attr_path: str) -> Any:
    obj: object = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            where = getattr(module, "__name__", "?")
            raise RewardError(f"reward {spec!r}: module {where!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable")
    return obj


def _check_signature(spec: str, fn: Callable[..., object]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some C callables have no introspectable signature: accept, the call reports any mismatch
    try:
        sig.bind("", "", {})
    except TypeError:
        raise RewardError(
            f"reward {spec!r}: signature {sig} cannot take 3 positional arguments; expected "
            "fn(response_text: str, answer: str, metadata: dict[str, str]) -> float"
        ) from None


def one_line_error(exc: BaseException) -> str:
    """`Type: message` on one line, at most ~300 characters."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
