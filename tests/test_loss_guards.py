"""The loss's guards (learner.losses): each against the slow loop reference of tests/test_losses.py, and
each with the failure it prevents.

- log-ratio clamp: a float32 token at log(pi / pi_beh) = 89 makes the loss inf without it;
- dual-clip: a token at log-ratio 19 with a negative advantage has a gradient ~1e8 times a normal token's;
- IS weight levels (token, sequence product, geometric mean) and rejection bounds for tis and decoupled,
  and decoupled's default bound (an off-policy weight of e^10 otherwise drives the whole gradient);
- masks by torch.where: a `mask`-ed token with a huge ratio made the loss NaN;
- the KL estimators: their expectations and expected gradients, computed exactly over a small vocabulary,
  are what `kl_estimate`'s docstring says; a drifted token's gradient (|d| = 5, 50) is the textbook
  formula's (float64 autograd), except on k3's capped side, where it is 0 as documented.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from test_losses import ALGOS, CUR, TOL, random_inputs, run_both
from torch import Tensor

from april.config import (
    AlgoConfig,
    Algorithm,
    Config,
    ConfigError,
    ISLevel,
    KLEstimator,
    LearnerConfig,
    OffPolicy,
    load_config,
)
from learner.losses import LossConfig, kl_estimate, policy_loss
from learner.model_trainer import loss_config

OFF: dict[str, Any] = {"log_ratio_clamp": 0.0, "clip_ratio_c": 0.0, "kl_clamp": 0.0}  # every guard off

# (offpolicy, guard settings, which stat shows the guard engaged)
VARIANTS: dict[str, tuple[OffPolicy, dict[str, Any], str]] = {
    "tis-token-bounds": (OffPolicy.TIS, {"is_mask_low": 0.6, "is_mask_high": 1.5}, "is_masked_frac"),
    "decoupled-token-bounds": (
        OffPolicy.DECOUPLED,
        {"is_mask_low": 0.6, "is_mask_high": 1.5},
        "is_masked_frac",
    ),
    "tis-sequence": (OffPolicy.TIS, {"is_level": ISLevel.SEQUENCE, "tis_cap": 3.0}, ""),
    "decoupled-sequence-bounds": (
        OffPolicy.DECOUPLED,
        {"is_level": ISLevel.SEQUENCE, "is_mask_low": 0.3, "is_mask_high": 3.0},
        "is_masked_frac",
    ),
    "decoupled-geometric-bounds": (
        OffPolicy.DECOUPLED,
        {"is_level": ISLevel.GEOMETRIC, "is_mask_low": 0.9, "is_mask_high": 1.1},
        "is_masked_frac",
    ),
    "none-dual-clip": (OffPolicy.NONE, {"clip_ratio_c": 1.5}, "dual_clip_frac"),
    "mask-tight-clamp": (OffPolicy.MASK, {"log_ratio_clamp": 0.3, "clip_ratio_c": 1.2}, "dual_clip_frac"),
    # kl_clamp leaves k1 and k2 alone, and caps k3 where d < 0 only (the reference says the same)
    "tis-k1": (OffPolicy.TIS, {"kl_estimator": KLEstimator.K1, "kl_clamp": 0.1}, ""),
    "tis-k2": (OffPolicy.TIS, {"kl_estimator": KLEstimator.K2, "kl_clamp": 0.02}, ""),
    "none-k3-clamped": (OffPolicy.NONE, {"kl_estimator": KLEstimator.K3, "kl_clamp": 0.02}, ""),
    "decoupled-guards-off": (OffPolicy.DECOUPLED, OFF, ""),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("algorithm", ALGOS, ids=[a.value for a in ALGOS])
def test_guards_match_loop_reference(algorithm: Algorithm, variant: str) -> None:
    offpolicy, guards, engaged = VARIANTS[variant]
    eps = (0.25, 0.35) if algorithm == Algorithm.GSPO else (0.2, 0.28)
    cfg = LossConfig(
        **{
            "algorithm": algorithm,
            "offpolicy": offpolicy,
            "tis_cap": 1.5,
            "eps_low": eps[0],
            "eps_high": eps[1],
            "max_new_tokens": 12,
            "kl_coef": 0.1,
            "entropy_coef": 0.01,
            **guards,
        }
    )
    seen = 0.0
    for seed in range(3):
        x = random_inputs(seed)
        loss, ref, grad, ref_grad, stats = run_both(x, cfg, n_samples=11, n_tokens=int(x["mask"].sum()) + 17)
        assert abs(float(loss) - float(ref)) < TOL, (seed, float(loss), float(ref))
        assert torch.allclose(grad, ref_grad, atol=TOL, rtol=0), (seed, (grad - ref_grad).abs().max())
        assert bool((grad[~x["mask"]] == 0).all())
        if engaged:
            seen += stats.metrics()[engaged]
    if engaged and not (algorithm == Algorithm.GSPO and engaged == "dual_clip_frac"):
        assert seen > 0, f"{engaged} never engaged: the case tests nothing"


# ---------------------------------------------------------------------------------------------------
# the failures the guards prevent, on a 6,400-token float32 batch


def spike_batch(log_ratio: float, advantage: float, offpolicy_old: bool = False) -> dict[str, Tensor]:
    """64 x 100 float32 tokens near ratio 1; token (0, 0) at `log_ratio`; advantages +-1 by sample."""
    g = torch.Generator().manual_seed(0)
    beh = -torch.rand(64, 100, generator=g) - 0.5
    new = beh + 0.01 * torch.randn(64, 100, generator=g)
    new[0, 0] = beh[0, 0] + log_ratio
    adv = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)
    adv[0] = advantage
    versions = torch.full((64, 100), CUR, dtype=torch.int64)
    if offpolicy_old:
        versions[0, 0] = CUR - 1
    return {
        "new": new,
        "beh": beh,
        "adv": adv,
        "mask": torch.ones(64, 100, dtype=torch.bool),
        "versions": versions,
    }


def spike_loss(x: dict[str, Tensor], cfg: LossConfig) -> tuple[Tensor, Tensor]:
    new = x["new"].clone().requires_grad_(True)
    loss, _ = policy_loss(new, x["beh"], None, x["adv"], x["mask"], x["versions"], CUR, cfg)
    (grad,) = torch.autograd.grad(loss, new)
    return loss.detach(), grad


def test_log_ratio_clamp_keeps_a_float32_loss_finite() -> None:
    x = spike_batch(89.0, -1.0)  # exp(89) overflows float32
    loss, _ = spike_loss(x, LossConfig(algorithm=Algorithm.DAPO, **OFF))
    assert not math.isfinite(float(loss))  # what happens without the clamp
    loss, grad = spike_loss(x, LossConfig(algorithm=Algorithm.DAPO, log_ratio_clamp=20.0, clip_ratio_c=0.0))
    assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())
    assert float(grad[0, 0]) == 0.0  # outside the clamp: no gradient
    assert LossConfig().log_ratio_clamp == 20.0 and LossConfig.from_algo(AlgoConfig()).log_ratio_clamp == 20.0


def test_dual_clip_bounds_a_negative_advantage_token() -> None:
    x = spike_batch(19.0, -1.0)
    _, grad = spike_loss(x, LossConfig(algorithm=Algorithm.DAPO, clip_ratio_c=0.0))
    rest = grad.abs().flatten()[1:].max()
    assert float(grad[0, 0].abs() / rest) > 1e6  # without the dual clip: one token drives the update
    loss, grad = spike_loss(x, LossConfig(algorithm=Algorithm.DAPO))  # default clip_ratio_c = 3
    assert float(grad[0, 0]) == 0.0
    # its loss is exactly c |A| / N_tok: the same batch with that token at ratio 1 (loss 1 x |A|) differs by
    # (3 - 1) / 6400
    x1 = dict(x, new=x["new"].clone())
    x1["new"][0, 0] = x["beh"][0, 0]
    loss1, _ = spike_loss(x1, LossConfig(algorithm=Algorithm.DAPO))
    assert float(loss - loss1) == pytest.approx(2.0 / 6400, rel=1e-3)
    # a positive advantage is bounded by the ordinary clip already: the dual clip leaves it alone
    xp = spike_batch(19.0, 1.0)
    assert torch.equal(spike_loss(xp, LossConfig())[1], spike_loss(xp, LossConfig(clip_ratio_c=0.0))[1])
    assert LossConfig.from_algo(AlgoConfig()).clip_ratio_c == 3.0


def test_a_masked_token_with_a_huge_ratio_leaves_the_loss_finite() -> None:
    # offpolicy `mask` drops the old token (0, 0); its ratio exp(100) is inf in float32 and was multiplied by
    # 0, giving NaN; every guard off, so the torch.where masking alone must hold
    x = spike_batch(100.0, -1.0, offpolicy_old=True)
    cfg = LossConfig(algorithm=Algorithm.DAPO, offpolicy=OffPolicy.MASK, **OFF)
    loss, grad = spike_loss(x, cfg)
    assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())
    assert float(grad[0, 0]) == 0.0
    x0 = dict(x, new=x["new"].clone())
    x0["new"][0, 0] = x["beh"][0, 0]  # the masked token's value cannot matter
    assert float(loss) == float(spike_loss(x0, cfg)[0])


# ---------------------------------------------------------------------------------------------------
# importance weights


def is_batch(old_log_w: float) -> dict[str, Tensor]:
    """Decoupled inputs: every token at weight ~1 but token (0, 0), at log(pi_prox / pi_beh) = old_log_w."""
    x = spike_batch(0.0, 1.0)
    prox = x["new"].detach().clone()
    beh = prox.clone()
    beh[0, 0] = prox[0, 0] - old_log_w
    return {**x, "prox": prox, "beh": beh, "new": prox + 0.01}


def is_loss(x: dict[str, Tensor], cfg: LossConfig) -> tuple[Tensor, Tensor, Any]:
    new = x["new"].clone().requires_grad_(True)
    loss, stats = policy_loss(new, x["beh"], x["prox"], x["adv"], x["mask"], x["versions"], CUR, cfg)
    (grad,) = torch.autograd.grad(loss, new)
    return loss.detach(), grad, stats


def test_decoupled_weights_are_bounded_by_default() -> None:
    x = is_batch(10.0)
    uncapped = LossConfig(algorithm=Algorithm.DAPO, offpolicy=OffPolicy.DECOUPLED)
    _, grad, stats = is_loss(x, uncapped)
    assert float(grad[0, 0].abs() / grad.abs().flatten()[1:].max()) > 1e4  # e^10: one token drives the step
    default = LossConfig.from_algo(AlgoConfig(algorithm=Algorithm.DAPO, offpolicy=OffPolicy.DECOUPLED))
    assert default.is_mask_high == 5.0  # AReaL's behav_imp_weight_cap in its examples
    assert LossConfig.from_algo(AlgoConfig(offpolicy=OffPolicy.TIS)).is_mask_high == 0.0  # tis truncates
    assert (
        LossConfig.from_algo(AlgoConfig(offpolicy=OffPolicy.DECOUPLED, is_mask_high=0.0)).is_mask_high == 0.0
    )
    _, grad, stats = is_loss(x, default)
    assert float(grad[0, 0]) == 0.0 and stats.host().is_masked_units == 1
    assert stats.metrics()["is_weight_max"] == pytest.approx(1.0)
    assert bool((grad.flatten()[1:] != 0).all())


@pytest.mark.parametrize("level", list(ISLevel), ids=[level.value for level in ISLevel])
def test_sequence_weights_reject_or_truncate_the_whole_sample(level: ISLevel) -> None:
    x = is_batch(3.0)  # sample 0: one token at e^3; its other 99 at ~1
    tis = LossConfig(algorithm=Algorithm.DAPO, offpolicy=OffPolicy.TIS, tis_cap=2.0, is_level=level)
    _, grad, stats = is_loss(x, tis)
    # the weight of sample 0's tokens: per token e^3 truncated to 2 (others 1); the product e^3 truncated to 2
    # for all its tokens; the geometric mean e^(3/100), under the cap
    want = {ISLevel.TOKEN: 1.0, ISLevel.SEQUENCE: 2.0, ISLevel.GEOMETRIC: math.exp(0.03)}[level]
    assert float(grad[0, 1] / grad[2, 1]) == pytest.approx(want, rel=1e-4)
    dec = LossConfig(
        algorithm=Algorithm.DAPO, offpolicy=OffPolicy.DECOUPLED, is_level=level, is_mask_high=2.0
    )
    _, grad, stats = is_loss(x, dec)
    rejected = {ISLevel.TOKEN: 1, ISLevel.SEQUENCE: 100, ISLevel.GEOMETRIC: 0}[level]
    assert int((grad[0] == 0).sum()) == rejected and stats.host().is_masked_units == rejected


# ---------------------------------------------------------------------------------------------------
# KL estimators: exact expectations over a 6-token vocabulary, sampling from pi_theta


@pytest.mark.parametrize("estimator", list(KLEstimator), ids=[k.value for k in KLEstimator])
def test_kl_estimators_have_the_documented_expected_gradients(estimator: KLEstimator) -> None:
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=g, dtype=torch.float64).requires_grad_(True)
    log_ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    cfg = LossConfig(kl_estimator=estimator, kl_coef=1.0, **OFF)
    log_pi = torch.log_softmax(theta, 0)
    pi = log_pi.exp().detach()  # the sampling distribution: fixed, as rollouts are
    expected = (pi * kl_estimate(log_pi - log_ref, cfg)).sum()
    (got,) = torch.autograd.grad(expected, theta)

    def kl(p_log: Tensor, q_log: Tensor) -> Tensor:
        return (p_log.exp() * (p_log - q_log)).sum()

    reverse = kl(torch.log_softmax(theta, 0), log_ref)  # KL(pi || ref)
    forward = kl(log_ref, torch.log_softmax(theta, 0))  # KL(ref || pi)
    want = {
        KLEstimator.K1: torch.zeros(6, dtype=torch.float64),
        KLEstimator.K2: torch.autograd.grad(reverse, theta)[0],
        KLEstimator.K3: torch.autograd.grad(forward, theta)[0],
    }[estimator]
    assert torch.allclose(got, want, atol=1e-12), (got, want)
    if estimator is not KLEstimator.K2:  # k1 and k3 are unbiased for the value of KL(pi || ref)
        assert float(expected.detach()) == pytest.approx(float(reverse.detach()), abs=1e-12)


def textbook_kl(d: Tensor, estimator: KLEstimator) -> Tensor:
    """The estimators as Schulman's note writes them, without any guard."""
    if estimator is KLEstimator.K1:
        return d
    if estimator is KLEstimator.K2:
        return d * d / 2
    return torch.exp(-d) - 1 + d


