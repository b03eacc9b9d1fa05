"""From exactly-N samples to tensors: the train batch, its micro-batches and the response log-probs.

Owns `TrainBatch` (padded tensors of one step's samples, with their behaviour log-probs, per-token policy
versions from the segments, the loss mask, rewards and group layout), `build_train_batch`,
`split_micro_batches` (bounded token counts; every micro-batch carries the *global* normalisers, so
gradients accumulated over the micro-batches equal the one-batch gradient exactly) and
`response_logprobs` (log-probs of the response tokens under a model, the distribution the engines report:
log_softmax(logits / temperature)), by default from the final hidden states at the response positions a
chunk at a time (`learner.logprob_head`), or from the model's full logits (`chunk_tokens=0`).

Layout (B samples, T = longest prompt+response, Tr = longest response):

    input_ids   [B, T]   prompt_b ++ response_b, right-padded with pad_id
    response_*  [B, Tr]  response token j of sample b in column j (left-aligned), padded after R_b

Response token j of sample b sits at column P_b + j of `input_ids` and is predicted by the logits at column
P_b + j - 1 (P_b = prompt length >= 1). An episode's observation tokens are in the response as context,
outside the loss mask: only the model's tokens (the segments') are trained on and counted. Does not
compute advantages or losses (`learner.advantages`, `learner.losses`) and never talks to the broker.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from april.config import DEFAULT_LOGPROB_CHUNK_TOKENS
from april.records import Sample, SampleStatus
from learner.logprob_head import Entropy, check_supported, chunked_head_logprobs, entropy_of, output_head


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """One step's samples (or a micro-batch of them) as padded tensors. All tensors on one device."""

    input_ids: Tensor  # [B, T] int64: prompt ++ response, then pad_id
    attention_mask: Tensor  # [B, T] int64: 1 on prompt and response tokens, 0 on padding
    prompt_lens: Tensor  # [B] int64: P_b >= 1 tokens
    response_lens: Tensor  # [B] int64: R_b >= 0 tokens
    response_ids: Tensor  # [B, Tr] int64: response tokens, pad_id after R_b
    response_mask: Tensor  # [B, Tr] bool: model tokens (in a segment), the loss mask before off-policy masks
    behaviour_logprobs: Tensor  # [B, Tr] float32: engine log-prob of each model token (nats), 0 elsewhere
    versions: Tensor  # [B, Tr] int64: policy version that generated each model token, -1 elsewhere
    rewards: Tensor  # [B] float32: task reward (plus any shaping already applied)
    advantages: Tensor  # [B] float32: per-sample advantage; zeros until `with_advantages`
    group_index: Tensor  # [B] int64: 0..G-1, the group's position in the full batch
    sample_index: Tensor  # [B] int64: the sample's row in the full batch (micro-batches keep it)
    global_samples: int  # samples in the full batch (N): the per-sample loss normaliser
    global_tokens: int  # model tokens in the full batch (the mask's): DAPO's token-level loss normaliser

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        """Prompt + response tokens in this batch (no padding)."""
        return int(self.attention_mask.sum())

    @property
    def padded_tokens(self) -> int:
        """B * T: what a padded forward pass computes over."""
        return int(self.input_ids.numel())

    def group_rewards(self) -> Tensor:
        """Rewards as `[G, n]` (row g = group g's samples in index order); full batches only."""
        if self.size != self.global_samples:
            raise ValueError(f"group_rewards: a micro-batch ({self.size} of {self.global_samples} samples)")
        n_groups = int(self.group_index.max()) + 1
        return self.rewards.view(n_groups, self.size // n_groups)

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return dataclasses.replace(self, **moved)


def build_train_batch(
    samples: Sequence[Sample], *, pad_id: int = 0, n_samples_per_prompt: int | None = None
) -> TrainBatch:
    """Pad N finished, scored samples (complete groups of equal size) into a `TrainBatch`.

    Rows are ordered group by group (groups in order of first appearance, samples by `index`), so
    `rewards.view(G, n)` is the per-group layout `group_advantages` takes.
    """
    if not samples:
        raise ValueError("build_train_batch: no samples (expected exactly N complete-group samples)")
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        s.check()
        if s.status != SampleStatus.FINISHED:
            raise ValueError(f"build_train_batch: sample {s.key} is {s.status.name}, expected FINISHED")
        if not math.isfinite(s.reward):
            raise ValueError(f"build_train_batch: sample {s.key} has reward {s.reward}, expected a number")
        if s.prompt_ids.shape[0] < 1:
            raise ValueError(f"build_train_batch: sample {s.key} has an empty prompt (expected >= 1 token)")
        groups.setdefault(s.group_id, []).append(s)
    n = n_samples_per_prompt or len(next(iter(groups.values())))
    for gid, members in groups.items():
        indices = sorted(m.index for m in members)
        if indices != list(range(n)):
            raise ValueError(
                f"build_train_batch: group {gid} has sample indices {indices}, expected 0..{n - 1}"
            )
    ordered, group_of = _rows(groups)
    return _pad(ordered, group_of, pad_id)


def row_keys(samples: Sequence[Sample]) -> list[tuple[int, int]]:
    """The (group id, index) of each row `build_train_batch` makes of `samples`, in row order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return [s.key for s in _rows(groups)[0]]


def _rows(groups: dict[int, list[Sample]]) -> tuple[list[Sample], list[int]]:
    """Rows group by group (groups in order of first appearance, samples by `index`), each row's group."""
    ordered = [s for members in groups.values() for s in sorted(members, key=lambda m: m.index)]
    group_of = [g for g, members in enumerate(groups.values()) for _ in members]
    return ordered, group_of


def _pad(ordered: Sequence[Sample], group_of: Sequence[int], pad_id: int) -> TrainBatch:
    b = len(ordered)
    p_lens = [int(s.prompt_ids.shape[0]) for s in ordered]
    r_lens = [s.response_len for s in ordered]
    t, tr = max(p + r for p, r in zip(p_lens, r_lens, strict=True)), max(r_lens)
    input_ids = np.full((b, t), pad_id, dtype=np.int64)
    attention = np.zeros((b, t), dtype=np.int64)
    response_ids = np.full((b, tr), pad_id, dtype=np.int64)
    behaviour = np.zeros((b, tr), dtype=np.float32)
    versions = np.full((b, tr), -1, dtype=np.int64)
    for i, s in enumerate(ordered):
        p, r = p_lens[i], r_lens[i]
        input_ids[i, :p] = s.prompt_ids
        input_ids[i, p : p + r] = s.response_ids
        attention[i, : p + r] = 1
        response_ids[i, :r] = s.response_ids
        behaviour[i, :r] = s.response_logprobs
        for seg in s.segments:
            versions[i, seg.start : seg.end] = seg.version
    # the segments cover exactly the model's tokens (Sample.check): observations and padding keep -1
    model = torch.from_numpy(versions >= 0)
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        prompt_lens=torch.tensor(p_lens, dtype=torch.int64),
        response_lens=torch.tensor(r_lens, dtype=torch.int64),
        response_ids=torch.from_numpy(response_ids),
        response_mask=model,
        behaviour_logprobs=torch.from_numpy(behaviour),
        versions=torch.from_numpy(versions),
        rewards=torch.tensor([s.reward for s in ordered], dtype=torch.float32),
        advantages=torch.zeros(b, dtype=torch.float32),
        group_index=torch.tensor(list(group_of), dtype=torch.int64),
        sample_index=torch.arange(b, dtype=torch.int64),
        global_samples=b,
        global_tokens=int(model.sum()),
    )


