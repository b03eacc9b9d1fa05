"""Tests for learner.losses and learner.batching (learner.advantages: tests/test_advantages.py).

Every loss variant (algorithm x offpolicy, with and without the KL and entropy terms) is compared with a
slow reference written plainly here (Python loops over samples and tokens, no vectorisation) on random
float64 inputs with mixed versions, holes in the mask and padding. Micro-batching is checked on a tiny
Llama: gradients accumulated over micro-batches equal the one-batch gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from april.config import AlgoConfig, Algorithm, ISLevel, KLEstimator, OffPolicy
from april.records import FinishReason, Sample
from learner.advantages import group_advantages
from learner.batching import (
    TrainBatch,
    build_train_batch,
    response_logprobs,
    response_logprobs_and_entropy,
    split_micro_batches,
    with_advantages,
)
from learner.losses import LossConfig, merge_stats, needs_proximal, policy_loss

ALGOS = list(Algorithm)
MODES = list(OffPolicy)
CUR = 5  # current learner version in the random inputs
TOL = 1e-9  # float64 throughout: far inside the 1e-6 the issue asks for

# ---------------------------------------------------------------------------------------------------
# random inputs


def random_inputs(seed: int, b: int = 7, tr: int = 9) -> dict[str, Tensor]:
    """Per-token tensors [b, tr] with padding, a hole in one mask, an empty sample and versions CUR-2..CUR."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tr + 1, (b,), generator=g)
    lengths[0], lengths[1] = 0, tr  # an empty response and a full-width one
    mask = torch.arange(tr)[None, :] < lengths[:, None]
    mask[2, 0] = False  # a hole (e.g. a tool-output token) at the start of sample 2
    versions = torch.full((b, tr), -1, dtype=torch.int64)
    for i in range(b):
        cuts = sorted(torch.randint(0, int(lengths[i]) + 1, (2,), generator=g).tolist())
        for t in range(int(lengths[i])):
            versions[i, t] = CUR - 2 if t < cuts[0] else (CUR - 1 if t < cuts[1] else CUR)
    beh = -torch.rand(b, tr, generator=g, dtype=torch.float64) * 3 - 0.05
    prox = beh + 0.6 * torch.randn(b, tr, generator=g, dtype=torch.float64)
    new = prox + 0.25 * torch.randn(b, tr, generator=g, dtype=torch.float64)
    garbage = 40 * torch.randn(b, tr, generator=g, dtype=torch.float64)  # padding must be ignored
    beh, prox, new = (torch.where(mask, x, garbage) for x in (beh, prox, new))
    return {
        "new": new,
        "beh": beh,
        "prox": prox,
        "ref": torch.where(mask, new + 0.3 * torch.randn(b, tr, generator=g, dtype=torch.float64), 0.0),
        "entropy": torch.rand(b, tr, generator=g, dtype=torch.float64) * 2,
        "adv": torch.randn(b, generator=g, dtype=torch.float64),
        "adv_tok": torch.randn(b, tr, generator=g, dtype=torch.float64),
        "mask": mask,
        "versions": versions,
    }


# ---------------------------------------------------------------------------------------------------
# the slow reference: loops over samples and tokens, 0-dim tensors so that autograd gives its gradient


def clip(x: Tensor, lo: float, hi: float) -> Tensor:
    if x < lo:
        return x * 0 + lo
    if x > hi:
        return x * 0 + hi
    return x


def clamp_log(d: Tensor, cfg: LossConfig) -> Tensor:
    """The log-ratio guard: clamped to [-log_ratio_clamp, log_ratio_clamp] (no gradient outside)."""
    return clip(d, -cfg.log_ratio_clamp, cfg.log_ratio_clamp) if cfg.log_ratio_clamp else d


def surrogate(log_r: Tensor, a: Tensor, cfg: LossConfig) -> Tensor:
    r = torch.exp(clamp_log(log_r, cfg))
    unclipped = r * a
    clipped = clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * a
    s = unclipped if unclipped <= clipped else clipped
    if cfg.clip_ratio_c and a < 0 and s < cfg.clip_ratio_c * a:  # dual clip: never below c A
        return s * 0 + cfg.clip_ratio_c * a
    return s


