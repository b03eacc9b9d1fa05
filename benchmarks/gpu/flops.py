"""Model FLOPs of a training step and the utilisation they make of a peak: the arithmetic, nothing run.

Model FLOPs count what the model needs, not what the code happens to do (no recomputation, no extra
no-grad forwards, no padding):
- the matrix products of the weights: 6 FLOPs per weight per token forwarded (2 forward, 4 backward),
  over every `nn.Linear` weight, the output head included once (tied to the embedding or not; the
  embedding lookup itself does no arithmetic);
- attention's two products (query x key, attention x value), causal: a sequence of T tokens has
  T (T + 1) / 2 query-key pairs, each 2 x head_dim FLOPs per product per head forward, x 3 for
  forward + backward: 6 x layers x heads x head_dim x T (T + 1) per sequence.
Utilisation = achieved FLOP/s over a peak FLOP/s (the vendor's dense figure, or a matrix product
measured on the same GPU in the same run).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def matmul_weights(model: Any) -> int:
    """Weights that multiply activations: every `nn.Linear` weight (a tied head is its own Linear)."""
    from torch import nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def weight_flops(matmul_weights: int, tokens: int) -> float:
    """Forward + backward FLOPs of the weights' products over `tokens` tokens."""
    return 6.0 * matmul_weights * tokens


def attention_flops(layers: int, heads: int, head_dim: int, lengths: Iterable[int]) -> float:
    """Forward + backward FLOPs of causal attention's two products over sequences of `lengths` tokens."""
    return 6.0 * layers * heads * head_dim * sum(t * (t + 1) for t in lengths)


def utilisation(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Share of `peak_tflops` that `flops` in `seconds` achieved; None without a peak."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)
