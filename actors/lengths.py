"""Response-length distributions for the simulation engine and the planner, parsed from one-line specs,
and recorded episodes for the simulator's multi-turn workloads.

Owns the spec grammar, its one-line errors, and sampling; and the file format of recorded episodes
(`EpisodeFile`). Knows nothing about engines, tokens or time. The same grammar describes any whole
quantity >= 1: response lengths, model turns per episode, a tool call's milliseconds.

Grammar (whitespace around separators is ignored):

    fixed:N                                   every response has N tokens
    uniform:min=A,max=B                       a whole number from A to B (both included), equally likely
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

_KINDS = (
    "fixed:N, uniform:min=A,max=B, lognormal:median=M,sigma=S[,cap=C], mixture:W*SPEC+W*SPEC..., file:PATH"
)
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
        if kind == "uniform":
            return _parse_uniform(text, rest)
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
class UniformLength(LengthSpec):
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise LengthSpecError(f"length spec {self.describe()}: expected 1 <= min <= max")

    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)

    def describe(self) -> str:
        return f"uniform:min={self.low},max={self.high}"


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


def _params(text: str, rest: str, known: tuple[str, ...], required: tuple[str, ...]) -> dict[str, str]:
    """`key=value` items of a spec, each in `known`, all of `required` present."""
    params: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in known:
            expected = ", ".join(f"{k}=" for k in known)
            raise LengthSpecError(f"length spec {text!r}: bad item {item.strip()!r} (expected {expected})")
        params[key] = value
    missing = [k for k in required if k not in params]
    if missing:
        raise LengthSpecError(f"length spec {text!r}: missing {', '.join(missing)}")
    return params


def _parse_uniform(text: str, rest: str) -> UniformLength:
    params = _params(text, rest, ("min", "max"), ("min", "max"))
    return UniformLength(_int(text, "min", params["min"]), _int(text, "max", params["max"]))


def _parse_lognormal(text: str, rest: str) -> LogNormalLength:
    params = _params(text, rest, ("median", "sigma", "cap"), ("median", "sigma"))
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


# One recorded episode: model tokens per turn, tool ms per call, observation tokens per call (None: absent)
Episode = tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...] | None]


@dataclass(frozen=True, slots=True, eq=False)
class EpisodeFile:
    """Recorded episodes, drawn whole (uniformly): one JSON object a line, `#` lines are comments:

        {"turns": [412, 96, 1503], "tool_ms": [850, 12000], "observation_tokens": [40, 210]}

    `turns`: model tokens of each turn (>= 1, at least one turn); `tool_ms`: milliseconds (>= 0) of each
    tool call, one between each two turns; `observation_tokens` (optional): tokens (>= 1) of each tool
    result, one per call (absent: the simulator draws them)."""

    path: str
    episodes: tuple[Episode, ...] = field(repr=False)

    @staticmethod
    def load(path: str) -> EpisodeFile:
        where = f"episode file {path}"
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise LengthSpecError(f"{where}: cannot read ({e.strerror or e})") from None
        episodes = tuple(
            _episode(where, i + 1, line)
            for i, line in enumerate(lines)
            if line.strip() and not line.lstrip().startswith("#")
        )
        if not episodes:
            raise LengthSpecError(f"{where}: no episodes in file")
        return EpisodeFile(path, episodes)

    def episode(self, rng: np.random.Generator) -> Episode:
        """One recorded episode: turn tokens, tool ms, observation tokens (None: not recorded)."""
        return self.episodes[int(rng.integers(0, len(self.episodes)))]

    def describe(self) -> str:
        return self.path


def _episode(where: str, lineno: int, line: str) -> Episode:
    at = f"{where}: line {lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        raise LengthSpecError(f"{at} is not valid JSON") from None
    if not isinstance(row, dict):
        raise LengthSpecError(f'{at}: got {line.strip()[:40]!r}, expected an object with "turns"')
    turns = _numbers(at, row, "turns", whole=True, least=1)
    if turns is None or not turns:
        raise LengthSpecError(f'{at}: expected "turns", a non-empty list of model tokens per turn')
    calls = len(turns) - 1
    tool_ms = _numbers(at, row, "tool_ms", whole=False, least=0)
    observations = _numbers(at, row, "observation_tokens", whole=True, least=1)
    for name, values in (("tool_ms", tool_ms), ("observation_tokens", observations)):
        if (values is not None or name == "tool_ms") and len(values or ()) != calls:
            raise LengthSpecError(
                f'{at}: "{name}" has {len(values or ())} entries, expected {calls} (one per tool call '
                "between two turns)"
            )
    return (
        tuple(int(t) for t in turns),
        tuple(tool_ms or ()),
        None if observations is None else tuple(int(o) for o in observations),
    )


def _numbers(at: str, row: dict[str, object], name: str, whole: bool, least: int) -> list[float] | None:
    """The list `row[name]` (None when absent), each entry a number >= `least` (whole when `whole`)."""
    values = row.get(name)
    if values is None:
        return None
    numbers = [
        float(v)
        for v in (values if isinstance(values, list) else [None])
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    if (
        not isinstance(values, list)
        or len(numbers) != len(values)
        or not all(math.isfinite(v) and v >= least and (not whole or v == int(v)) for v in numbers)
    ):
        kind = "whole numbers" if whole else "numbers"
        raise LengthSpecError(f'{at}: "{name}" = {str(values)[:40]}, expected a list of {kind} >= {least}')
    return numbers