def reference_weights(x: dict[str, Tensor], i: int, real: list[int], cfg: LossConfig) -> dict[int, float]:
    """The IS weight of each real token of sample i as a plain float; 0.0 marks a rejected token."""
    if cfg.offpolicy not in (OffPolicy.TIS, OffPolicy.DECOUPLED):
        return {t: 1.0 for t in real}
    logs = [float(x["prox"][i, t]) - float(x["beh"][i, t]) for t in real]
    if cfg.algorithm == Algorithm.GSPO or cfg.is_level != ISLevel.TOKEN:
        total = sum(logs)
        if cfg.is_level != ISLevel.SEQUENCE:
            total = total / max(len(real), 1)
        logs = [total] * len(real)
    out = {}
    for t, lw in zip(real, logs, strict=True):
        if cfg.log_ratio_clamp:
            lw = max(-cfg.log_ratio_clamp, min(cfg.log_ratio_clamp, lw))
        w = math.exp(lw)
        if (cfg.is_mask_low and w < cfg.is_mask_low) or (cfg.is_mask_high and w > cfg.is_mask_high):
            out[t] = 0.0
        else:
            out[t] = min(w, cfg.tis_cap) if cfg.offpolicy == OffPolicy.TIS else w
    return out


def reference_kl(d: Tensor, cfg: LossConfig) -> Tensor:
    """One token's KL estimate from d = log pi_theta - log pi_ref; only k3, where d < 0, is guarded."""
    if cfg.kl_estimator == KLEstimator.K1:
        return d
    if cfg.kl_estimator == KLEstimator.K2:
        return d * d / 2
    if cfg.log_ratio_clamp and d < -cfg.log_ratio_clamp:
        d = d * 0 - cfg.log_ratio_clamp
    kl = torch.exp(-d) - 1 + d
    if cfg.kl_clamp and d < 0 and kl > cfg.kl_clamp:
        return kl * 0 + cfg.kl_clamp
    return kl


def reference_loss(
    x: dict[str, Tensor], new: Tensor, cfg: LossConfig, n_samples: int, n_tokens: int, adv_key: str
) -> Tensor:
    b, tr = new.shape
    total = new.new_zeros(())
    proximal = cfg.offpolicy in (OffPolicy.TIS, OffPolicy.DECOUPLED)
    for i in range(b):
        real = [t for t in range(tr) if bool(x["mask"][i, t])]
        weights = reference_weights(x, i, real, cfg)
        kept = [
            t
            for t in real
            if not (cfg.offpolicy == OffPolicy.MASK and int(x["versions"][i, t]) < CUR) and weights[t] != 0.0
        ]
        if adv_key == "adv":
            a = x["adv"][i]
        else:
            a = sum((x["adv_tok"][i, t] for t in real), new.new_zeros(())) / max(len(real), 1)
        extra = new.new_zeros(())  # KL and entropy terms, summed over kept tokens
        for t in kept:
            if cfg.kl_coef:
                extra = extra + cfg.kl_coef * reference_kl(new[i, t] - x["ref"][i, t], cfg)
            if cfg.entropy_coef:
                extra = extra - cfg.entropy_coef * x["entropy"][i, t]
        if cfg.algorithm == Algorithm.GSPO:
            log_s = new.new_zeros(())
            for t in kept:
                log_s = log_s + new[i, t] - (x["prox"][i, t] if proximal else x["beh"][i, t])
            log_s = log_s / max(len(kept), 1)
            w = weights[kept[0]] if kept else 0.0
            seq = -w * len(kept) / max(len(real), 1) * surrogate(log_s, a, cfg)
            total = total + (seq + extra / max(len(real), 1)) / n_samples
            continue
        s = extra
        for t in kept:
            pi_ref = x["prox"][i, t] if proximal else x["beh"][i, t]
            a_t = a if adv_key == "adv" else x["adv_tok"][i, t]
            s = s - weights[t] * surrogate(new[i, t] - pi_ref, a_t, cfg)
        if cfg.algorithm == Algorithm.GRPO:
            total = total + s / max(len(real), 1) / n_samples
        elif cfg.algorithm == Algorithm.DAPO:
            total = total + s / n_tokens
        else:
            total = total + s / (n_samples * cfg.max_new_tokens)
    return total


