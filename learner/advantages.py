"""Per-group advantages and DAPO's overlong reward shaping.

Owns the map from a batch's rewards, laid out one row per group (`[G, n]`: G prompts, n samples each),
to one advantage per sample, for every `algo.algorithm`, and the soft overlong penalty of DAPO (a reward
term that depends only on the response length).

Does not own how an advantage is spread over tokens or aggregated (`learner.losses`), nor how samples
are gathered into a batch (`learner.batching`). Pure torch on small tensors; no model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from april.config import Algorithm


def group_advantages(rewards: Tensor, algorithm: Algorithm | str, eps: float = 1e-6) -> Tensor:
    """Advantages `[G, n]` from rewards `[G, n]` (row g = the n samples of group g), same dtype.

    With mean_g = (1/n) sum_j r_gj and std_g = sqrt(sum_j (r_gj - mean_g)^2 / (n - 1)) (Bessel-corrected,
    as `Tensor.std()` in TRL and slime; 0 when n == 1):

    - `grpo`:    A_gi = (r_gi - mean_g) / (std_g + eps)
    - `dapo`:    same as grpo (DAPO changes the clip, the aggregation and the rewards, not the baseline)
    - `gspo`:    same as grpo (the GSPO paper keeps the group-normalised advantage)
    - `dr_grpo`: A_gi = r_gi - mean_g (no std division; its length normalisation is removed in the loss)

    A group whose rewards are all equal gets exactly 0 for every sample (no learning signal): such groups
    are found by comparing the rewards themselves, since a computed mean can miss a fractional reward by
    a rounding (seven float32 rewards of 0.1 gave -0.0074 each once divided by std + eps). The rest is
    computed in float64 and returned in the rewards' dtype.
    """
    algo = Algorithm(algorithm)
    if rewards.ndim != 2 or rewards.shape[1] < 1:
        raise ValueError(f"group_advantages: rewards of shape {tuple(rewards.shape)}, expected [G, n>=1]")
    if not rewards.is_floating_point():
        raise ValueError(f"group_advantages: rewards of dtype {rewards.dtype}, expected a floating dtype")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("group_advantages: non-finite reward (expected every sample scored)")
    if eps < 0:
        raise ValueError(f"group_advantages: eps = {eps}, expected >= 0")
    r = rewards.to(torch.float64)
    uniform = (r == r[:, :1]).all(dim=1, keepdim=True)  # [G, 1]
    centred = torch.where(uniform, 0.0, r - r.mean(dim=1, keepdim=True))
    if algo is Algorithm.DR_GRPO or rewards.shape[1] == 1:  # a group of one is uniform: 0
        return centred.to(rewards.dtype)
    std = r.std(dim=1, keepdim=True, correction=1)
    if eps == 0:  # a uniform group (std 0) would give 0/0; its advantage is already 0
        return torch.where(std > 0, centred / torch.where(std > 0, std, 1.0), 0.0).to(rewards.dtype)
    return (centred / (std + eps)).to(rewards.dtype)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment: a reward term (<= 0) per response, from its length in tokens.

    With L_max = max_new_tokens and the buffer L_cache = buffer (DAPO section 3.4):

        R(L) = 0                                        if L <= L_max - L_cache
        R(L) = penalty * ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
        R(L) = -penalty                                 if L > L_max

    `lengths` is `[B]` (integer token counts); returns `[B]` float32, to be added to the task reward
    before `group_advantages`. `buffer == 0` disables the ramp (only L > L_max, which cannot happen
    when generation is capped at max_new_tokens, is punished).
    """
    if max_new_tokens <= 0:
        raise ValueError(f"overlong_penalty: max_new_tokens = {max_new_tokens}, expected > 0")
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong_penalty: buffer = {buffer}, expected in [0, {max_new_tokens}]")
    if penalty < 0:
        raise ValueError(f"overlong_penalty: penalty = {penalty}, expected >= 0")
    length = lengths.to(torch.float64)
    expected = float(max_new_tokens - buffer)
    ramp = (expected - length) / max(buffer, 1) * penalty
    out = torch.where(length <= expected, 0.0, torch.where(length <= max_new_tokens, ramp, -penalty))
    return out.to(torch.float32)
