"""The learner's wandb run: every metrics line, logged at its learner step, into one wandb run per run
directory, continued across learner restarts.

Owns: checking that wandb can be used (`check_wandb`, one ConfigError line naming the install command),
opening or continuing the run (its id and the last step it holds are kept in RUN_DIR/wandb.json; wandb's
own files go to RUN_DIR/wandb/), the resolved config as the run's config, and logging a line's
`learner.metrics.numeric_fields` under their metrics.jsonl names at `step`, with the step's few samples
as a `wandb.Table` in the same call.

Does not own: which fields a line has or the metrics.jsonl file (`learner.metrics.MetricsLog`, which calls
this), online/offline (wandb's own `WANDB_MODE`; offline runs are uploaded later with
`wandb sync RUN_DIR/wandb`), or which rank logs (only rank 0 holds a MetricsLog).

A step is logged to a wandb run once. After a resume the learner trains again the steps since its last
checkpoint, but wandb drops a step lower than one the run already holds (online, after a warning per
call), and an offline run cannot ask the server what it holds. So the last step logged is kept in
wandb.json, those steps are not sent again (said once, at start-up), and online and offline runs end up
with the same history: the first values of a step trained twice; metrics.jsonl holds the second.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from april.config import Config, ConfigError, LearnerConfig, config_to_dict
from april.files import write_text_atomic

if TYPE_CHECKING:
    from learner.metrics import SamplesTable  # it imports this module

log = logging.getLogger("april.learner")

STATE_FILE = "wandb.json"  # in the run directory: {"id": wandb run id, "logged_through": last step logged}
INSTALL = "pip install wandb (or pip install 'april-rl[wandb]')"
_ID_CHARS = string.ascii_lowercase + string.digits  # wandb run ids: letters and digits, 8 as wandb's own


def _missing(lc: LearnerConfig, why: str) -> ConfigError:
    project = lc.wandb_project
    return ConfigError(f"learner.wandb_project = {project!r} needs the wandb package ({why}): {INSTALL}")


def check_wandb(lc: LearnerConfig) -> None:
    """Before anything starts: with wandb_project set, wandb must be installed (found, not imported:
    the import takes seconds). Nothing is looked up when wandb_project is empty."""
    if not lc.wandb_project:
        return
    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise _missing(lc, "not installed")


class WandbRun:
    """The wandb run of one run directory. Created once per learner process (rank 0), closed at its end."""

    def __init__(self, run_dir: Path, config: Config, next_step: int) -> None:
        """Open the run directory's wandb run (a new one, or the one in wandb.json, resume="allow").
        `next_step` is the step the learner trains next: steps from it up to the last one this wandb run
        already holds will be trained again and are not logged again (said here, once)."""
        lc = config.learner
        try:
            import wandb
        except ImportError as exc:
            raise _missing(lc, f"import failed: {exc}") from None
        self._wandb: Any = wandb
        self._state_path = run_dir / STATE_FILE
        run_id, self._logged_through = self._load_state()
        tags = [t.strip() for t in lc.wandb_tags.split(",") if t.strip()]
        try:
            self._run: Any = wandb.init(
                project=lc.wandb_project,
                entity=lc.wandb_entity or None,
                name=lc.wandb_run_name or run_dir.resolve().name,
                group=lc.wandb_group or None,
                tags=tags or None,
                config=config_to_dict(config),
                dir=str(run_dir),
                id=run_id,
                resume="allow",
            )
        except Exception as exc:  # wandb's own errors (no API key, a bad entity, ...): one line, not a trace
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"learner.wandb_project = {lc.wandb_project!r}: wandb could not start a run: {first} "
                "(WANDB_MODE=offline logs to the run directory; `wandb sync` uploads it later)"
            ) from None
        # online, a resumed run knows its last step too (the state file may predate a crash)
        self._logged_through = max(self._logged_through, int(self._run.step) - 1)
        self._save_state(run_id)
        if next_step <= self._logged_through:
            log.warning(
                "wandb run %s already holds steps %d-%d: trained again after the resume, they are not logged "
                "to wandb again (wandb keeps a step's first values); metrics.jsonl holds the new ones",
                run_id,
                next_step,
                self._logged_through,
            )
        log.info("wandb run %s (project %s), local files in %s", run_id, lc.wandb_project, run_dir / "wandb")

    def _load_state(self) -> tuple[str, int]:
        """(run id, last step logged): the ones kept in the run directory, or a new id and -1."""
        if self._state_path.exists():
            state = json.loads(self._state_path.read_text(encoding="utf-8"))
            return str(state["id"]), int(state["logged_through"])
        return "".join(secrets.choice(_ID_CHARS) for _ in range(8)), -1

    def _save_state(self, run_id: str) -> None:
        state = {"id": run_id, "logged_through": self._logged_through}
        write_text_atomic(self._state_path, json.dumps(state) + "\n")

    def log(
        self, step: int, fields: dict[str, int | float], tables: Mapping[str, SamplesTable] | None = None
    ) -> None:
        """Log one metrics line's fields, and `tables` (name -> a few samples) as wandb tables, at `step`
        (skipped when this wandb run already holds it)."""
        if step <= self._logged_through:
            return
        logged: dict[str, Any] = dict(fields)
        for name, table in (tables or {}).items():
            logged[name] = self._wandb.Table(columns=table.columns, data=table.rows)
        self._run.log(logged, step=step)
        self._logged_through = step
        self._save_state(self._run.id)

    def close(self) -> None:
        """Finish the run and wait until everything logged is in wandb's files (offline) or sent (online):
        `finish` alone returns before wandb's service has written the offline run out (seen with 0.31),
        `teardown` waits for it (wandb's atexit hook would too, but not under every launcher)."""
        self._run.finish()
        self._wandb.teardown()
