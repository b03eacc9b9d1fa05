"""The policy loss: clipped surrogate per algorithm, off-policy correction, KL and entropy terms, stats.

Owns `policy_loss` (one formula per `algo.algorithm` x `algo.offpolicy`, on per-token tensors), the loss
settings (`LossConfig`: clip range, KL and entropy coefficients, the numerical guards) and the
step statistics (`DeviceStats` on the loss's device, merged over micro-batches there and read to the
host once a step as `LossStats`). Does not run models, build batches or step
optimizers: inputs are log-probs already gathered at the response tokens (`learner.batching`).

Notation, per sample i and response token t (m_it = 1 on real response tokens, B = samples and
N_tok = response tokens of the *global* batch, so micro-batch losses add up to the batch loss):

- pi_theta: the weights being differentiated (`logp_new`).
- pi_beh: the engine that generated the token (`logp_behaviour`, stored with the sample; possibly an older
  policy version, and a different numeric engine even when the version is current).
- pi_old = pi_prox: the learner's weights *before this batch's update* (version `current_version`),
  recomputed by the learner (`logp_proximal`, no grad). Needed by `tis` and `decoupled` only.

Per token: ratio r_t = exp(clamp(log pi_theta - log pi_ref, +-log_ratio_clamp)) with pi_ref = pi_beh
(`none`, `mask`) or pi_prox (`tis`, `decoupled`); surrogate s_t = min(r_t A, clip(r_t, 1 - eps_low,
1 + eps_high) A), and for A < 0 the dual clip s_t = max(s_t, clip_ratio_c A); detached weight
w_t = 1 (`none`), 1[version_t >= current_version] (`mask`), min(pi_prox / pi_beh, tis_cap) (`tis`,
truncated IS as in Yao et al. 2025), pi_prox / pi_beh (`decoupled`, Hilton et al. 2022; `tis` is its
truncated form). For `tis` / `decoupled`, `is_level` forms the weight per token, or per sample as the
product (`sequence`) or geometric mean (`geometric`) of the token weights; its log is clamped like the
ratio's, and a unit (token or sample) whose weight is outside [is_mask_low, is_mask_high] is rejected:
it gets no loss at all, like a `mask`-ed token. Per-token loss l_t = -w_t s_t k_t (k_t = 1 on kept tokens:
real, not `mask`-ed, not rejected), aggregated by the algorithm:

- `grpo`:    (1/B) sum_i (1/L_i) sum_t l_it          (L_i = response tokens of sample i)
- `dapo`:    (1/N_tok) sum_i sum_t l_it              (token-level over the whole global batch)
- `dr_grpo`: (1/(B * max_new_tokens)) sum_i sum_t l_it  (a constant: no length normalisation)
- `gspo`:    (1/B) sum_i -W_i s_i with the sequence ratio
             exp(clamp((1/K_i) sum_t k_it (log pi_theta - log pi_ref))) (K_i = kept tokens), clipped and
             dual-clipped as above, W_i = (K_i / L_i) w_i and w_i the sample's weight (the geometric mean
             of the token weights, or their product with `is_level = sequence`).

`mask` and rejection zero the loss of a token but keep it in the normalisers (L_i, N_tok, K_i / L_i), so
a masked token is exactly a weight-0 token and the normalisers are fixed when the batch is built. Every
mask is applied with `torch.where` on the log-ratio before `exp`, never by multiplying by 0: a masked
token with a huge ratio would give inf x 0 = NaN in the loss and in its gradient.
Optional terms, aggregated the same way (sequence-mean for gspo) over kept tokens, not IS-weighted:
`kl_coef` x the `kl_estimator` (k1, k2 or k3 of d = log pi_theta - log pi_ref_model; see `kl_estimate`
for what each one's gradient is and where k3 is capped), and `-entropy_coef` x entropy.

Several optimizer steps per batch: pi_prox stays the weights before the *first* step and the version
advances once per batch (weights are published once), so at step j (0-based) of k a token tagged
version current - s is s batches (up to s*k optimizer steps) plus j steps behind pi_theta. `mask`/`tis`
judge staleness by version and see only s; the clip against pi_prox (`tis`, `decoupled`) bounds the j
part separately, while `none`/`mask` clip against pi_beh, so one clip range covers both parts and with
large k or s stale tokens are mostly clipped (no gradient).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from april.config import AlgoConfig, Algorithm, ISLevel, KLEstimator, OffPolicy

# (eps_low, eps_high) when not given: PPO's 0.2; DAPO's clip-higher 0.28; GSPO's sequence-level 3e-4 / 4e-4.
DEFAULT_CLIP: dict[Algorithm, tuple[float, float]] = {
    Algorithm.GRPO: (0.2, 0.2),
    Algorithm.DR_GRPO: (0.2, 0.2),
    Algorithm.DAPO: (0.2, 0.28),
    Algorithm.GSPO: (3e-4, 4e-4),
}


@dataclass(frozen=True, slots=True)
class LossConfig:
    """What `policy_loss` needs. `from_algo` fills it from `[algo]` plus the fields AlgoConfig lacks.

    Every guard is on by default with the peers' value and off at 0: `log_ratio_clamp` 20 (verl's
    core_algos.py clamps log(pi/pi_old) to [-20, 20]), `clip_ratio_c` 3 (verl's dual-clip default),
    `kl_clamp` 10 (the cap verl and slime put on k3, here on its exploding side only: `kl_estimate`).
    """

    algorithm: Algorithm = Algorithm.GRPO
    offpolicy: OffPolicy = OffPolicy.NONE
    tis_cap: float = 2.0  # C in min(pi_prox / pi_beh, C), `tis` only
    eps_low: float = 0.2  # ratio clipped below at 1 - eps_low
    eps_high: float = 0.2  # ratio clipped above at 1 + eps_high (DAPO clip-higher: > eps_low)
    max_new_tokens: int = 256  # dr_grpo's constant per-sample normaliser
    kl_coef: float = 0.0  # weight of the KL to the reference model (needs logp_ref when > 0)
    entropy_coef: float = 0.0  # weight of the entropy bonus (needs entropy when > 0)
    is_level: ISLevel = ISLevel.TOKEN  # tis / decoupled weight per token, per sequence or geometric mean
    is_mask_low: float = 0.0  # tis / decoupled: a unit whose weight is below this gets no loss; 0 = off
    is_mask_high: float = 0.0  # tis / decoupled: a unit whose weight is above this gets no loss; 0 = off
    log_ratio_clamp: float = 20.0  # every log-ratio is clamped to [-c, c] before exp; 0 = off
    clip_ratio_c: float = 3.0  # dual-clip: for A < 0 the surrogate is at least c A; 0 = off
    kl_estimator: KLEstimator = KLEstimator.K3
    kl_clamp: float = 10.0  # k3's value capped at kl_clamp where d < 0 (k1, k2: never); 0 = off

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))
        object.__setattr__(self, "offpolicy", OffPolicy(self.offpolicy))
        object.__setattr__(self, "is_level", ISLevel(self.is_level))
        object.__setattr__(self, "kl_estimator", KLEstimator(self.kl_estimator))
        checks = [
            (self.tis_cap >= 1, "tis_cap", self.tis_cap, ">= 1"),
            (0 <= self.eps_low < 1, "eps_low", self.eps_low, "in [0, 1)"),
            (self.eps_high >= 0, "eps_high", self.eps_high, ">= 0"),
            (self.max_new_tokens > 0, "max_new_tokens", self.max_new_tokens, "> 0"),
            (self.kl_coef >= 0, "kl_coef", self.kl_coef, ">= 0"),
            (self.entropy_coef >= 0, "entropy_coef", self.entropy_coef, ">= 0"),
            (0 <= self.is_mask_low < 1, "is_mask_low", self.is_mask_low, "in [0, 1) (0 = off)"),
            (self.is_mask_high == 0 or self.is_mask_high > 1, "is_mask_high", self.is_mask_high, "> 1 or 0"),
            (self.log_ratio_clamp >= 0, "log_ratio_clamp", self.log_ratio_clamp, ">= 0 (0 = off)"),
            (self.clip_ratio_c == 0 or self.clip_ratio_c > 1, "clip_ratio_c", self.clip_ratio_c, "> 1 or 0"),
            (self.kl_clamp >= 0, "kl_clamp", self.kl_clamp, ">= 0 (0 = off)"),
        ]
        for ok, name, value, expected in checks:
            if not ok:
                raise ValueError(f"LossConfig.{name} = {value!r}: expected {expected}")

    @classmethod
    def from_algo(
        cls,
        algo: AlgoConfig,
        *,
        eps_low: float | None = None,
        eps_high: float | None = None,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        **guards: Any,
    ) -> LossConfig:
        """From `[algo]`; eps_low / eps_high default per algorithm (`DEFAULT_CLIP`), `is_mask_high` per
        offpolicy (`AlgoConfig.is_mask_high_resolved`); `guards` are the other fields (`log_ratio_clamp`,
        `clip_ratio_c`, `kl_estimator`, `kl_clamp`), their defaults when not given."""
        low, high = DEFAULT_CLIP[algo.algorithm]
        return cls(
            algorithm=algo.algorithm,
            offpolicy=algo.offpolicy,
            tis_cap=algo.tis_cap,
            eps_low=low if eps_low is None else eps_low,
            eps_high=high if eps_high is None else eps_high,
            max_new_tokens=algo.max_new_tokens,
            kl_coef=kl_coef,
            entropy_coef=entropy_coef,
            is_level=algo.is_level,
            is_mask_low=algo.is_mask_low,
            is_mask_high=algo.is_mask_high_resolved,
            **guards,
        )


def needs_proximal(offpolicy: OffPolicy | str) -> bool:
    """True when the loss needs log-probs under the weights before the update (`tis`, `decoupled`)."""
    return OffPolicy(offpolicy) in (OffPolicy.TIS, OffPolicy.DECOUPLED)


@dataclass(frozen=True, slots=True)
class LossStats:
    """Sums and maxima of one `policy_loss` call; `merge_stats` adds micro-batches, `metrics` reports.

    "Units" are the things clipped and IS-weighted: kept tokens, or sequences (with kept tokens) for gspo.
    """

    loss: float = 0.0  # this call's share of the batch loss (shares add up)
    pg_loss: float = 0.0
    kl_loss: float = 0.0  # kl_coef x aggregated KL to the reference model
    entropy_loss: float = 0.0  # -entropy_coef x aggregated entropy
    samples: int = 0
    tokens: int = 0  # response tokens
    kept_tokens: int = 0  # response tokens that got loss (all but `mask`-ed ones)
    offpolicy_tokens: int = 0  # response tokens with version < current_version
    units: int = 0  # units that got loss
    clipped_units: int = 0
    dual_clipped_units: int = 0  # A < 0 and ratio > clip_ratio_c: the dual clip bounds the loss
    is_masked_units: int = 0  # units with no loss because their IS weight fell outside the mask bounds
    is_weight_sum: float = 0.0  # over units
    is_weight_max: float = 0.0
    approx_kl_sum: float = 0.0  # over response tokens: k3 of KL(pi_beh || pi_theta)
    entropy_sum: float = 0.0  # over entropy_tokens
    entropy_tokens: int = 0  # 0 when no entropy was given
    kl_ref_sum: float = 0.0  # over kl_ref_tokens
    kl_ref_tokens: int = 0
    staleness_sum: int = 0  # over samples with response tokens: current_version - oldest token version
    staleness_max: int = 0

    def metrics(self) -> dict[str, float]:
        """Flat metric names (docs/design.md section 7 where they exist there)."""

        def ratio(num: float, den: float) -> float:
            return num / den if den else 0.0

        out = {
            "loss": self.loss,
            "pg_loss": self.pg_loss,
            "kl_loss": self.kl_loss,
            "entropy_loss": self.entropy_loss,
            "clip_frac": ratio(self.clipped_units, self.units),
            "dual_clip_frac": ratio(self.dual_clipped_units, self.units),
            "is_masked_frac": ratio(self.is_masked_units, self.units + self.is_masked_units),
            "approx_kl": ratio(self.approx_kl_sum, self.tokens),
            "is_weight_mean": ratio(self.is_weight_sum, self.units),
            "is_weight_max": self.is_weight_max,
            "masked_frac": ratio(self.tokens - self.kept_tokens, self.tokens),
            "offpolicy_token_frac": ratio(self.offpolicy_tokens, self.tokens),
            "staleness_max": float(self.staleness_max),
            "staleness_mean": ratio(self.staleness_sum, self.samples),
            "tokens_trained": float(self.kept_tokens),
        }
        if self.entropy_tokens:
            out["entropy"] = self.entropy_sum / self.entropy_tokens
        if self.kl_ref_tokens:
            out["kl_ref"] = self.kl_ref_sum / self.kl_ref_tokens
        return out


STAT_FIELDS = tuple(f.name for f in dataclasses.fields(LossStats))
INT_FIELDS = frozenset(f.name for f in dataclasses.fields(LossStats) if f.type in ("int", int))
MAX_INDEX = [i for i, name in enumerate(STAT_FIELDS) if name.endswith("_max")]
SUM_INDEX = [i for i, name in enumerate(STAT_FIELDS) if not name.endswith("_max")]


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """`LossStats`' fields, in their order, as one float64 vector on the loss's device: a micro-batch adds
    its statistics without reading anything back to the host; `host` reads them once."""

    values: Tensor  # [len(STAT_FIELDS)] float64

    def host(self) -> LossStats:
        values = self.values.tolist()  # the one read back
        return LossStats(
            **{n: int(v) if n in INT_FIELDS else v for n, v in zip(STAT_FIELDS, values, strict=True)}
        )

    def metrics(self) -> dict[str, float]:
        return self.host().metrics()


def merge_stats(parts: Sequence[DeviceStats]) -> DeviceStats:
    """Stats of a whole batch from its micro-batches' stats (sums add, maxima take the max), on their
    device."""
    if not parts:
        return DeviceStats(torch.zeros(len(STAT_FIELDS), dtype=torch.float64))
    stacked = torch.stack([p.values for p in parts])  # [parts, fields]
    merged = stacked.sum(dim=0)
    merged[MAX_INDEX] = stacked[:, MAX_INDEX].amax(dim=0)
    return DeviceStats(merged)


def policy_loss(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_proximal: Tensor | None,
    advantages: Tensor,
    token_mask: Tensor,
    versions: Tensor,
    current_version: int,
    cfg: LossConfig,
    *,
    num_samples: int | None = None,
    num_tokens: int | None = None,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, DeviceStats]:
    """Scalar loss (to minimise) and its stats (on its device); see the module docstring for the formulas.

    Shapes: `[B, Tr]` for the log-probs (nats), `token_mask` (bool), `versions` (int), `logp_ref` and
    `entropy`; `advantages` is `[B]` or `[B, Tr]` (gspo takes the masked per-sample mean of the latter).
    `num_samples` / `num_tokens` are the global batch's sample and response-token counts (default: this
    call's), which makes micro-batch losses add up to the batch loss. Values on padding are ignored.
    `logp_proximal` (no grad) is required by `tis` / `decoupled` and ignored by `none` / `mask`;
    `current_version` is the version of the weights before this batch's update (pi_prox's version).
    `Tr` may be 0 (every response empty): the loss is then 0, still connected to `logp_new`.
    """
    _check_shapes(
        logp_new,
        advantages,
        logp_behaviour=logp_behaviour,
        token_mask=token_mask,
        versions=versions,
        logp_proximal=logp_proximal,
        logp_ref=logp_ref,
        entropy=entropy,
    )
    if logp_proximal is None and needs_proximal(cfg.offpolicy):
        raise ValueError(f"policy_loss: offpolicy {cfg.offpolicy.value!r} needs logp_proximal, got None")
    mask = token_mask.bool()
    m = mask.to(logp_new.dtype)  # [B, Tr]
    candidates = mask & ~(versions < current_version) if cfg.offpolicy is OffPolicy.MASK else mask
    proximal = logp_proximal is not None and needs_proximal(cfg.offpolicy)
    sequence_weights = cfg.algorithm is Algorithm.GSPO or cfg.is_level is not ISLevel.TOKEN
    log_w = torch.zeros_like(m)  # log of the detached IS weight pi_prox / pi_beh, 0 off the mask
    if proximal:
        assert logp_proximal is not None
        log_w = torch.where(mask, logp_proximal - logp_behaviour, 0.0).detach()
    w, rejected = _is_weights(log_w, m, cfg, per_sample=sequence_weights)  # [B] or [B, Tr]
    rejected_tokens = rejected[:, None] & mask if sequence_weights else rejected
    keep = candidates & ~rejected_tokens  # tokens that get loss
    k = keep.to(m.dtype)
    ref = logp_proximal if proximal and logp_proximal is not None else logp_behaviour
    # masked with where *before* exp: exp of a masked token's huge log-ratio would be inf, and inf x 0 = NaN
    # in the forward and in the backward alike
    log_ratio = torch.where(keep, logp_new - ref.detach(), 0.0)  # [B, Tr]
    adv = advantages.to(m.dtype)
    n_samples = num_samples if num_samples is not None else int(mask.shape[0])
    n_tokens = num_tokens if num_tokens is not None else int(mask.sum())
    agg = _aggregator(cfg, m, n_samples, n_tokens)
    if cfg.algorithm is Algorithm.GSPO:
        pg, units, clipped, dual = _gspo(log_ratio, w, adv, mask, k, cfg, n_samples)
        unit_weights = w  # [B], of the units where `units`
        rejected_units = rejected & candidates.any(dim=1)  # samples
    else:
        pg, units, clipped, dual = _token_level(log_ratio, w, adv, keep, cfg, agg)
        unit_weights = _per_token(w, m)  # [B, Tr], of the units where `units`
        rejected_units = rejected_tokens & candidates  # tokens
    loss = pg
    kl_term = ent_term = torch.zeros((), dtype=m.dtype, device=m.device)
    if cfg.kl_coef > 0:
        if logp_ref is None:
            raise ValueError(f"policy_loss: kl_coef = {cfg.kl_coef} but no logp_ref (reference log-probs)")
        kl = kl_estimate(torch.where(keep, logp_new - logp_ref.detach(), 0.0), cfg)
        kl_term = cfg.kl_coef * agg(torch.where(keep, kl, 0.0))
        loss = loss + kl_term
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError(f"policy_loss: entropy_coef = {cfg.entropy_coef} but no entropy given")
        ent_term = -cfg.entropy_coef * agg(torch.where(keep, entropy, 0.0))
        loss = loss + ent_term
    with torch.no_grad():
        stats = _stats(
            (loss, pg, kl_term, ent_term),
            logp_new,
            logp_behaviour,
            logp_ref,
            entropy,
            (mask, k, versions, current_version),
            (units, clipped, dual, unit_weights, rejected_units),
            cfg,
        )
    return loss, stats


def kl_estimate(d: Tensor, cfg: LossConfig) -> Tensor:
    """Per-token estimate of the KL between pi_theta and the reference model, from d = log pi_theta -
    log pi_ref on tokens sampled from (approximately) pi_theta, with the gradient each gives the loss:

    - `k1` = d: unbiased for KL(pi_theta || pi_ref), but its gradient, grad log pi_theta per token, has
      expectation 0: as a loss term it does not pull towards the reference (use it as a reward penalty);
    - `k2` = d^2 / 2: biased as a value, but its gradient d grad log pi_theta is in expectation the
      gradient of KL(pi_theta || pi_ref) (the reverse KL, what a KL penalty means);
    - `k3` = exp(-d) - 1 + d (Schulman's low-variance estimator, >= 0): unbiased for KL(pi_theta || pi_ref)
      as a value, but its gradient (1 - pi_ref / pi_theta) grad log pi_theta is in expectation the gradient
      of the *forward* KL(pi_ref || pi_theta); GRPO's and verl's `low_var_kl`.

    Guards only where a value explodes. k1 and k2 are polynomials of a finite d and are never clamped: a
    clamp would take the gradient from exactly the most drifted tokens. k3's exp(-d) explodes as d -> -inf
    (pi_theta << pi_ref): there d is clamped below at -log_ratio_clamp before exp, and the value is capped
    at kl_clamp (with 10, below d = -2.61: such a token gets no gradient from the KL term, where the
    uncapped gradient pi_ref / pi_theta - 1 would exceed 12.6). Where d > 0, k3 ~ d - 1 grows like k1 and
    keeps its gradient. docs/learner.md compares this with verl, slime and AReaL.
    """
    if cfg.kl_estimator is KLEstimator.K1:
        return d
    if cfg.kl_estimator is KLEstimator.K2:
        return 0.5 * d * d
    if cfg.log_ratio_clamp > 0:
        d = d.clamp(min=-cfg.log_ratio_clamp)
    kl = torch.exp(-d) - 1 + d
    return torch.where(d < 0, kl.clamp(max=cfg.kl_clamp), kl) if cfg.kl_clamp > 0 else kl


def _check_shapes(logp_new: Tensor, advantages: Tensor, **per_token: Tensor | None) -> None:
    """ValueError unless `logp_new` is [B, Tr], every given `per_token` tensor has its shape and
    `advantages` is [B] or [B, Tr]."""
    shape = tuple(logp_new.shape)
    if len(shape) != 2:
        raise ValueError(f"policy_loss: logp_new of shape {shape}, expected [B, Tr]")
    for name, tensor in per_token.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"policy_loss: {name} of shape {tuple(tensor.shape)}, expected {shape}")
    if tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(f"policy_loss: advantages of shape {tuple(advantages.shape)}, expected {shape[:1]}")


def _aggregator(cfg: LossConfig, m: Tensor, n_samples: int, n_tokens: int) -> _Agg:
    """How per-token terms `[B, Tr]` (already zero off the mask) become this call's share of a scalar."""
    if cfg.algorithm is Algorithm.DAPO:
        return _Agg("tokens", m, float(max(n_tokens, 1)))
    if cfg.algorithm is Algorithm.DR_GRPO:
        return _Agg("tokens", m, float(max(n_samples, 1) * cfg.max_new_tokens))
    return _Agg("sequence_mean", m, float(max(n_samples, 1)))  # grpo, gspo


@dataclass(frozen=True, slots=True)
class _Agg:
    kind: str  # "tokens": sum / denominator; "sequence_mean": sum_i (mean over sample i) / denominator
    m: Tensor  # [B, Tr] response-token mask
    denominator: float

    def __call__(self, x: Tensor) -> Tensor:
        if self.kind == "tokens":
            return x.sum() / self.denominator
        lengths = self.m.sum(dim=1).clamp(min=1)  # [B]
        return (x.sum(dim=1) / lengths).sum() / self.denominator


def _surrogate(log_ratio: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor, Tensor]:
    """The clipped surrogate of each unit, where the clip is active and where the dual clip is.

    r = exp(clamp(log_ratio)); s = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and for A < 0 with the
    dual clip on, s = max(s, c A) (Ye et al. 2020; verl's core_algos.py `clip_ratio_c`, default 3; slime's
    `eps_clip_c`): without it a token with A < 0 and a huge ratio has an unbounded loss and gradient r |A|.
    """
    if cfg.log_ratio_clamp > 0:
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    surr = torch.minimum(ratio * adv, clipped_ratio * adv)
    active = ((ratio > 1 + cfg.eps_high) & (adv > 0)) | ((ratio < 1 - cfg.eps_low) & (adv < 0))
    dual = torch.zeros_like(active)
    if cfg.clip_ratio_c > 0:
        dual = (adv < 0) & (ratio > cfg.clip_ratio_c)
        surr = torch.where(adv < 0, torch.maximum(surr, cfg.clip_ratio_c * adv), surr)
    return surr, active, dual


def _is_weights(log_w: Tensor, m: Tensor, cfg: LossConfig, *, per_sample: bool) -> tuple[Tensor, Tensor]:
    """Detached IS weights and which units are rejected: `[B, Tr]` per token, or `[B]` per sample.

    Per token: w_t = pi_prox / pi_beh. Per sample (`is_level` sequence: the product over the sample's
    tokens; geometric, or gspo with token level: the geometric mean). The log is clamped to
    [-log_ratio_clamp, log_ratio_clamp] (verl's rollout correction bounds weights to [e^-20, e^20] too),
    a unit outside [is_mask_low, is_mask_high] is rejected (weight 0; verl's rejection sampling, AReaL's
    behav_imp_weight_cap), and `tis` truncates at tis_cap. `none` / `mask`: weight 1, nothing rejected.
    """
    if not needs_proximal(cfg.offpolicy):
        shape = m.shape[:1] if per_sample else m.shape
        return torch.ones(shape, dtype=m.dtype, device=m.device), torch.zeros(
            shape, dtype=torch.bool, device=m.device
        )
    if per_sample:
        log_w = log_w.sum(dim=1)  # [B]: log of the product
        if cfg.is_level is not ISLevel.SEQUENCE:
            log_w = log_w / m.sum(dim=1).clamp(min=1)  # log of the geometric mean
    if cfg.log_ratio_clamp > 0:
        log_w = log_w.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    w = torch.exp(log_w)
    rejected = torch.zeros_like(w, dtype=torch.bool)
    if cfg.is_mask_low > 0:
        rejected = rejected | (w < cfg.is_mask_low)
    if cfg.is_mask_high > 0:
        rejected = rejected | (w > cfg.is_mask_high)
    if cfg.offpolicy is OffPolicy.TIS:
        w = w.clamp(max=cfg.tis_cap)
    return torch.where(rejected, 0.0, w), rejected


def _per_token(w: Tensor, m: Tensor) -> Tensor:
    """A weight per token `[B, Tr]` from one per token or one per sample `[B]`."""
    return w[:, None].expand_as(m) if w.ndim == 1 else w


def _token_level(
    log_ratio: Tensor,
    w: Tensor,
    adv: Tensor,
    keep: Tensor,
    cfg: LossConfig,
    agg: _Agg,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    a = adv[:, None].expand_as(log_ratio) if adv.ndim == 1 else adv  # [B, Tr]
    surr, active, dual = _surrogate(log_ratio, a, cfg)
    pg = agg(torch.where(keep, -_per_token(w, log_ratio) * surr, 0.0))
    return pg, keep, active & keep, dual & keep


def _gspo(
    log_ratio: Tensor, w: Tensor, adv: Tensor, mask: Tensor, k: Tensor, cfg: LossConfig, n_samples: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    lengths = mask.sum(dim=1).to(k.dtype)  # L_i
    kept = k.sum(dim=1)  # K_i
    seq_log_ratio = log_ratio.sum(dim=1) / kept.clamp(min=1)  # [B]; log_ratio is 0 off the kept tokens
    a = adv if adv.ndim == 1 else torch.where(mask, adv, 0.0).sum(dim=1) / lengths.clamp(min=1)
    surr, active, dual = _surrogate(seq_log_ratio, a, cfg)
    seq_weight = w * kept / lengths.clamp(min=1)  # K_i / L_i: 0 for empty or fully masked samples
    pg = -(seq_weight * surr).sum() / max(n_samples, 1)
    units = kept > 0
    return pg, units, active & units, dual & units


def _stats(
    terms: tuple[Tensor, Tensor, Tensor, Tensor],
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_ref: Tensor | None,
    entropy: Tensor | None,
    masks: tuple[Tensor, Tensor, Tensor, int],
    clipping: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
    cfg: LossConfig,
) -> DeviceStats:
    """terms: (loss, pg, kl, entropy); masks: (mask, kept, versions, current_version); clipping: (units,
    clipped units, dual-clipped units, IS weights (read where `units`), rejected units). Every value stays
    on the device: no branch on a tensor's value, no boolean indexing (both read back to the host)."""
    loss, pg, kl_term, ent_term = terms
    mask, k, versions, current_version = masks
    units, clipped, dual, weights, rejected = clipping
    bound = cfg.log_ratio_clamp if cfg.log_ratio_clamp > 0 else math.inf
    d = torch.where(mask, logp_new - logp_behaviour, 0.0).clamp(-bound, bound)
    has_tokens = mask.any(dim=1)
    staleness = torch.zeros(mask.shape[0], dtype=torch.int64, device=mask.device)
    if mask.shape[1] > 0:  # min over an empty dimension raises: a micro-batch of empty responses has none
        oldest = torch.where(mask, versions, torch.iinfo(torch.int64).max).min(dim=1).values
        staleness = torch.where(has_tokens, current_version - oldest, 0)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    kl_ref_sum, kl_ref_tokens = zero, zero
    if logp_ref is not None:
        r = torch.where(mask, logp_ref - logp_new, 0.0).clamp(-bound, bound)
        kl_ref_sum, kl_ref_tokens = (torch.exp(r) - r - 1).sum(), mask.sum()
    unit_weights = torch.where(units, weights, 0.0)  # weights are >= 0: a max over units, 0 without any
    values = {
        "loss": loss,
        "pg_loss": pg,
        "kl_loss": kl_term,
        "entropy_loss": ent_term,
        "samples": has_tokens.sum(),
        "tokens": mask.sum(),
        "kept_tokens": (k > 0).sum(),
        "offpolicy_tokens": (mask & (versions < current_version)).sum(),
        "units": units.sum(),
        "clipped_units": clipped.sum(),
        "dual_clipped_units": dual.sum(),
        "is_masked_units": rejected.sum(),
        "is_weight_sum": unit_weights.sum(),
        "is_weight_max": unit_weights.max() if unit_weights.numel() else zero,
        "approx_kl_sum": (torch.exp(d) - 1 - d).sum(),  # k3 of KL(pi_beh || pi_theta), sampled by pi_beh
        "entropy_sum": torch.where(mask, entropy, 0.0).sum() if entropy is not None else zero,
        "entropy_tokens": mask.sum() if entropy is not None else zero,
        "kl_ref_sum": kl_ref_sum,
        "kl_ref_tokens": kl_ref_tokens,
        "staleness_sum": staleness.sum(),
        "staleness_max": staleness.max() if staleness.numel() else zero,
    }
    # each value cast to float64 before stacking: a float32 loss keeps its value, counts are exact
    return DeviceStats(torch.stack([values[n].detach().to(torch.float64) for n in STAT_FIELDS]))
