"""CurveZMQ key files: creating them (`april keys`), and reading them for the broker and its clients.

One directory (`broker.curve_keys_dir`) in pyzmq's certificate format (`zmq.auth.create_certificates`):

    broker.key, broker.key_secret    the broker's pair (the secret stays on the broker's host)
    client.key, client.key_secret    the default client pair (workers, learner, `april status`, dashboard)
    weights.key, weights.key_secret  the learner's weight service (`learner.weight_service`); the secret
                                     stays on the learner's host
    authorized/*.key                 public keys the broker and the weight service accept (a copy of
                                     client.key to begin with)
    clients/NAME/                    `april keys add-client`: a ready-to-copy directory for another host
                                     (its broker.key and weights.key, and NAME's pair as client.key /
                                     client.key_secret)

The broker reads broker.key_secret and authorized/; the weight service weights.key_secret and authorized/
(the same clients may fetch weights as may talk to the broker); a client reads client.key_secret and
broker.key (and, fetching weights, weights.key) from the directory its own config names. The weight
service has its own pair so that the broker's secret never needs to be on the learner's host.
Secret files are created 0600 inside a 0700 staging directory, so
they are never readable by others, not even for a moment. Every problem is a `KeysError`: one line
naming the file and what is wrong.

Does not own: sockets (`april.transport` applies the keys) or who is let in (`broker.auth`).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from april.config import ConfigError

BROKER, CLIENT, WEIGHTS = "broker", "client", "weights"
AUTHORIZED, CLIENTS = "authorized", "clients"
KEY_CHARS = 40  # a Z85-encoded 32-byte Curve25519 key


class KeysError(ConfigError):
    """Missing, unreadable or corrupt key files, or keys that would be overwritten; one readable line."""


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """What the broker's sockets need: its own pair (Z85) and the directory of accepted client keys."""

    public: bytes
    secret: bytes
    authorized: Path


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a client socket needs: its own pair and the broker's public key (all Z85)."""

    public: bytes
    secret: bytes
    server_public: bytes


def _valid(key: bytes | None) -> bool:
    if key is None or len(key) != KEY_CHARS:
        return False
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, IndexError, struct.error):
        return False
    return True


def read_public(path: Path) -> bytes:
    """The Z85 public key of a certificate file (public or secret)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read CurveZMQ key {path}: {exc}") from None
    if not _valid(public):
        raise KeysError(f"CurveZMQ key {path} is corrupt: expected a {KEY_CHARS}-character Z85 public-key")
    return public


def read_pair(path: Path) -> tuple[bytes, bytes]:
    """The (public, secret) Z85 pair of a secret certificate file, checked to belong together."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read CurveZMQ key {path}: {exc}") from None
    if not _valid(public) or not _valid(secret):
        raise KeysError(
            f"CurveZMQ key {path} is corrupt: expected {KEY_CHARS}-character Z85 public and secret keys"
        )
    assert secret is not None
    if zmq.curve_public(secret) != public:
        raise KeysError(f"CurveZMQ key {path} is corrupt: its public-key does not match its secret-key")
    return public, secret


def _check_dir(keys_dir: Path) -> None:
    if not keys_dir.is_dir():
        raise KeysError(
            f"broker.curve_keys_dir = {str(keys_dir)!r}: no such directory (create one with "
            "`april keys generate DIR`)"
        )


def server_keys(keys_dir: Path) -> ServerKeys:
    _check_dir(keys_dir)
    public, secret = read_pair(keys_dir / f"{BROKER}.key_secret")
    authorized = keys_dir / AUTHORIZED
    if not authorized.is_dir():
        raise KeysError(f"{authorized}: no such directory (public keys of the clients the broker accepts)")
    authorized_keys(authorized)  # a corrupt one stops the broker at start-up
    return ServerKeys(public, secret, authorized)


def client_keys(keys_dir: Path) -> ClientKeys:
    _check_dir(keys_dir)
    public, secret = read_pair(keys_dir / f"{CLIENT}.key_secret")
    return ClientKeys(public, secret, read_public(keys_dir / f"{BROKER}.key"))


def _missing_weights_pair(path: Path) -> KeysError:
    return KeysError(
        f"{path}: no such file (the weight service's keys; this key directory predates them: "
        f"run `april keys add-weights {path.parent}` and copy weights.key to the workers)"
    )


def weights_server_keys(keys_dir: Path) -> ServerKeys:
    """The learner's weight service: its own pair and the authorised client keys (the broker's)."""
    _check_dir(keys_dir)
    secret = keys_dir / f"{WEIGHTS}.key_secret"
    if not secret.is_file():
        raise _missing_weights_pair(secret)
    public, secret_key = read_pair(secret)
    authorized = keys_dir / AUTHORIZED
    if not authorized.is_dir():
        raise KeysError(f"{authorized}: no such directory (public keys of the clients the service accepts)")
    authorized_keys(authorized)
    return ServerKeys(public, secret_key, authorized)


