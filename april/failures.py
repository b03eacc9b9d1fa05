"""Why a sample failed, as a reason a run can count, and the one line a run stops with.

A sample's `error` (`april.records.Sample`) starts with its reason: `failure(ENV_EMPTY_RESET, "...")` is
`"env_empty_reset: environment reset answered no messages ..."`. Workers write it where the failure
happens; the broker counts settled samples by `reason_of(error)` (`broker.failures`), the learner writes
the counts in metrics.jsonl, the dashboard and `april status` show them. A sample that did not fail may
carry an error of a `NOTE_REASONS` reason (a tool call that timed out, answered to the model with an
error message): it is counted as the sample settles, and it trains. `RunFailed` is the learner's one-line
exit when the broker stopped a run whose samples all failed alike. The reasons and their meanings are
docs/episodes.md's "Failures"; nothing here reads files or sockets.
"""

from __future__ import annotations

import enum

MAX_ERROR = 500  # characters of a sample's error (what a worker sends, what the records keep)
RUN_FAILED = "run_failed"  # the `protocol.Error` code with which the broker tells the learner it stopped
STATS_PREFIX = "errors/"  # a Batch's stats: errors/<reason> -> samples that settled with it since the last


class Reason(enum.StrEnum):
    """Why a sample failed (or, for `NOTE_REASONS`, what went wrong in a sample that did not)."""

    ENV_ERROR = "env_error"  # the environment's reset or step raised, or answered something not an EnvStep
    ENV_EMPTY_RESET = "env_empty_reset"  # a reset answered no messages: the episode has no prompt
    ENV_BAD_STATE = "env_bad_state"  # a reset or step answered a state that is not JSON text
    ENV_TIMEOUT = "env_timeout"  # a reset or a step calling no tool overran env.step_timeout_s
    ENV_CRASHED = "env_crashed"  # the environment's process died, broke its protocol or did not start
    ENV_SESSION_LOST = (
        "env_session_lost"  # a remote environment's session is gone (server or gateway restart)
    )
    TOOL_TIMEOUT = "tool_timeout"  # a tool call overran its timeout_s; the model is told, the episode goes on
    EPISODE_STATE = "episode_state"  # a sample's episode state that this worker cannot read
    REWARD_ERROR = "reward_error"  # the reward raised, or returned something that is not a finite number
    REWARD_TIMEOUT = "reward_timeout"  # the reward overran worker.reward_timeout_s
    REWARD_CRASHED = "reward_crashed"  # the reward's process died, broke its protocol or did not start
    ENGINE_REJECTED = "engine_rejected"  # the engine refused the request (a prompt over its context)
    ENGINE_FAILED = "engine_failed"  # the engine failed the request part way
    OTHER = "other"  # an error that names no reason (from a worker of an older version)


NOTE_REASONS = frozenset({Reason.TOOL_TIMEOUT})  # errors a sample carries without failing


class RunFailed(Exception):
    """The broker stopped the run: every recent sample failed for one reason. The message is one line."""


def failure(reason: Reason, message: str) -> str:
    """A sample's error: `"reason: message"`, on one line, at most `MAX_ERROR` characters."""
    text = f"{reason.value}: {' '.join(message.split())}"
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."


def reason_of(error: str) -> Reason:
    """The reason `error` starts with; `OTHER` when it names none."""
    head, sep, _ = error.partition(": ")
    try:
        return Reason(head) if sep else Reason.OTHER
    except ValueError:
        return Reason.OTHER
