"""Writing the rollout records off a role's loop: one thread, a bounded queue, one file at a time, whole.

`RolloutWriter.submit(name, build)` queues a table to be built (decoding text is most of the cost) and
written on the writer's thread as `directory/name`; at most `depth` wait, and `submit` blocks while the
queue is full, so memory stays bounded whatever the disk does. A file is written as `.name.tmp`, fsynced
and renamed into place: a reader (pandas, pyarrow, `datasets`: they skip names starting with ".") never
sees half a file, and a crash leaves at most a temporary file, removed at the next open. A name whose file
exists is not written again. `flush` waits until everything submitted is on disk (the learner calls it
before a checkpoint, so a checkpointed step's records are never lost); a failed write is logged with
its file and the thread goes on. Imports pyarrow only to write (`unavailable` says whether it can).

Knows nothing of what the tables hold (`april.rollouts`) or when to write them (the roles).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from april.files import fsync_dir

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("april.rollouts")

Build = Callable[[], "pa.Table"]
TMP_SUFFIX = ".tmp"


def unavailable() -> str:
    """Why records cannot be written here ("" when they can): pyarrow missing, as on a GPU image that
    lacks it. A role then runs without them and says so once."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        return f"rollout records off: they need pyarrow, which this Python lacks ({exc})"
    return ""


def remove_partial_files(directory: Path) -> int:
    """Delete the temporary files of writes a crash cut short; how many there were."""
    if not directory.is_dir():
        return 0
    partial = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(TMP_SUFFIX)]
    for path in partial:
        path.unlink(missing_ok=True)
    return len(partial)


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """`table` as Parquet at `path`: a temporary file beside it, fsynced, renamed into place."""
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class RolloutWriter:
    """Tables written into `directory` on a thread of its own, in submission order."""

    def __init__(self, directory: Path, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"RolloutWriter: depth {depth} must be >= 1")
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        removed = remove_partial_files(directory)
        if removed:
            log.info("%s: %d partial file(s) of an interrupted write removed", directory, removed)
        self.written = 0  # files written by this writer
        self.skipped = 0  # names whose file existed
        self.failed = 0  # writes that raised
        self._queue: queue.Queue[tuple[str, Build] | None] = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="rollout-writer", daemon=True)
        self._thread.start()

    def submit(self, name: str, build: Build) -> None:
        """Write `build()` as `directory/name` on the writer's thread; blocks while `depth` are waiting."""
        if not self._thread.is_alive():
            raise RuntimeError("RolloutWriter.submit after close")
        self._queue.put((name, build))

    def flush(self) -> None:
        """Wait until every table submitted so far is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, name: str, build: Build) -> None:
        path = self.directory / name
        if path.exists():
            self.skipped += 1
            log.info("%s exists: not written again", path)
            return
        try:
            write_table_atomic(build(), path)
        except Exception as exc:  # a full disk, an unwritable directory: said, and the run goes on
            self.failed += 1
            log.error("rollout records %s not written: %s: %s", path, type(exc).__name__, exc)
            return
        self.written += 1