def run_both(
    x: dict[str, Tensor], cfg: LossConfig, *, n_samples: int, n_tokens: int, adv_key: str = "adv"
) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
    new = x["new"].clone().requires_grad_(True)
    loss, stats = policy_loss(
        new,
        x["beh"],
        x["prox"] if needs_proximal(cfg.offpolicy) else None,
        x[adv_key],
        x["mask"],
        x["versions"],
        CUR,
        cfg,
        num_samples=n_samples,
        num_tokens=n_tokens,
        logp_ref=x["ref"] if cfg.kl_coef else None,
        entropy=x["entropy"] if cfg.entropy_coef else None,
    )
    (grad,) = torch.autograd.grad(loss, new)
    ref_new = x["new"].clone().requires_grad_(True)
    ref = reference_loss(x, ref_new, cfg, n_samples, n_tokens, adv_key)
    (ref_grad,) = torch.autograd.grad(ref, ref_new)
    return loss.detach(), ref.detach(), grad, ref_grad, stats


# ---------------------------------------------------------------------------------------------------
# policy_loss vs the reference, every algorithm x offpolicy


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "kl+entropy"])
@pytest.mark.parametrize("offpolicy", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("algorithm", ALGOS, ids=[a.value for a in ALGOS])
def test_policy_loss_matches_loop_reference(algorithm: Algorithm, offpolicy: OffPolicy, extras: bool) -> None:
    eps = (0.25, 0.35) if algorithm == Algorithm.GSPO else (0.2, 0.28)  # some sequences inside the clip
    cfg = LossConfig(
        algorithm=algorithm,
        offpolicy=offpolicy,
        tis_cap=1.5,
        eps_low=eps[0],
        eps_high=eps[1],
        max_new_tokens=12,
        kl_coef=0.1 if extras else 0.0,
        entropy_coef=0.01 if extras else 0.0,
    )
    for seed in range(3):
        x = random_inputs(seed)
        # global normalisers larger than this call's, as for a micro-batch
        loss, ref, grad, ref_grad, _ = run_both(x, cfg, n_samples=11, n_tokens=int(x["mask"].sum()) + 17)
        assert abs(float(loss) - float(ref)) < TOL, (seed, float(loss), float(ref))
        assert torch.allclose(grad, ref_grad, atol=TOL, rtol=0), (seed, (grad - ref_grad).abs().max())
        assert float(grad.abs().sum()) > 0
        assert bool((grad[~x["mask"]] == 0).all())  # padding and holes get no gradient


@pytest.mark.parametrize("algorithm", ALGOS, ids=[a.value for a in ALGOS])
def test_policy_loss_per_token_advantages(algorithm: Algorithm) -> None:
    cfg = LossConfig(algorithm=algorithm, offpolicy=OffPolicy.TIS, eps_low=0.1, eps_high=0.3)
    x = random_inputs(7)
    loss, ref, grad, ref_grad, _ = run_both(
        x, cfg, n_samples=7, n_tokens=int(x["mask"].sum()), adv_key="adv_tok"
    )
    assert abs(float(loss) - float(ref)) < TOL
    assert torch.allclose(grad, ref_grad, atol=TOL, rtol=0)


def test_default_normalisers_are_this_calls_counts() -> None:
    x = random_inputs(3)
    for algorithm in ALGOS:
        cfg = LossConfig(algorithm=algorithm)
        loss, _ = policy_loss(x["new"], x["beh"], None, x["adv"], x["mask"], x["versions"], CUR, cfg)
        ref = reference_loss(x, x["new"], cfg, 7, int(x["mask"].sum()), "adv")
        assert abs(float(loss) - float(ref)) < TOL


@pytest.mark.parametrize("offpolicy", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("algorithm", ALGOS, ids=[a.value for a in ALGOS])
def test_a_micro_batch_of_empty_responses_adds_nothing(algorithm: Algorithm, offpolicy: OffPolicy) -> None:
    # a prompt that filled the context comes back finished with 0 tokens; token balancing puts it alone in
    # a micro-batch whose response tensors are [B, 0] (this raised in the statistics: min over nothing)
    cfg = LossConfig(algorithm=algorithm, offpolicy=offpolicy, kl_coef=0.1, entropy_coef=0.01)
    empty = torch.zeros(2, 0, dtype=torch.float64)
    new = empty.clone().requires_grad_(True)
    loss, stats = policy_loss(
        new,
        empty,
        empty if needs_proximal(offpolicy) else None,
        torch.tensor([0.5, -1.0], dtype=torch.float64),
        torch.zeros(2, 0, dtype=torch.bool),
        torch.zeros(2, 0, dtype=torch.int64),
        CUR,
        cfg,
        num_samples=8,
        num_tokens=40,
        logp_ref=empty,
        entropy=empty,
    )
    loss.backward()
    assert float(loss.detach()) == 0.0 and new.grad is not None and new.grad.shape == (2, 0)
    host = stats.host()
    assert (host.samples, host.tokens, host.units, host.staleness_max) == (0, 0, 0, 0)
    x = random_inputs(2)  # merged with a real micro-batch's, its stats change nothing
    _, real = policy_loss(x["new"], x["beh"], x["prox"], x["adv"], x["mask"], x["versions"], CUR, cfg_off())
    assert merge_stats([real, stats]).metrics() == real.metrics()


def cfg_off() -> LossConfig:
    return LossConfig(offpolicy=OffPolicy.TIS)


@pytest.mark.parametrize("parts", [1, 3])
def test_stats_match_loop_reference(parts: int) -> None:
    """One call, or micro-batches whose statistics are merged on the device: the loop's numbers."""
    x = random_inputs(4)
    cfg = LossConfig(
        algorithm=Algorithm.DAPO, offpolicy=OffPolicy.TIS, tis_cap=1.5, eps_low=0.2, eps_high=0.28
    )
    keys = ("new", "beh", "prox", "adv", "mask", "versions")
    calls = [
        policy_loss(
            *(x[k][rows] for k in keys[:5]), x["versions"][rows], CUR, cfg, entropy=x["entropy"][rows],
            num_samples=int(x["mask"].shape[0]), num_tokens=int(x["mask"].sum()),
        )[1]
        for rows in torch.arange(x["mask"].shape[0]).tensor_split(parts)
    ]  # fmt: skip
    stats = merge_stats(calls)
    tokens = clipped = old = 0
    kl = ent = w_sum = w_max = 0.0
    stale: list[int] = []
    for i in range(x["mask"].shape[0]):
        real = [t for t in range(x["mask"].shape[1]) if bool(x["mask"][i, t])]
        if real:
            stale.append(CUR - min(int(x["versions"][i, t]) for t in real))
        for t in real:
            tokens += 1
            old += int(int(x["versions"][i, t]) < CUR)
            r = math.exp(float(x["new"][i, t] - x["prox"][i, t]))
            a = float(x["adv"][i])
            clipped += int((r > 1.28 and a > 0) or (r < 0.8 and a < 0))
            d = float(x["new"][i, t] - x["beh"][i, t])
            kl += math.exp(d) - 1 - d
            ent += float(x["entropy"][i, t])
            w = min(math.exp(float(x["prox"][i, t] - x["beh"][i, t])), 1.5)
            w_sum, w_max = w_sum + w, max(w_max, w)
    m = stats.metrics()
    assert m["clip_frac"] == pytest.approx(clipped / tokens, abs=1e-12)
    assert m["approx_kl"] == pytest.approx(kl / tokens, abs=1e-12)
    assert m["entropy"] == pytest.approx(ent / tokens, abs=1e-12)
    assert m["is_weight_mean"] == pytest.approx(w_sum / tokens, abs=1e-12)
    assert m["is_weight_max"] == pytest.approx(w_max, abs=1e-12)
    assert m["offpolicy_token_frac"] == pytest.approx(old / tokens, abs=1e-12)
    assert m["masked_frac"] == 0.0
    assert m["staleness_max"] == max(stale)
    assert m["staleness_mean"] == pytest.approx(sum(stale) / len(stale), abs=1e-12)


@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_the_statistics_never_leave_the_device(algorithm: Algorithm) -> None:
    """On the meta device every read of a value raises (`.item()`, a branch on a tensor, a boolean index's
    data-dependent shape): the loss and its statistics, merged, never read back to the host; a step reads
    them once (`DeviceStats.host`), not 20 scalars a micro-batch."""
    x = {k: v.to("meta") for k, v in random_inputs(4).items()}
    for offpolicy in OffPolicy:
        cfg = LossConfig(algorithm=algorithm, offpolicy=offpolicy, kl_coef=0.1, entropy_coef=0.01)
        loss, stats = policy_loss(
            x["new"], x["beh"], x["prox"], x["adv"], x["mask"], x["versions"], CUR, cfg,
            num_samples=7, num_tokens=30, logp_ref=x["ref"], entropy=x["entropy"],
        )  # fmt: skip
        merged = merge_stats([stats, stats])
        assert loss.device.type == merged.values.device.type == "meta", offpolicy


def test_policy_loss_rejects_bad_inputs() -> None:
    x = random_inputs(0)
    cfg = LossConfig(offpolicy=OffPolicy.DECOUPLED)
    with pytest.raises(ValueError, match="needs logp_proximal"):
        policy_loss(x["new"], x["beh"], None, x["adv"], x["mask"], x["versions"], CUR, cfg)
    with pytest.raises(ValueError, match="versions of shape"):
        policy_loss(x["new"], x["beh"], x["prox"], x["adv"], x["mask"], x["versions"][:, :3], CUR, cfg)
    with pytest.raises(ValueError, match="no logp_ref"):
        policy_loss(
            x["new"], x["beh"], None, x["adv"], x["mask"], x["versions"], CUR, LossConfig(kl_coef=0.1)
        )
    with pytest.raises(ValueError, match=r"LossConfig.tis_cap = 0.5"):
        LossConfig(tis_cap=0.5)


def test_loss_config_from_algo_defaults() -> None:
    algo = AlgoConfig(algorithm=Algorithm.DAPO, offpolicy=OffPolicy.TIS, tis_cap=3.0, max_new_tokens=64)
    cfg = LossConfig.from_algo(algo)
    assert (cfg.eps_low, cfg.eps_high, cfg.tis_cap, cfg.max_new_tokens) == (0.2, 0.28, 3.0, 64)
    assert LossConfig.from_algo(AlgoConfig(algorithm=Algorithm.GSPO)).eps_high == 4e-4
    assert LossConfig.from_algo(algo, eps_high=0.5).eps_high == 0.5


# ---------------------------------------------------------------------------------------------------
# off-policy specifics on a batch built from samples with segments from versions v-2, v-1, v


def staggered_batch(seed: int = 0) -> TrainBatch:
    """Two groups of 3; each sample generated in up to 3 rounds by versions CUR-2, CUR-1, CUR."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(2):
        prompt = rng.integers(3, 300, size=int(rng.integers(1, 5))).astype(np.int32)
        for i in range(3):
            s = Sample(group_id=10 + g, index=i, prompt_ids=prompt)
            rounds = [(CUR - 2, 2 + i), (CUR - 1, 1 + g), (CUR, 2)] if (g, i) != (0, 0) else [(CUR, 3)]
            for k, (version, n) in enumerate(rounds):
                reason = FinishReason.STOP if k == len(rounds) - 1 else FinishReason.ABORT
                lps = -rng.random(n).astype(np.float32) - 0.1
                s = s.extend(rng.integers(3, 300, size=n).astype(np.int32), lps, version, reason)
                if reason == FinishReason.ABORT:
                    s = s.resumed()
            samples.append(s.scored(float(rng.integers(0, 2))))
    rng.shuffle(samples)  # build_train_batch restores group order
    batch = build_train_batch(samples, pad_id=0, n_samples_per_prompt=3)
    adv = group_advantages(batch.group_rewards().double(), Algorithm.GRPO).reshape(-1)
    return with_advantages(batch, adv + 0.5)  # nonzero everywhere, so every kept token has a gradient


def off_policy_loss(batch: TrainBatch, cfg: LossConfig, prox: Tensor | None) -> tuple[Tensor, Tensor, Any]:
    beh = batch.behaviour_logprobs.double()
    new = (beh + 0.05).requires_grad_(True)
    loss, stats = policy_loss(
        new, beh, prox, batch.advantages.double(), batch.response_mask, batch.versions, CUR, cfg
    )
    (grad,) = torch.autograd.grad(loss, new)
    return loss.detach(), grad, stats


def test_batch_versions_come_from_segments() -> None:
    batch = staggered_batch()
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    first = batch.versions[0, : int(batch.response_lens[0])].tolist()
    assert first == [CUR] * 3
    second = batch.versions[1, : int(batch.response_lens[1])].tolist()
    assert second == [CUR - 2] * 3 + [CUR - 1] * 1 + [CUR] * 2
    assert bool((batch.versions[~batch.response_mask] == -1).all())


@pytest.mark.parametrize("algorithm", ALGOS, ids=[a.value for a in ALGOS])
def test_mask_zeroes_exactly_the_old_tokens(algorithm: Algorithm) -> None:
    batch = staggered_batch()
    cfg = LossConfig(algorithm=algorithm, offpolicy=OffPolicy.MASK, eps_low=0.2, eps_high=0.2)
    _, grad, stats = off_policy_loss(batch, cfg, None)
    old = batch.response_mask & (batch.versions < CUR)
    current = batch.response_mask & (batch.versions == CUR)
    assert bool((grad[old] == 0).all())
    assert bool((grad[current] != 0).all())
    assert bool((grad[~batch.response_mask] == 0).all())
    m = stats.metrics()
    assert m["masked_frac"] == pytest.approx(float(old.sum()) / float(batch.response_mask.sum()))
    assert m["offpolicy_token_frac"] == m["masked_frac"]
    assert m["staleness_max"] == 2


def test_tis_weights_are_capped() -> None:
    batch = staggered_batch()
    prox = batch.behaviour_logprobs.double()  # the learner's log-probs before the update
    old = batch.response_mask & (batch.versions < CUR)
    tis = LossConfig(
        algorithm=Algorithm.DAPO, offpolicy=OffPolicy.TIS, tis_cap=2.0, eps_low=0.2, eps_high=0.2
    )
    dec = LossConfig(algorithm=Algorithm.DAPO, offpolicy=OffPolicy.DECOUPLED, eps_low=0.2, eps_high=0.2)

    def run(cfg: LossConfig, old_weight: float) -> tuple[Tensor, Tensor, Any]:
        log_w = torch.full(old.shape, math.log(1.5), dtype=torch.float64)  # log pi_prox / pi_beh
        log_w[old] = math.log(old_weight)
        beh = prox - log_w
        new = (prox + 0.05).requires_grad_(True)
        loss, stats = policy_loss(
            new, beh, prox, batch.advantages.double(), batch.response_mask, batch.versions, CUR, cfg
        )
        (grad,) = torch.autograd.grad(loss, new)
        return loss.detach(), grad, stats

    loss10, grad10, stats10 = run(tis, 10.0)
    loss1000, grad1000, _ = run(tis, 1000.0)
    loss_at_cap, grad_at_cap, _ = run(dec, 2.0)  # decoupled with the raw weight at the cap
    assert stats10.metrics()["is_weight_max"] == pytest.approx(2.0)
    assert abs(float(loss10) - float(loss1000)) < TOL
    assert torch.allclose(grad10, grad1000, atol=TOL, rtol=0)
    assert abs(float(loss10) - float(loss_at_cap)) < TOL
    assert torch.allclose(grad10, grad_at_cap, atol=TOL, rtol=0)
    # below the cap the weight is used as is: 1.5 on the current tokens, the gradient 1.5 / 2 of the old's
    cur = batch.response_mask & ~old
    same_row = cur[1] & (batch.advantages[1] != 0)
    assert torch.allclose(grad10[1][same_row] / 1.5, grad10[1][old[1]][:1].expand(int(same_row.sum())) / 2.0)
    # the uncapped decoupled weight keeps growing
    assert run(dec, 10.0)[2].metrics()["is_weight_max"] == pytest.approx(10.0)


@pytest.mark.parametrize("algorithm", ALGOS, ids=[a.value for a in ALGOS])
def test_decoupled_is_plain_ppo_when_behaviour_is_proximal(algorithm: Algorithm) -> None:
    batch = staggered_batch()
    beh = batch.behaviour_logprobs.double()
    dec_cfg = LossConfig(algorithm=algorithm, offpolicy=OffPolicy.DECOUPLED, eps_low=0.2, eps_high=0.28)
    dec = off_policy_loss(batch, dec_cfg, beh)
    plain_cfg = LossConfig(algorithm=algorithm, offpolicy=OffPolicy.NONE, eps_low=0.2, eps_high=0.28)
    plain = off_policy_loss(batch, plain_cfg, None)
    assert abs(float(dec[0]) - float(plain[0])) < TOL
    assert torch.allclose(dec[1], plain[1], atol=TOL, rtol=0)
    assert dec[2].metrics()["is_weight_mean"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------
# batching


def test_build_train_batch_layout_and_errors() -> None:
    s = Sample(group_id=1, index=0, prompt_ids=np.array([5, 6], dtype=np.int32))
    s = s.extend([7, 8, 9], [-0.5, -0.25, -1.0], 3, FinishReason.STOP).scored(1.0)
    t = Sample(group_id=1, index=1, prompt_ids=np.array([5, 6], dtype=np.int32))
    t = t.extend([4], [-2.0], 3, FinishReason.LENGTH).scored(0.0)
    batch = build_train_batch([t, s])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 4, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.response_ids.tolist() == [[7, 8, 9], [4, 0, 0]]
    assert batch.response_mask.tolist() == [[True, True, True], [True, False, False]]
    assert batch.behaviour_logprobs.tolist() == [[-0.5, -0.25, -1.0], [-2.0, 0.0, 0.0]]
    assert batch.versions.tolist() == [[3, 3, 3], [3, -1, -1]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert (batch.global_samples, batch.global_tokens) == (2, 4)
    with pytest.raises(ValueError, match="RUNNING, expected FINISHED"):
        build_train_batch(
            [s, Sample(1, 1, np.array([5], dtype=np.int32)).extend([3], [-1.0], 0, FinishReason.NONE)]
        )
    with pytest.raises(ValueError, match=r"sample indices \[0\], expected 0..1"):
        build_train_batch([s], n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="reward nan"):
        build_train_batch([s.scored(float("nan"))])


def test_split_micro_batches_bounds_tokens_and_keeps_every_sample() -> None:
    batch = staggered_batch(1)
    for max_tokens in (1, 10, 25, 1000):
        parts = split_micro_batches(batch, max_tokens)
        rows = sorted(i for p in parts for i in p.sample_index.tolist())
        assert rows == list(range(batch.size))
        for p in parts:
            assert p.padded_tokens <= max_tokens or p.size == 1
            assert (p.global_samples, p.global_tokens) == (batch.global_samples, batch.global_tokens)
            assert p.input_ids.shape[1] == int((p.prompt_lens + p.response_lens).max())
    assert len(split_micro_batches(batch, 1000)) == 1


# ---------------------------------------------------------------------------------------------------
# response log-probs and micro-batch gradient accumulation on a tiny Llama (float64)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from transformers import AutoModelForCausalLM

    from april.hf import make_tiny_model

    path: Path = make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3, hidden=32, layers=1, heads=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    model.train(False)
    yield model


def test_response_logprobs_equal_hand_computed_log_softmax(tiny_model: Any) -> None:
    batch = staggered_batch(2)
    temperature = 0.7
    with torch.no_grad():
        logp, entropy = response_logprobs_and_entropy(tiny_model, batch, temperature)
        packed = response_logprobs(tiny_model, batch, temperature, packed=True)
    assert logp.dtype == torch.float64 and logp.shape == batch.response_ids.shape
    for i in range(batch.size):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        ids = batch.input_ids[i, : p + r][None, :]
        with torch.no_grad():
            logits = tiny_model(input_ids=ids).logits[0]  # this sequence alone: no padding at all
        for j in range(r):
            row = logits[p + j - 1] / temperature
            want = row[int(batch.response_ids[i, j])] - torch.logsumexp(row, dim=0)
            probs = torch.softmax(row, dim=0)
            want_entropy = -sum(float(q) * math.log(float(q)) for q in probs if float(q) > 0)
            assert abs(float(logp[i, j]) - float(want)) < 1e-9
            assert abs(float(packed[i, j]) - float(want)) < 1e-9
            assert abs(float(entropy[i, j]) - want_entropy) < 1e-9
    assert bool((logp[~batch.response_mask] == 0).all())
    with pytest.raises(ValueError, match="temperature"):
        response_logprobs(tiny_model, batch, 0.0)


@pytest.mark.parametrize(
    ("algorithm", "offpolicy"),
    [(a, OffPolicy.DECOUPLED) for a in ALGOS]
    + [(Algorithm.GRPO, OffPolicy.MASK), (Algorithm.DAPO, OffPolicy.TIS)],
    ids=lambda v: str(v.value),
)
def test_micro_batch_gradients_equal_one_batch(
    tiny_model: Any, algorithm: Algorithm, offpolicy: OffPolicy
) -> None:
    batch = staggered_batch(3)
    eps = (0.02, 0.03) if algorithm == Algorithm.GSPO else (0.2, 0.28)
    cfg = LossConfig(
        algorithm=algorithm,
        offpolicy=offpolicy,
        eps_low=eps[0],
        eps_high=eps[1],
        kl_coef=0.05,
        entropy_coef=0.01,
    )
    with torch.no_grad():  # the reference model: the weights themselves, shifted a little
        ref_full = response_logprobs(tiny_model, batch, 1.0) - 0.01

    def step(part: TrainBatch) -> tuple[Tensor, Any]:
        with torch.no_grad():  # proximal: the weights before the update
            prox = response_logprobs(tiny_model, part, 1.0)
        logp, entropy = response_logprobs_and_entropy(tiny_model, part, 1.0)
        # behaviour: the engine's log-probs, off by a little from the learner's
        beh = prox - 0.1 * (part.versions < CUR).double() + 0.02
        loss, stats = policy_loss(
            logp,
            torch.where(part.response_mask, beh, 0.0),
            prox,
            part.advantages.double(),
            part.response_mask,
            part.versions,
            CUR,
            cfg,
            num_samples=part.global_samples,
            num_tokens=part.global_tokens,
            logp_ref=ref_full[part.sample_index][:, : part.response_ids.shape[1]],
            entropy=entropy,
        )
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.detach(), stats

    def grads() -> list[Tensor]:
        out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in tiny_model.parameters()]
        tiny_model.zero_grad(set_to_none=True)
        return out

    tiny_model.zero_grad(set_to_none=True)
    full_loss, full_stats = step(batch)
    full = grads()
    parts = split_micro_batches(batch, 20)
    assert len(parts) > 2
    results = [step(p) for p in parts]
    accumulated = grads()
    assert abs(float(sum(loss for loss, _ in results)) - float(full_loss)) < 1e-9
    assert sum(float(g.abs().sum()) for g in full) > 0
    for g_full, g_acc in zip(full, accumulated, strict=True):
        assert torch.allclose(g_full, g_acc, atol=1e-9, rtol=0), (g_full - g_acc).abs().max()
    merged = merge_stats([s for _, s in results]).metrics()
    for key, value in full_stats.metrics().items():
        assert merged[key] == pytest.approx(value, abs=1e-9), key