def with_advantages(batch: TrainBatch, advantages: Tensor) -> TrainBatch:
    """The batch with per-sample advantages `[B]` (e.g. `group_advantages(...).reshape(-1)`) set."""
    if tuple(advantages.shape) != (batch.size,):
        raise ValueError(f"with_advantages: shape {tuple(advantages.shape)}, expected ({batch.size},)")
    return dataclasses.replace(batch, advantages=advantages.to(torch.float32).to(batch.rewards.device))


def select(batch: TrainBatch, rows: Sequence[int]) -> TrainBatch:
    """The sub-batch of `rows`, trimmed to its own longest sequence; global normalisers are kept."""
    if not rows:
        raise ValueError("select: no rows")
    idx = torch.tensor(list(rows), dtype=torch.int64, device=batch.input_ids.device)
    t = int((batch.prompt_lens[idx] + batch.response_lens[idx]).max())
    tr = int(batch.response_lens[idx].max())
    cut: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, Tensor):
            value = value[idx]
            if f.name in ("input_ids", "attention_mask"):
                value = value[:, :t]
            elif value.ndim == 2:
                value = value[:, :tr]
            cut[f.name] = value
    return dataclasses.replace(batch, **cut)


def split_micro_batches(batch: TrainBatch, max_tokens: int) -> list[TrainBatch]:
    """Split into micro-batches whose padded size (rows x longest prompt+response) is <= max_tokens.

    Samples are sorted longest first (stable) and packed greedily, which keeps padding low; a single
    sample longer than `max_tokens` gets a micro-batch of its own. Every micro-batch keeps
    `global_samples` / `global_tokens` of the full batch, so per-micro-batch losses computed with them
    sum to the full-batch loss and their accumulated gradients equal its gradient.
    """
    if max_tokens <= 0:
        raise ValueError(f"split_micro_batches: max_tokens = {max_tokens}, expected > 0")
    lengths = (batch.prompt_lens + batch.response_lens).tolist()
    order = sorted(range(batch.size), key=lambda i: -lengths[i])
    parts: list[list[int]] = []
    for i in order:  # longest first: the first row of a part fixes its padded width
        if parts and (len(parts[-1]) + 1) * lengths[parts[-1][0]] <= max_tokens:
            parts[-1].append(i)
        else:
            parts.append([i])
    return [select(batch, rows) for rows in parts]


