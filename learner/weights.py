"""Publishing weights versions: `weights/v{version:06d}.safetensors`, written atomically, with a sha256.

Owns the file side of the weights hand-off (docs/design.md section 6): the learner's rank 0 writes version v
to a temp file in the same directory, fsyncs it, renames it into place (so a reader never sees a
half-written `v*.safetensors`, even after a crash), hashes the bytes, and prunes old versions;
`load_published` is the reader's side, verifying the sha256 before trusting a byte.

Does not gather weights (`learner.engine`) nor announce them (the learner loop sends WeightsReady).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from april.files import fsync_dir, sha256_file
from april.weights_uri import published_versions, version_path

if TYPE_CHECKING:
    import torch

TEMP_SUFFIX = ".tmp"


class WeightsError(Exception):
    """A weights file is missing, fails its sha256 or is not valid safetensors."""


def publish(
    state_dict: dict[str, torch.Tensor], weights_dir: Path, version: int, *, keep: int = 3
) -> tuple[Path, str]:
    """Write `state_dict` as version `version`; return (path, sha256 hex of the file's bytes).

    Tensors must not alias each other (safetensors refuses shared storage; `state_dict_for_publish`
    gives copies). Keeps the newest `keep` (>= 2) versions: never deletes this one nor the previous.
    Temp files left by a crashed publish are removed.
    """
    from safetensors.torch import save_file

    if version < 0:
        raise ValueError(f"publish: version = {version}, expected >= 0")
    if keep < 2:
        raise ValueError(f"publish: keep = {keep}, expected >= 2 (the announced and the previous version)")
    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    final = version_path(weights_dir, version)
    fd, tmp_name = tempfile.mkstemp(dir=weights_dir, prefix=f".{final.stem}.", suffix=TEMP_SUFFIX)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
        # One metadata key only: safetensors writes a map in arbitrary order, and equal weights should
        # give equal bytes (and sha256). The version is in the file name.
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        digest = sha256_file(tmp)  # fresh in the page cache: cheap next to the write
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(weights_dir)
    _prune(weights_dir, version, keep, own_temp=tmp.name)
    return final, digest


def load_published(path: Path, sha256: str) -> dict[str, torch.Tensor]:
    """The tensors in `path` after checking its sha256; WeightsError if missing, altered or invalid.

    Reads the file once and parses the verified bytes, so what is loaded is what was hashed.
    """
    from safetensors.torch import load

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise WeightsError(f"cannot read weights file {path}: {exc.strerror or exc}") from exc
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise WeightsError(f"sha256 of {path} is {got}, expected {sha256}")
    try:
        return load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError (not exported in all versions)
        raise WeightsError(f"{path} is not valid safetensors: {exc}") from exc


def _prune(weights_dir: Path, version: int, keep: int, own_temp: str) -> None:
    """Delete versions older than the newest `keep`, sparing `version` and `version - 1`; stale temps."""
    versions = published_versions(weights_dir)
    spare = {version, version - 1, *versions[-keep:]}
    for v in versions:
        if v not in spare:
            version_path(weights_dir, v).unlink(missing_ok=True)
    for p in weights_dir.glob(f".v*{TEMP_SUFFIX}"):
        if p.name != own_temp:  # one publisher per run (rank 0): any other temp is a crash's leftover
            p.unlink(missing_ok=True)
