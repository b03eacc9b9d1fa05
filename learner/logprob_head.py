"""Response log-probs from final hidden states, a chunk of positions at a time: memory in tokens, not
tokens x vocabulary.

Owns which architectures this is exact for and the chunked head: `chunked_head_logprobs` applies the
model's own output head (`get_output_embeddings()`, tied or not) to `[N, H]` hidden states
`chunk_tokens` rows at a time, then log-softmax (and entropy, only when asked) in float32 or wider. Under
autograd each chunk is a `torch.utils.checkpoint` region: the forward keeps only the chunk's hidden
states and the backward recomputes the chunk's logits, so at most one chunk's `[chunk, V]` logits (and
their gradient) exist at once.

Exact only where the causal LM's logits are `lm_head(final hidden state)` with nothing after: Llama,
Mistral, Qwen2 and Qwen3 in transformers. Architectures that scale or soft-cap logits after the head
(Gemma 2/3's final soft-capping, Cohere's logit_scale, Granite's logits_scaling, ...) are refused by
`check_supported` rather than trained on a silently different distribution; they can use the plain
full-logits path (`learner.logprob_chunk_tokens = 0`). Does not run the model (`learner.batching`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# What to compute of the entropy: with its graph (an entropy term in the loss), its value only (a metric).
Entropy = Literal["grad", "value"] | None

# model_type of the transformers causal LMs whose forward ends with `logits = lm_head(hidden)`.
PLAIN_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def hf_model(model: Any) -> Any:
    """The Hugging Face model behind `model` (a DeepSpeed engine's `.module`, or the model itself)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def check_supported(model: Any) -> None:
    """Raise ValueError (one line) unless `model`'s logits are exactly its output head on the final
    hidden states."""
    config = getattr(hf_model(model), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PLAIN_HEAD_MODEL_TYPES:
        raise ValueError(
            f"learner.logprob_chunk_tokens > 0: model_type = {model_type!r} is not supported (expected one "
            f"of {', '.join(PLAIN_HEAD_MODEL_TYPES)}, whose logits are the output head alone); "
            "set learner.logprob_chunk_tokens = 0 to use the full logits"
        )


def output_head(model: Any) -> nn.Module:
    """The model's output projection (`lm_head`; the input embedding itself when tied)."""
    head = hf_model(model).get_output_embeddings()
    if not isinstance(head, nn.Module):
        raise ValueError(f"model has no output embeddings module (got {type(head).__name__})")
    return head


def entropy_of(logp_all: Tensor, *, grad: bool) -> Tensor:
    """Entropy `[...]` (nats) of log-distributions `[..., V]`; without `grad`, a detached value whose
    `[..., V]` intermediates are freed at once instead of being kept for a backward."""
    if grad:
        return -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        return -(logp_all.exp() * logp_all).sum(-1)


def head_logprobs(
    head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, entropy: Entropy
) -> tuple[Tensor, Tensor | None]:
    """Log-prob `[n]` of `targets` `[n]` under log_softmax(head(hidden `[n, H]`) / temperature), and the
    entropy `[n]` (nats) unless `entropy` is None; in float32, or the head's dtype if wider."""
    logits = head(hidden)  # [n, V], the model's dtype (bf16 on GPU)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if entropy is None:
        return logp, None
    return logp, entropy_of(logp_all, grad=entropy == "grad")


def chunked_head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    chunk_tokens: int,
    entropy: Entropy,
) -> tuple[Tensor, Tensor | None]:
    """`head_logprobs` over `hidden` `[N, H]`, `chunk_tokens` rows at a time; recomputed in backward."""
    if chunk_tokens < 1:
        raise ValueError(f"chunked_head_logprobs: chunk_tokens = {chunk_tokens}, expected >= 1")
    needs_grad = hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    grad = torch.is_grad_enabled() and needs_grad
    logps: list[Tensor] = []
    entropies: list[Tensor] = []
    for start in range(0, max(int(hidden.shape[0]), 1), chunk_tokens):
        args = (head, hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens])
        if grad:
            # non-reentrant: the recomputation runs the head module again (ZeRO-3 gathers its weight)
            logp, ent = checkpoint(
                head_logprobs, *args, temperature, entropy, use_reentrant=False, preserve_rng_state=False
            )
        else:
            logp, ent = head_logprobs(*args, temperature, entropy)
        logps.append(logp)
        if ent is not None:
            entropies.append(ent)
    return torch.cat(logps), torch.cat(entropies) if entropy is not None else None