def textbook_grad(d: float, estimator: KLEstimator) -> tuple[float, float]:
    """(value, d value / d d) of the textbook formula at d, by float64 autograd."""
    x = torch.tensor(d, dtype=torch.float64, requires_grad=True)
    value = textbook_kl(x, estimator)
    (grad,) = torch.autograd.grad(value, x)
    return float(value.detach()), float(grad)


def estimate_grad(d: float, cfg: LossConfig, dtype: torch.dtype) -> tuple[float, float]:
    x = torch.tensor([d], dtype=dtype, requires_grad=True)
    value = kl_estimate(x, cfg)
    (grad,) = torch.autograd.grad(value.sum(), x)
    return float(value.detach()[0]), float(grad[0])


K3_CAPPED = (-5.0, -50.0)  # k3 > kl_clamp = 10 where d < 0: capped, no gradient (kl_estimate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("d", [5.0, -5.0, 50.0, -50.0])
@pytest.mark.parametrize("estimator", list(KLEstimator), ids=[k.value for k in KLEstimator])
def test_a_drifted_token_keeps_the_textbook_kl_gradient(
    estimator: KLEstimator, d: float, dtype: torch.dtype
) -> None:
    value, grad = estimate_grad(d, LossConfig(kl_estimator=estimator), dtype)  # default guards
    want_value, want_grad = textbook_grad(d, estimator)
    rel = 1e-6 if dtype == torch.float32 else 1e-14
    if estimator is KLEstimator.K3 and d in K3_CAPPED:
        assert value == 10.0 and grad == 0.0 and abs(want_grad) > 100
        return
    assert value == pytest.approx(want_value, rel=rel) and grad == pytest.approx(want_grad, rel=rel)
    assert abs(grad) > 0.99  # when every estimate was clamped, k2 had none at |d| = 5 and 50, k1 none at 50


