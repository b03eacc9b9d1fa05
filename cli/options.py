"""Turning command-line options into a resolved `Config`, and user errors into one readable line.

Every command that takes a config goes through `resolve_config`, so precedence is the same everywhere:
defaults < TOML file < APRIL_* environment < options. Only the slime-compatible flags and a generic
`--set section.key=value` are options; the other fields live in the TOML file (one place to document).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from april.config import Config, ConfigError, load_config, parse_override
from april.data import DatasetError
from april.hf import ModelError

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, DatasetError, ModelError, FileNotFoundError)


def resolve_config(
    config_file: Path | None,
    sets: list[str] | None,
    **flags: object,
) -> Config:
    """Load the config with `--set` strings and the non-None `flags` (keyed "section.key") on top."""
    overrides: dict[str, object] = dict(parse_override(text) for text in sets or [])
    overrides.update({key: value for key, value in flags.items() if value is not None})
    return load_config(config_file, overrides={k.replace("__", "."): v for k, v in overrides.items()})


@contextmanager
def user_errors(*extra: type[Exception]) -> Iterator[None]:
    """Print a user error as one line on stderr and exit 2, instead of a traceback."""
    try:
        yield
    except (*USER_ERRORS, *extra) as exc:
        print(f"april: error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
