"""The scheduling modes, one `ModePolicy` each, by the name `run.mode` gives (docs/design.md section 4).

`policy_for(name)` is the one place a mode is chosen; the books (`broker.state`) hold the answer and the
broker core and the simulator ask it. A mode is one module with one `ModePolicy` subclass, put into
`MODES` under its name; the config's `run.mode` lists the names a user may choose (`april.config.Mode`).
"""

from __future__ import annotations

from broker.modes.asynchronous import Async
from broker.modes.base import ModePolicy, PoolCounts
from broker.modes.rounds import April, Sync

__all__ = ["MODES", "ModePolicy", "PoolCounts", "policy_for"]

MODES: dict[str, ModePolicy] = {mode.name: mode for mode in (Sync(), April(), Async())}


def policy_for(name: str) -> ModePolicy:
    """The policy of mode `name` (a `run.mode` value)."""
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"run.mode = {name!r}: expected one of {', '.join(map(repr, MODES))}") from None