@pytest.mark.parametrize("d", [5.0, -5.0, 50.0, -50.0])
@pytest.mark.parametrize("estimator", list(KLEstimator), ids=[k.value for k in KLEstimator])
def test_kl_guards_off_give_the_textbook_formula(estimator: KLEstimator, d: float) -> None:
    value, grad = estimate_grad(d, LossConfig(kl_estimator=estimator, **OFF), torch.float64)
    want_value, want_grad = textbook_grad(d, estimator)
    assert value == pytest.approx(want_value, rel=1e-14) and grad == pytest.approx(want_grad, rel=1e-14)


def test_k3_is_capped_from_where_its_value_passes_kl_clamp() -> None:
    # k3(d) = 10 at d = -2.6109: just above it the gradient is the textbook 1 - e^-d (about -12.5); below, 0
    k3 = LossConfig(kl_estimator=KLEstimator.K3)
    value, grad = estimate_grad(-2.60, k3, torch.float64)
    assert value < 10 and grad == pytest.approx(textbook_grad(-2.60, KLEstimator.K3)[1], rel=1e-14)
    assert estimate_grad(-2.62, k3, torch.float64) == (10.0, 0.0)
    wider = LossConfig(kl_estimator=KLEstimator.K3, kl_clamp=20.0)  # the cap moves with kl_clamp
    assert estimate_grad(-2.62, wider, torch.float64)[1] < -12