def weights_client_keys(keys_dir: Path) -> ClientKeys:
    """A worker fetching weights: its client pair and the weight service's public key."""
    _check_dir(keys_dir)
    public = keys_dir / f"{WEIGHTS}.key"
    if not public.is_file():
        raise _missing_weights_pair(public)
    pair = read_pair(keys_dir / f"{CLIENT}.key_secret")
    return ClientKeys(pair[0], pair[1], read_public(public))


def configured_client_keys(curve_keys_dir: str) -> ClientKeys | None:
    """The client keys `broker.curve_keys_dir` names; None when it is empty (no CURVE)."""
    return client_keys(Path(curve_keys_dir)) if curve_keys_dir else None


def authorized_keys(directory: Path) -> set[bytes]:
    """The raw 32-byte public keys of every authorized/*.key file (a corrupt one is a KeysError)."""
    return {zmq.utils.z85.decode(read_public(p)) for p in sorted(directory.glob("*.key"))}


def _mint(staging: Path, name: str, target_dir: Path, target_name: str) -> None:
    """A fresh pair `name` created in `staging`, moved to target_dir/target_name.key[_secret]."""
    public, secret = zmq.auth.create_certificates(staging, name)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    target_dir.mkdir(parents=True, exist_ok=True)
    os.replace(public, target_dir / f"{target_name}.key")
    os.replace(secret, target_dir / f"{target_name}.key_secret")


def _refuse_overwrite(paths: list[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise KeysError(f"{existing[0]} exists: not overwriting keys (pass --force to replace them)")


def generate(keys_dir: Path, force: bool = False) -> list[Path]:
    """The broker pair, the default client pair, the weight service's pair and authorized/client.key in
    `keys_dir`; the files made."""
    made = [keys_dir / f"{n}.{ext}" for n in (BROKER, CLIENT, WEIGHTS) for ext in ("key", "key_secret")]
    made.append(keys_dir / AUTHORIZED / f"{CLIENT}.key")
    _refuse_overwrite(made, force)
    keys_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=keys_dir, prefix=".staging-") as tmp:  # mode 0700
        for name in (BROKER, CLIENT, WEIGHTS):
            _mint(Path(tmp), name, keys_dir, name)
    (keys_dir / AUTHORIZED).mkdir(exist_ok=True)
    shutil.copyfile(keys_dir / f"{CLIENT}.key", keys_dir / AUTHORIZED / f"{CLIENT}.key")
    return made


def add_client(keys_dir: Path, name: str, force: bool = False) -> Path:
    """A new client pair `name`: authorized/NAME.key, and clients/NAME/ holding broker.key, weights.key
    and the pair as client.key / client.key_secret (copy that directory to the client's host).
    Returns clients/NAME."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or name == BROKER:
        raise KeysError(f"client name {name!r}: expected a plain file name other than {BROKER!r}")
    broker_public = keys_dir / f"{BROKER}.key"
    if not broker_public.is_file():
        raise KeysError(
            f"{broker_public}: no such file (make the broker's keys first: april keys generate DIR)"
        )
    read_public(broker_public)
    out = keys_dir / CLIENTS / name
    _refuse_overwrite([keys_dir / AUTHORIZED / f"{name}.key", out / f"{CLIENT}.key_secret"], force)
    with tempfile.TemporaryDirectory(dir=keys_dir, prefix=".staging-") as tmp:
        _mint(Path(tmp), name, out, CLIENT)
    shutil.copyfile(broker_public, out / f"{BROKER}.key")
    if (keys_dir / f"{WEIGHTS}.key").is_file():  # a directory made before the weight service had keys
        shutil.copyfile(keys_dir / f"{WEIGHTS}.key", out / f"{WEIGHTS}.key")
    (keys_dir / AUTHORIZED).mkdir(exist_ok=True)
    shutil.copyfile(out / f"{CLIENT}.key", keys_dir / AUTHORIZED / f"{name}.key")
    return out


def add_weights(keys_dir: Path, force: bool = False) -> list[Path]:
    """The weight service's pair alone (a key directory made before it had one); the files made."""
    _check_dir(keys_dir)
    made = [keys_dir / f"{WEIGHTS}.key", keys_dir / f"{WEIGHTS}.key_secret"]
    _refuse_overwrite(made, force)
    with tempfile.TemporaryDirectory(dir=keys_dir, prefix=".staging-") as tmp:
        _mint(Path(tmp), WEIGHTS, keys_dir, WEIGHTS)
    for client_dir in sorted((keys_dir / CLIENTS).glob("*/")):  # every copyable client directory too
        shutil.copyfile(made[0], client_dir / f"{WEIGHTS}.key")
    return made
