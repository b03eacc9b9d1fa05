"""The simulated length of a sample, drawn from its identity: what the sim engine and `april simulate` share.

A sample's total response length is drawn from the length spec with a generator seeded by
`(seed, key)`, where `key = sample_key(group_id, index)`: the same on any worker, after any number of
resumes, and in the simulator, so `april bench --engine sim` and `april simulate` see the very same samples.
Also the 64-bit mixer the sim engine uses for its token ids. Pure numpy; knows nothing of engines.
"""

from __future__ import annotations

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
