"""Tests for learner.advantages: group advantages and DAPO's overlong penalty.

`group_advantages` is compared with a slow reference in exact rational arithmetic (`fractions.Fraction`:
the mean and the squared deviations carry no rounding, only the final square root and division do), on
fixed cases and on hypothesis-drawn groups. An all-equal group must give exactly 0, in float32 too, where
a rounded mean once gave seven rewards of 0.1 an advantage of -0.0074 each.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from april.config import Algorithm
from learner.advantages import group_advantages, overlong_penalty

ALGOS = list(Algorithm)
EPS = 1e-6  # group_advantages' default, what the learner uses
ULP = 2.0**-52  # float64 machine epsilon


def reference_advantages(row: list[float], algorithm: Algorithm, eps: float) -> list[float]:
    """One group's advantages from its float64 rewards, with an exact mean and an exact variance."""
    exact = [Fraction(r) for r in row]
    mean = sum(exact, Fraction(0)) / len(exact)
    centred = [r - mean for r in exact]
    if algorithm == Algorithm.DR_GRPO:
        return [float(c) for c in centred]
    if len(row) == 1:
        return [0.0]
    std = math.sqrt(float(sum((c * c for c in centred), Fraction(0)) / (len(row) - 1)))
    if eps == 0 and std == 0:
        return [0.0] * len(row)
    return [float(c) / (std + eps) for c in centred]


def rounding_bound(row: list[float], algorithm: Algorithm, shift: float = 0.0) -> float:
    """How far float64 arithmetic may move an advantage: every reward (and the mean) within a few ulps
    of the largest magnitude involved, divided by what divides the centred rewards."""
    scale = max(abs(r) for r in row) + abs(shift)
    if algorithm == Algorithm.DR_GRPO or len(row) == 1:
        divisor = 1.0
    else:
        ref = reference_advantages(row, Algorithm.DR_GRPO, 0.0)
        divisor = math.sqrt(sum(c * c for c in ref) / (len(row) - 1)) + EPS
    return 8 * len(row) * ULP * scale / divisor


def test_group_advantages_match_the_exact_reference() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (6, 5), generator=g).double() + 0.1 * torch.rand(6, 5, generator=g).double()
    rewards[0] = 1.0  # a uniform group
    rewards[1] = 0.1  # a uniform group of a fraction that float64 does not hold exactly
    for algorithm in ALGOS:
        got = group_advantages(rewards, algorithm, EPS)
        assert got.dtype == torch.float64
        for gi, row in enumerate(rewards.tolist()):
            want = reference_advantages(row, algorithm, EPS)
            bound = rounding_bound(row, algorithm)
            for j, w in enumerate(want):
                assert abs(float(got[gi, j]) - w) <= bound, (algorithm, gi, j, float(got[gi, j]), w)
        assert bool((got[:2] == 0).all())
    assert bool((group_advantages(torch.ones(3, 1), Algorithm.GRPO) == 0).all())
    zero_eps = group_advantages(rewards, Algorithm.GRPO, eps=0.0)
    assert bool(torch.isfinite(zero_eps).all()) and bool((zero_eps[:2] == 0).all())
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([[1.0, float("nan")]]), Algorithm.GRPO)
    with pytest.raises(ValueError, match=r"expected \[G, n>=1\]"):
        group_advantages(torch.ones(4), Algorithm.GRPO)
    with pytest.raises(ValueError, match="expected a floating dtype"):
        group_advantages(torch.ones(2, 3, dtype=torch.int64), Algorithm.GRPO)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("size", [2, 3, 5, 7, 8, 16, 64])
def test_an_all_equal_group_of_fractional_rewards_gets_exactly_zero(size: int, dtype: torch.dtype) -> None:
    values = [0.1, 0.7, -0.3, 1 / 3, 1.0 - 4 / 6 * 0.5, 1e-3, 123.456, -2.5e-7]
    rewards = torch.tensor(values, dtype=dtype)[:, None].expand(len(values), size).contiguous()
    for algorithm in ALGOS:
        got = group_advantages(rewards, algorithm)
        assert got.dtype == dtype
        assert bool((got == 0).all()), (algorithm, got[(got != 0).any(dim=1)])


