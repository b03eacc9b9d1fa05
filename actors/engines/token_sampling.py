"""Drawing the next token of every row from its logits, with fixed shapes and no host synchronisation.

Owns the sampling rule of the torch engine: the log-prob reported is that of the drawn token under
`log_softmax(logits / temperature)` in float32 (before truncation), what the learner recomputes; the token
is drawn from the distribution truncated by top-k and top-p, or is the argmax for a greedy row. The draw is
`argmax(probs / noise)` with `noise` exponential: what `torch.multinomial` does for one sample, so the same
seeded noise gives the same tokens; the noise is drawn by the caller, outside any captured CUDA graph, so
that the engine's one seeded generator advances the same way eagerly and on replay.
Does not own the generator, the rows or the logits' model.
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    noise: torch.Tensor | None,
    greedy_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens `[B]` and their log-probs `[B]` (float32) for logits `[B, V]`.

    `noise` `[B, V]` (exponential, float32) is None when every row is greedy; `greedy_rows` `[B]` (bool)
    marks the rows that take the argmax among sampled ones.
    """
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    if noise is not None:
        probs = torch.softmax(truncate(scaled, top_k, top_p), dim=-1)
        drawn = (probs / noise).argmax(dim=-1)
        tokens = drawn if greedy_rows is None else torch.where(greedy_rows, tokens, drawn)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf the logits outside the top-k and outside the smallest top-p nucleus. `[B, V]`."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, index = scaled.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each token
        ordered = ordered.masked_fill(before > top_p, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, index, ordered)
    return scaled