def response_logprobs(
    model: Callable[..., Any],
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    packed: bool = False,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
) -> Tensor:
    """Log-probs `[B, Tr]` of the response tokens under `model`: log_softmax(logits / temperature).

    The model reads every token (an episode's observations are context) but the log-probs are gathered
    at the positions of `batch.response_mask` only: 0 on observations, padding and emptied rows.
    Computed in float32 (or the logits' dtype if wider), the distribution the engines report.
    `packed=True` runs one padding-free row (sequences concatenated, positions restarting at 0 and no
    attention mask), which Hugging Face models with packed-sequence support (e.g. Llama under
    SDPA) turn into a block-causal mask; models without that support must use the padded default.
    `chunk_tokens` > 0 applies the output head `chunk_tokens` response positions at a time to the final
    hidden states (`learner.logprob_head`: Llama, Qwen2, Qwen3); 0 takes the model's full logits.
    """
    return _response_forward(model, batch, temperature, packed, chunk_tokens, entropy=None)[0]


def response_logprobs_and_entropy(
    model: Callable[..., Any],
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    packed: bool = False,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """`response_logprobs` and the entropy `[B, Tr]` (nats) of each response position's distribution;
    `entropy_grad=False` gives the entropy as a detached value (a metric) and builds no graph for it."""
    mode: Entropy = "grad" if entropy_grad else "value"
    logp, entropy = _response_forward(model, batch, temperature, packed, chunk_tokens, entropy=mode)
    assert entropy is not None
    return logp, entropy


def _response_forward(
    model: Callable[..., Any],
    batch: TrainBatch,
    temperature: float,
    packed: bool,
    chunk_tokens: int,
    *,
    entropy: Entropy,
) -> tuple[Tensor, Tensor | None]:
    if not temperature > 0:
        raise ValueError(f"response_logprobs: temperature = {temperature}, expected > 0")
    if chunk_tokens < 0:
        raise ValueError(f"response_logprobs: chunk_tokens = {chunk_tokens}, expected >= 0 (0: full logits)")
    device = batch.input_ids.device
    b, t = batch.input_ids.shape
    tr = batch.response_ids.shape[1]
    lengths = batch.prompt_lens + batch.response_lens  # [B]
    cols = torch.arange(tr, device=device)[None, :]  # [1, Tr]
    chunked = chunk_tokens > 0
    extra: dict[str, Any] = {"output_hidden_states": True, "logits_to_keep": 1} if chunked else {}
    if chunked:
        check_supported(model)
    if packed:
        keep = batch.attention_mask.bool()
        flat_ids = batch.input_ids[keep][None, :]  # [1, S], S = sum of lengths
        starts = torch.cumsum(lengths, 0) - lengths  # [B]: where each sequence starts in the row
        positions = torch.arange(flat_ids.shape[1], device=device) - torch.repeat_interleave(starts, lengths)
        out = model(input_ids=flat_ids, position_ids=positions[None, :], use_cache=False, **extra)
        row_start = starts
    else:
        positions = torch.arange(t, device=device)[None, :].expand(b, t)
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=positions,
            use_cache=False,
            **extra,
        )
        row_start = torch.arange(b, device=device) * t
    # the position predicting response token j of row b: column P_b + j - 1 of that row (clamped on pad)
    within = (batch.prompt_lens[:, None] - 1 + cols).clamp(max=(lengths[:, None] - 1).clamp(min=0))
    mask = batch.response_mask
    if chunked:
        # the final hidden states (after the final norm), gathered at the N real response positions only:
        # [N, H]; the head then sees `chunk_tokens` of them at a time, never [B, T, V]
        hidden = out.hidden_states[-1]
        flat_index = (row_start[:, None] + within)[mask]  # [N]
        picked_hidden = hidden.reshape(-1, hidden.shape[-1])[flat_index]
        logp_n, entropy_n = chunked_head_logprobs(
            output_head(model), picked_hidden, batch.response_ids[mask], temperature, chunk_tokens, entropy
        )
        logp = logp_n.new_zeros(mask.shape).masked_scatter(mask, logp_n)
        if entropy_n is None:
            return logp, None
        return logp, entropy_n.new_zeros(mask.shape).masked_scatter(mask, entropy_n)
    logits = out if isinstance(out, Tensor) else out.logits  # [B, T, V] or [1, S, V]
    flat = logits.reshape(-1, logits.shape[-1])
    picked = flat[row_start[:, None] + within]  # [B, Tr, V]
    picked = picked.to(torch.promote_types(picked.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(picked, dim=-1)  # [B, Tr, V]
    logp = logp_all.gather(-1, batch.response_ids[..., None]).squeeze(-1)  # [B, Tr]
    logp = torch.where(mask, logp, 0.0)
    if entropy is None:
        return logp, None
    return logp, torch.where(mask, entropy_of(logp_all, grad=entropy == "grad"), 0.0)  # [B, Tr]
