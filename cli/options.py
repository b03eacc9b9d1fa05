"""Turning command-line options into a resolved `Config`, and every user error into one readable line.

Every command that takes a config goes through `resolve_config`, so precedence is the same everywhere:
defaults < TOML file < APRIL_* environment < options. Only the slime-compatible flags and a generic
`--set section.key=value` are options; the other fields live in the TOML file (one place to document).

User errors are the one place that decides what a user sees when a command cannot do what was asked:
`USER_ERRORS` (the domain's error types: a bad config, dataset, model directory, key directory, engine,
length spec, a file that cannot be read or written, a run the broker stopped because its samples all
failed alike, or a command's own `UserError`) and the command
line's usage errors (typer's: a bad option value, a missing option, an unknown command) both become
`april: error: <one line>` on stderr with exit code 2, never a traceback or a usage box; a role that
cannot start on this machine (`april.startup.StartupError`) says so the same way with its own exit code
(`STARTUP_EXIT`), so that `april up` does not restart it. `AprilGroup`
applies that around every command and subcommand of the `april` app; commands raise, they do not catch.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from actors.engine import EngineError
from actors.lengths import LengthSpecError
from actors.rewards import RewardError
from april.chat import ChatError
from april.config import Config, ConfigError, load_config, parse_override
from april.data import DatasetError
from april.episode import EpisodeError
from april.failures import RunFailed
from april.hf import ModelError
from april.startup import STARTUP_EXIT, StartupError
from broker.sim.model import SimulationError

USAGE_EXIT = 2  # click's exit code for usage errors; user errors share it

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file.", exists=True, dir_okay=False)
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config field: section.key=value.")
]


class UserError(Exception):
    """A command cannot do what was asked (`april up` on a busy port, ...); the message is one line."""


USER_ERRORS: tuple[type[Exception], ...] = (
    UserError,
    ConfigError,  # KeysError too
    DatasetError,
    ModelError,
    EngineError,
    RewardError,
    EpisodeError,  # a bad env.name
    ChatError,  # a chat template the episode driver cannot split into turns
    LengthSpecError,
    SimulationError,
    RunFailed,  # the broker stopped the run: every recent sample failed alike (its learner says why)
    OSError,  # a file that cannot be read or written (one with a filename; see `user_errors`)
)


def resolve_config(
    config_file: Path | None,
    sets: list[str] | None,
    **flags: object,
) -> Config:
    """Load the config with `--set` strings and the non-None `flags` (keyed "section.key") on top."""
    overrides: dict[str, object] = dict(parse_override(text) for text in sets or [])
    overrides.update({key: value for key, value in flags.items() if value is not None})
    return load_config(config_file, overrides={k.replace("__", "."): v for k, v in overrides.items()})


def one_line(text: str) -> str:
    """`text` on one line: a message that spans several lines gets them joined with "; "."""
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def describe(exc: BaseException) -> str:
    """What a user error says: its message; an OSError's path and the system's reason."""
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {exc.strerror}" if where != "" else exc.strerror
    return one_line(str(exc)) or type(exc).__name__


def fail(message: str, code: int = USAGE_EXIT) -> NoReturn:
    print(f"april: error: {message}", file=sys.stderr)
    raise SystemExit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Print a user error as one line on stderr and exit 2 (a start-up error: `STARTUP_EXIT`), instead of a
    traceback."""
    try:
        yield
    except StartupError as exc:
        fail(one_line(str(exc)), STARTUP_EXIT)
    except USER_ERRORS as exc:
        if isinstance(exc, OSError) and exc.filename is None:
            raise  # not a path the user gave (a socket, a pipe, ...): a bug or a fault, keep its traceback
        fail(describe(exc))


def usage_message(exc: typer.TyperException) -> str:
    """A usage error's message as one line, with the value that was given when the message leaves it out
    ("Input should be greater than or equal to 1 (got '-1')"). typer checks values with pydantic: its
    ValidationError, the usage error's cause, holds the input (and prefixes "Value error, ")."""
    text = one_line(exc.format_message().replace("Value error, ", ""))
    errors = getattr(exc.__cause__, "errors", None)
    found = errors() if callable(errors) else []
    got = [e["input"] for e in found if isinstance(e, dict) and "input" in e]
    if got and repr(got[0]) not in text:
        text = f"{text.rstrip('.')} (got {got[0]!r})"
    return text


class AprilGroup(TyperGroup):
    """The `april` app's group: runs a command line and turns user and usage errors into one line.

    Runs the command line in typer's non-standalone mode, so that usage errors come here instead of being
    drawn as a usage box, and exits as standalone mode would (`--help` and help on no arguments are
    typer's, unchanged)."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            with user_errors():
                code = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except typer.TyperException as exc:  # click's usage errors (BadParameter, NoSuchOption, ...)
            # no arguments where a command is needed: typer has printed the help (rich) or put it here
            if type(exc).__name__ == "NoArgsIsHelpError":
                if exc.format_message().strip():
                    print(exc.format_message())
                sys.exit(exc.exit_code)
            fail(usage_message(exc), exc.exit_code)
        except typer.Abort:
            fail("aborted", 1)
        if not standalone_mode:
            return code
        # non-standalone mode returns typer.Exit's code, or the command's return value (None: success)
        sys.exit(code if isinstance(code, int) else 0)
