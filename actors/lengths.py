"""Response-length distributions for the simulation engine and the planner, parsed from one-line specs.

Owns the spec grammar, its one-line errors, and sampling. Knows nothing about engines, tokens or time.

Grammar (whitespace around separators is ignored):

    fixed:N                                   every response has N tokens
    lognormal:median=M,sigma=S[,cap=C]        round(M * exp(S * z)), z ~ N(0, 1), clipped to [1, C]
    mixture:W1*SPEC1+W2*SPEC2[+...]           pick component i with probability Wi / sum(W), draw from it
    file:PATH                                 draw uniformly from the lengths in PATH: one int per line,
                                              or JSON lines with a "response_len" (or "len") field

Mixture components may be any spec but another mixture, e.g.
`mixture:0.9*lognormal:median=500,sigma=0.6,cap=16384+0.1*lognormal:median=8000,sigma=0.5,cap=16384`.
Every drawn length is at least 1 (a response holds at least its stop token). `describe()` gives the
canonical spec string, which parses back to the same distribution.

No torch; numpy only.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

Lengths = npt.NDArray[np.int64]

_KINDS = "fixed:N, lognormal:median=M,sigma=S[,cap=C], mixture:W*SPEC+W*SPEC..., file:PATH"
# A mixture splits on "+" only where a "<weight>*" follows, so a file path may contain "+".
_MIXTURE_SPLIT = re.compile(r"\+(?=\s*[0-9.eE+-]+\s*\*)")


class LengthSpecError(ValueError):
    """A length spec that does not parse or describes no distribution. One readable line."""


class LengthSpec(ABC):
    """A distribution of response lengths (tokens, >= 1)."""

    @abstractmethod
    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        """n lengths, shape (n,), int64, each >= 1."""

    @abstractmethod
    def describe(self) -> str:
        """The canonical spec string (parses back to an equal distribution)."""

    @staticmethod
    def parse(text: str) -> LengthSpec:
        """Parse a spec string; raise LengthSpecError naming what is wrong."""
        text = text.strip()
        kind, sep, rest = text.partition(":")
        kind = kind.strip().lower()
        if not sep:
            raise LengthSpecError(f"length spec {text!r}: missing 'kind:' prefix (expected one of {_KINDS})")
        if kind == "fixed":
            return FixedLength(_int(text, "N", rest))
        if kind == "lognormal":
            return _parse_lognormal(text, rest)
        if kind == "mixture":
            return _parse_mixture(text, rest)
        if kind == "file":
            return EmpiricalLength.load(rest.strip())
        raise LengthSpecError(f"length spec {text!r}: unknown kind {kind!r} (expected one of {_KINDS})")

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True, slots=True)
class FixedLength(LengthSpec):
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise LengthSpecError(f"length spec fixed:{self.n}: N must be >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        return np.full(n, self.n, dtype=np.int64)

    def describe(self) -> str:
        return f"fixed:{self.n}"


@dataclass(frozen=True, slots=True)
class LogNormalLength(LengthSpec):
    median: float
    sigma: float
    cap: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median > 0):
            raise LengthSpecError(f"length spec {self.describe()}: median must be > 0")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise LengthSpecError(f"length spec {self.describe()}: sigma must be >= 0")
        if self.cap is not None and self.cap < 1:
            raise LengthSpecError(f"length spec {self.describe()}: cap must be >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        z = rng.standard_normal(n)
        x = np.rint(self.median * np.exp(self.sigma * z))
        hi = float(self.cap) if self.cap is not None else float(np.iinfo(np.int32).max)
        return np.clip(x, 1.0, hi).astype(np.int64)

    def describe(self) -> str:
        cap = "" if self.cap is None else f",cap={self.cap}"
        return f"lognormal:median={self.median:g},sigma={self.sigma:g}{cap}"


@dataclass(frozen=True, slots=True)
class MixtureLength(LengthSpec):
    weights: tuple[float, ...]  # normalised to sum 1
    components: tuple[LengthSpec, ...]

    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        which = rng.choice(len(self.components), size=n, p=np.asarray(self.weights))
        out = np.empty(n, dtype=np.int64)
        for i, comp in enumerate(self.components):
            mask = which == i
            out[mask] = comp.sample(rng, int(mask.sum()))
        return out

    def describe(self) -> str:
        parts = (f"{w:g}*{c.describe()}" for w, c in zip(self.weights, self.components, strict=True))
        return "mixture:" + "+".join(parts)


@dataclass(frozen=True, slots=True, eq=False)
class EmpiricalLength(LengthSpec):
    """Bootstrap from observed lengths (e.g. response_len of a past run's samples)."""

    path: str
    lengths: Lengths = field(repr=False)

    @staticmethod
    def load(path: str) -> EmpiricalLength:
        where = f"length spec file:{path}"
        if not path:
            raise LengthSpecError(f"{where}: missing path")
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise LengthSpecError(f"{where}: cannot read ({e.strerror or e})") from None
        values = [  # blank lines and '#' comments (e.g. how the lengths were measured) are skipped
            _file_value(where, i + 1, line)
            for i, line in enumerate(lines)
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if not values:
            raise LengthSpecError(f"{where}: no lengths in file")
        return EmpiricalLength(path, np.asarray(values, dtype=np.int64))

    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        return self.lengths[rng.integers(0, len(self.lengths), size=n)]

    def describe(self) -> str:
        return f"file:{self.path}"


def _file_value(where: str, lineno: int, line: str) -> int:
    line = line.strip()
    value: object = line
    if line.startswith("{"):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise LengthSpecError(f"{where}: line {lineno} is not valid JSON") from None
        value = row.get("response_len", row.get("len"))
        if value is None:
            raise LengthSpecError(f'{where}: line {lineno} has no "response_len" or "len" field')
    try:
        n: int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise LengthSpecError(f"{where}: line {lineno}: got {line[:40]!r}, expected an integer") from None
    if n < 1:
        raise LengthSpecError(f"{where}: line {lineno}: length {n} must be >= 1")
    return n


def _int(text: str, name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise LengthSpecError(
            f"length spec {text!r}: {name} = {value.strip()!r}, expected an integer"
        ) from None


def _float(text: str, name: str, value: str) -> float:
    try:
        return float(value.strip())
    except ValueError:
        raise LengthSpecError(
            f"length spec {text!r}: {name} = {value.strip()!r}, expected a number"
        ) from None


def _parse_lognormal(text: str, rest: str) -> LogNormalLength:
    params: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("median", "sigma", "cap"):
            raise LengthSpecError(
                f"length spec {text!r}: bad item {item.strip()!r} (expected median=, sigma=, cap=)"
            )
        params[key] = value
    missing = [k for k in ("median", "sigma") if k not in params]
    if missing:
        raise LengthSpecError(f"length spec {text!r}: missing {', '.join(missing)}")
    cap = _int(text, "cap", params["cap"]) if "cap" in params else None
    return LogNormalLength(
        _float(text, "median", params["median"]), _float(text, "sigma", params["sigma"]), cap
    )


def _parse_mixture(text: str, rest: str) -> MixtureLength:
    weights: list[float] = []
    components: list[LengthSpec] = []
    for part in _MIXTURE_SPLIT.split(rest):
        w, star, spec = part.partition("*")
        if not star:
            raise LengthSpecError(f"length spec {text!r}: component {part.strip()!r} is not WEIGHT*SPEC")
        weight = _float(text, "weight", w)
        if not (math.isfinite(weight) and weight > 0):
            raise LengthSpecError(f"length spec {text!r}: weight {weight:g} must be > 0")
        if spec.strip().lower().startswith("mixture:"):
            raise LengthSpecError(f"length spec {text!r}: a mixture cannot contain a mixture")
        weights.append(weight)
        components.append(LengthSpec.parse(spec))
    total = sum(weights)
    return MixtureLength(tuple(w / total for w in weights), tuple(components))
