"""Per-version weight directories, for a server that loads weights only from a directory.

SGLang's `/update_weights_from_disk` takes a directory and loads every `*.safetensors` in it (anything else
it takes for a Hugging Face repo id), while the learner publishes one file per version beside the others.
`VersionDirs` gives each version a directory of its own holding only that file: a hard link where the
cache is on the file's filesystem (no copy, and the link keeps the verified bytes even if the learner
deletes or replaces the file), a copy elsewhere. Owns those directories and their removal; does not know
which server loads them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


class VersionDirs:
    """Directories `root/vNNNNNN/` made by `make`; `root` is a temporary directory (removed by `close`)
    unless given."""

    def __init__(self, root: Path | str | None = None) -> None:
        self._root = Path(root) if root is not None else None
        self._own_root = root is None
        self._made: dict[int, Path] = {}

    def make(self, path: Path, version: int) -> Path:
        """The directory to load `version` from: `path` itself unless it is a file, else a new directory
        holding only that file (a hard link, or a copy across filesystems). OSError if it cannot."""
        if not path.is_file():
            return path
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="april-weights-"))
        self.drop(version)
        target = self._root / f"v{version:06d}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        self._made[version] = target
        try:
            os.link(path, target / path.name)
        except OSError:  # another filesystem, or links not allowed there
            shutil.copyfile(path, target / path.name)
        return target

    def drop(self, version: int) -> None:
        """Remove `version`'s directory, if one was made."""
        target = self._made.pop(version, None)
        if target is not None:
            shutil.rmtree(target, ignore_errors=True)

    def keep_only(self, version: int) -> None:
        """Remove every other version's directory (the servers loaded `version`)."""
        for old in [v for v in self._made if v != version]:
            self.drop(old)

    def close(self) -> None:
        for version in list(self._made):
            self.drop(version)
        if self._own_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