def test_an_overlong_penalised_uniform_group_next_to_a_mixed_one() -> None:
    # a group whose 7 responses all ran 18 of 20 tokens (buffer 6, penalty 0.5) and were all right: reward
    # 1 - 4/6 * 0.5 each in float32; beside it a group with one response of 10 tokens (no penalty)
    lengths = torch.tensor([[18] * 7, [18] * 6 + [10]])
    rewards = 1.0 + overlong_penalty(lengths.reshape(-1), 20, 6, 0.5).reshape(2, 7)
    assert rewards.dtype == torch.float32 and float(rewards[0, 0]) != round(float(rewards[0, 0]))
    got = group_advantages(rewards, Algorithm.DAPO)
    assert bool((got[0] == 0).all())
    assert float(got[1, 6]) > 2 and bool((got[1, :6] < 0).all())  # the short response is the good one


@st.composite
def groups(draw: st.DrawFn) -> list[float]:
    """One group's float64 rewards; often with ties, sometimes all equal (a few typical values mixed in)."""
    n = draw(st.integers(1, 16))
    typical = st.sampled_from([0.0, 0.1, 1.0, -1.0, 0.5, 1 / 3, -0.3333333, 0.7])
    value = st.one_of(typical, st.floats(-100.0, 100.0, allow_nan=False, allow_infinity=False))
    if draw(st.booleans()):
        return [draw(value)] * n
    return draw(st.lists(value, min_size=n, max_size=n))


@settings(max_examples=300, deadline=None)
@given(row=groups(), algorithm=st.sampled_from(ALGOS))
def test_advantages_equal_the_exact_reference(row: list[float], algorithm: Algorithm) -> None:
    got = group_advantages(torch.tensor([row], dtype=torch.float64), algorithm)[0].tolist()
    want = reference_advantages(row, algorithm, EPS)
    bound = rounding_bound(row, algorithm)
    assert all(abs(a - b) <= bound for a, b in zip(got, want, strict=True)), (got, want, bound)
    if len(set(row)) == 1:
        assert all(a == 0.0 for a in got)


@settings(max_examples=300, deadline=None)
@given(
    row=groups(),
    shift=st.floats(-1000.0, 1000.0, allow_nan=False, allow_infinity=False),
    algorithm=st.sampled_from(ALGOS),
)
def test_a_constant_added_to_a_group_leaves_its_advantages(
    row: list[float], shift: float, algorithm: Algorithm
) -> None:
    rewards = torch.tensor([row], dtype=torch.float64)
    base = group_advantages(rewards, algorithm)[0]
    shifted = group_advantages(rewards + shift, algorithm)[0]
    bound = 2 * rounding_bound(row, algorithm, shift)  # r + shift is rounded once more, then as above
    assert float((base - shifted).abs().max()) <= bound, (base, shifted, bound)


def test_overlong_penalty_matches_dapo_formula() -> None:
    max_new, buffer, penalty = 20, 6, 0.5
    lengths = torch.arange(0, 25)
    got = overlong_penalty(lengths, max_new, buffer, penalty)
    for length, value in zip(lengths.tolist(), got.tolist(), strict=True):
        if length <= max_new - buffer:
            want = 0.0
        elif length <= max_new:
            want = (max_new - buffer - length) / buffer * penalty
        else:
            want = -penalty
        assert abs(value - want) < 1e-6, (length, value, want)
    assert float(got[max_new]) == pytest.approx(-penalty)
    assert bool((overlong_penalty(lengths, max_new, 0) == torch.where(lengths > max_new, -1.0, 0.0)).all())
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 10, 11)