@pytest.mark.parametrize("d", [5.0, -5.0])
@pytest.mark.parametrize("estimator", list(KLEstimator), ids=[k.value for k in KLEstimator])
def test_the_kl_term_reaches_a_drifted_token_through_the_loss(estimator: KLEstimator, d: float) -> None:
    # float32, 6,400 tokens (dapo: the KL term is summed over tokens / 6,400); the reference model agrees
    # with pi_theta on every token but (0, 0), where log pi_theta - log pi_ref = d
    x = spike_batch(0.0, 1.0)
    ref = x["new"].clone()
    ref[0, 0] = x["new"][0, 0] - d

    def grad_at_token(kl_coef: float) -> float:
        new = x["new"].clone().requires_grad_(True)
        cfg = LossConfig(algorithm=Algorithm.DAPO, kl_estimator=estimator, kl_coef=kl_coef)
        loss, _ = policy_loss(new, x["beh"], None, x["adv"], x["mask"], x["versions"], CUR, cfg, logp_ref=ref)
        (grad,) = torch.autograd.grad(loss, new)
        return float(grad[0, 0])

    kl_part = grad_at_token(0.5) - grad_at_token(0.0)
    capped = estimator is KLEstimator.K3 and d in K3_CAPPED
    want = 0.0 if capped else 0.5 * textbook_grad(d, estimator)[1] / 6400
    assert kl_part == pytest.approx(want, rel=1e-4, abs=1e-9)


