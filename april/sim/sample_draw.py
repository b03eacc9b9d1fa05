"""The simulated length of a sample, drawn from its identity: what the sim engine and `april simulate` share.

A sample's total response length is drawn from the length spec with a generator seeded by
`(seed, key)`, where `key = sample_key(group_id, index)`: the same on any worker, after any number of
resumes, and in the simulator, so `april bench --engine sim` and `april simulate` see the very same samples.
Also the 64-bit mixer the sim engine uses for its token ids. Pure numpy; knows nothing of engines.

Prompt correlation (`LengthDraw` with `prompt_corr` rho > 0): real response lengths are mostly a property
of the prompt (a hard problem gets long answers every epoch). A Gaussian copula models it without
changing the spec's distribution: a sample's length is the spec's quantile at Phi(rho z_p + sqrt(1 - rho^2)
z_s), with z_p drawn from the prompt's identity (`prompt_key`: its token ids, so the prompt recurs with its
length every epoch) and z_s from the sample's. Each length still follows the spec (up to the quantile
table's resolution); two samples of one prompt have latent correlation rho^2... rho = 0 is the
independent draw above, unchanged.
"""

from __future__ import annotations

import hashlib
import math
from typing import Protocol

import numpy as np
import numpy.typing as npt

MASK64 = (1 << 64) - 1


class LengthSampler(Protocol):
    """What `actors.lengths.LengthSpec` offers: n response lengths (>= 1) from `rng`."""

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]: ...


def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """A good 64-bit mixer, vectorised (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def mix(*values: int) -> int:
    h = np.zeros(1, dtype=np.uint64)
    for v in values:
        h = splitmix64(h ^ np.uint64(v & MASK64))
    return int(h[0])


def sample_key(group_id: int, index: int) -> int:
    """The identity of sample (group_id, index), stable across resumes and workers."""
    return mix(group_id, index)


def draw_length(lengths: LengthSampler, seed: int, key: int) -> int:
    """The total response length of the sample with identity `key` under `seed`."""
    rng = np.random.default_rng([seed & MASK64, key & MASK64])
    return int(lengths.sample(rng, 1)[0])


QUANTILE_POINTS = 1 << 16  # draws behind the spec's quantile table (prompt-correlated lengths)


def prompt_key(prompt_ids: npt.NDArray[np.int32]) -> int:
    """The identity of a prompt: a digest of its token ids (the same prompt in every epoch)."""
    data = np.ascontiguousarray(prompt_ids, dtype=np.int32).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class LengthDraw:
    """The one rule for a simulated sample's total length: `(key, prompt) -> length` (module docstring)."""

    def __init__(self, lengths: LengthSampler, seed: int, prompt_corr: float = 0.0) -> None:
        if not 0.0 <= prompt_corr < 1.0:
            raise ValueError(f"prompt_corr = {prompt_corr!r}, expected a number in [0, 1)")
        self.lengths, self.seed, self.prompt_corr = lengths, seed, prompt_corr
        self._table: npt.NDArray[np.int64] | None = None

    def __call__(self, key: int, prompt: int) -> int:
        if self.prompt_corr == 0.0:
            return draw_length(self.lengths, self.seed, key)
        if self._table is None:
            rng = np.random.default_rng([self.seed & MASK64, QUANTILE_POINTS])
            self._table = np.sort(np.asarray(self.lengths.sample(rng, QUANTILE_POINTS), dtype=np.int64))
        z_p = np.random.default_rng([self.seed & MASK64, prompt & MASK64, 1]).standard_normal()
        z_s = np.random.default_rng([self.seed & MASK64, key & MASK64]).standard_normal()
        rho = self.prompt_corr
        z = rho * z_p + math.sqrt(1.0 - rho * rho) * z_s
        u = 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
        return int(self._table[min(QUANTILE_POINTS - 1, int(u * QUANTILE_POINTS))])