def test_kl_clamp_bounds_the_estimate_and_its_gradient() -> None:
    d = torch.tensor([-30.0, 0.5], dtype=torch.float64, requires_grad=True)
    value = kl_estimate(d, LossConfig())  # k3, log_ratio_clamp 20, kl_clamp 10
    v = value.detach()
    assert float(v[0]) == 10.0 and float(v[1]) == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    (grad,) = torch.autograd.grad(value.sum(), d)
    assert float(grad[0]) == 0.0 and float(grad[1]) == pytest.approx(1 - math.exp(-0.5))
    unguarded = kl_estimate(torch.tensor([-100.0]), LossConfig(**OFF))  # float32: exp(100) = inf
    assert not math.isfinite(float(unguarded[0]))
    assert math.isfinite(float(kl_estimate(torch.tensor([-100.0]), LossConfig())[0]))


def test_the_config_reaches_the_loss_with_the_same_defaults() -> None:
    names = ("log_ratio_clamp", "clip_ratio_c", "kl_estimator", "kl_clamp", "is_level", "is_mask_low")
    default = loss_config(Config())
    assert all(getattr(default, n) == getattr(LossConfig(), n) for n in names)
    learner = LearnerConfig(log_ratio_clamp=5.0, clip_ratio_c=2.0, kl_estimator=KLEstimator.K2, kl_clamp=0.0)
    algo = AlgoConfig(offpolicy=OffPolicy.TIS, is_level=ISLevel.GEOMETRIC, is_mask_low=0.1, is_mask_high=4.0)
    got = loss_config(Config(algo=algo, learner=learner))
    assert (got.log_ratio_clamp, got.clip_ratio_c, got.kl_estimator, got.kl_clamp) == (5.0, 2.0, "k2", 0.0)
    assert (got.is_level, got.is_mask_low, got.is_mask_high) == (ISLevel.GEOMETRIC, 0.1, 4.0)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("learner.clip_ratio_c", "0.5", "learner.clip_ratio_c = 0.5: must be > 1 (0 = off)"),
        ("learner.log_ratio_clamp", "-1", "learner.log_ratio_clamp = -1.0: must be >= 0 (0 = off)"),
        ("learner.kl_clamp", "-2", "learner.kl_clamp = -2.0: must be >= 0 (0 = off)"),
        ("learner.kl_estimator", "k4", "expected one of 'k1', 'k2', 'k3'"),
        ("algo.is_level", "tokens", "expected one of 'token', 'sequence', 'geometric'"),
        ("algo.is_mask_low", "1.5", "algo.is_mask_low = 1.5: must be in [0, 1) (0 = off)"),
        ("algo.is_mask_high", "0.5", "algo.is_mask_high = 0.5: must be > 1"),
    ],
)
def test_a_bad_guard_is_one_config_line(key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        load_config(env={}, overrides={key: value})
    assert "\n" not in str(err.value)
