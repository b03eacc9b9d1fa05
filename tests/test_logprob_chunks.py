"""The learner's memory-bounded forward equals the plain full-logits computation.

Log-probs and entropies from the final hidden states through the output head a chunk of positions at a
time (`learner.logprob_head`), packed or padded, and whole train steps over token-budgeted micro-batches,
against the reference: the model's full `[B, T, V]` logits, one padded micro-batch
(`chunk_tokens = 0`, `max_tokens = 0`). Small random Qwen3 (tied embeddings) and Llama (untied) models in
float64, built here with transformers (nothing downloaded): log-probs, entropies, the loss and the gradient
of every parameter agree to 1e-10 relative.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from april.config import AlgoConfig, Algorithm, ConfigError, LearnerConfig, OffPolicy  # noqa: E402
from april.hf import enable_activation_checkpointing  # noqa: E402
from april.records import FinishReason, Sample  # noqa: E402
from learner.batching import (  # noqa: E402
    TrainBatch,
    build_train_batch,
    response_logprobs,
    response_logprobs_and_entropy,
)
from learner.engine import TrainEngine, TrainSettings  # noqa: E402
from learner.losses import LossConfig  # noqa: E402
from learner.step import Layout, balanced_parts, budget_accumulation, part_cost, train_step  # noqa: E402

VOCAB = 1000
GROUP = 3
VERSION = 2
TOL = 1e-10


def qwen3(tied: bool = True) -> Any:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.1,
        tie_word_embeddings=tied,
    )
    return _build(transformers.Qwen3ForCausalLM, config)


def llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    return _build(transformers.LlamaForCausalLM, config)


def _build(cls: Any, config: Any) -> Any:
    config._attn_implementation = "sdpa"  # packed rows become block-causal from the position ids
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
    return model.double().train(False)


MODELS = {"qwen3-tied": qwen3, "llama-untied": llama}


def ragged_batch(seed: int, groups: int = 3) -> TrainBatch:
    """`groups` groups of GROUP samples, prompts of 1-6 tokens, responses of 0-17 tokens (one empty)."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = rng.integers(3, VOCAB, size=int(rng.integers(1, 7))).astype(np.int32)
        for i in range(GROUP):
            s = Sample(group_id=g, index=i, prompt_ids=prompt)
            n = 0 if (g, i) == (1, 1) else int(rng.integers(1, 18))
            if n:
                lps = -rng.random(n).astype(np.float32) - 0.1
                s = s.extend(rng.integers(3, VOCAB, size=n).astype(np.int32), lps, VERSION, FinishReason.STOP)
            else:
                s = s.extend(np.zeros(0, np.int32), np.zeros(0, np.float32), VERSION, FinishReason.LENGTH)
            samples.append(s.scored(float(rng.integers(0, 2))))
    return build_train_batch(samples, n_samples_per_prompt=GROUP)


def max_rel(a: Any, b: Any) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def forward_and_grads(model: Any, batch: TrainBatch, **kw: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Log-probs, entropies and the gradient of every parameter of a fixed weighting of both."""
    logp, entropy = response_logprobs_and_entropy(model, batch, 0.8, **kw)
    g = torch.Generator().manual_seed(7)
    w_logp = torch.randn(logp.shape, generator=g, dtype=torch.float64)
    w_ent = torch.randn(logp.shape, generator=g, dtype=torch.float64)
    loss = (logp * w_logp).sum() + (entropy * w_ent).sum()
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    return logp.detach(), entropy.detach(), dict(zip(params, grads, strict=True))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("packed", "chunk"), [(False, 1), (False, 5), (True, 7), (True, 512)])
def test_chunked_head_equals_full_logits(name: str, packed: bool, chunk: int) -> None:
    model = MODELS[name]()
    batch = ragged_batch(1)
    want_logp, want_ent, want_grads = forward_and_grads(model, batch, chunk_tokens=0)
    assert all(float(g.abs().max()) > 0 for g in want_grads.values()), "a parameter without gradient"
    logp, ent, grads = forward_and_grads(model, batch, chunk_tokens=chunk, packed=packed)
    assert logp.dtype == torch.float64 and logp.shape == batch.response_ids.shape
    assert max_rel(logp, want_logp) < TOL and max_rel(ent, want_ent) < TOL
    assert bool((logp[~batch.response_mask] == 0).all()) and bool((ent[~batch.response_mask] == 0).all())
    for key, want in want_grads.items():
        assert max_rel(grads[key], want) < TOL, key


@pytest.mark.parametrize("chunk", [0, 4])
def test_entropy_as_a_metric_builds_no_graph(chunk: int) -> None:
    model = qwen3()
    batch = ragged_batch(2)
    logp, entropy = response_logprobs_and_entropy(model, batch, 1.0, chunk_tokens=chunk, entropy_grad=False)
    _, want_entropy = response_logprobs_and_entropy(model, batch, 1.0, chunk_tokens=chunk)
    assert not entropy.requires_grad and logp.requires_grad
    assert max_rel(entropy, want_entropy.detach()) < TOL
    with torch.no_grad():
        plain = response_logprobs(model, batch, 1.0, chunk_tokens=chunk)
    assert max_rel(logp.detach(), plain) < TOL


def test_unsupported_heads_are_refused_in_one_line() -> None:
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=30.0,  # applied after the head: chunking the head alone would be wrong
    )
    model = transformers.Gemma2ForCausalLM(config).double().train(False)
    batch = ragged_batch(3)
    with pytest.raises(ValueError, match=r"model_type = 'gemma2' is not supported.*logprob_chunk_tokens = 0"):
        response_logprobs(model, batch)
    with torch.no_grad():  # the full-logits path takes any causal LM
        assert response_logprobs(model, batch, chunk_tokens=0).shape == batch.response_ids.shape


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_token_budget_is_the_least_count_that_fits(packed: bool, world: int) -> None:
    batch = ragged_batch(4, groups=4)
    for budget in (1, 10, 24, 40, 10_000):
        k = budget_accumulation(batch, 1, budget, world, packed)
        parts = balanced_parts(batch, k * world)
        assert sorted(i for p in parts for i in p.sample_index.tolist()) == list(range(batch.size))
        assert all(p.size == 1 or part_cost(p, packed) <= budget for p in parts)
        if k > max(1, math.ceil(batch.tokens / (budget * world))):  # raised past the floor: k - 1 won't fit
            assert any(
                p.size > 1 and part_cost(p, packed) > budget for p in balanced_parts(batch, (k - 1) * world)
            )
    assert budget_accumulation(batch, 3, 0, world, packed) == 3  # no budget: the fixed count
    assert budget_accumulation(batch, 5, 10_000, world, packed) == 5  # the count is a floor


def run_step(
    model: Any, batch: TrainBatch, cfg: LossConfig, layout: Layout, checkpointing: bool = False
) -> tuple[dict[str, Any], Any]:
    """One `train_step` on a copy of `model` (plain torch, float64); the accumulated gradient of every
    parameter just before the optimizer step, and the step's metrics."""
    model = copy.deepcopy(model)
    if checkpointing:  # as learner.gradient_checkpointing sets it
        enable_activation_checkpointing(model)
        assert model.is_activation_checkpointing
    engine = TrainEngine(model, TrainSettings(backend="torch", lr=1e-3, grad_clip=0.0))
    seen: dict[str, Any] = {}
    step = engine.step

    def record_then_step() -> float:
        seen["accumulation"] = engine.accumulation
        for n, p in engine.module.named_parameters():
            seen[n] = p.grad.detach().clone()
        return step()

    engine.step = record_then_step  # type: ignore[method-assign]
    metrics = train_step(
        engine, batch, cfg, version=VERSION, temperature=0.9, group_size=GROUP, layout=layout
    )
    return seen, metrics


@pytest.mark.parametrize(
    ("entropy_coef", "packed", "checkpointing"),
    [(0.0, False, False), (0.0, True, False), (0.01, False, False), (0.01, True, False), (0.01, False, True)],
)
def test_train_step_with_budget_chunks_and_packing_equals_plain(
    entropy_coef: float, packed: bool, checkpointing: bool
) -> None:
    model = qwen3()
    batch = ragged_batch(5, groups=4)
    algo = AlgoConfig(algorithm=Algorithm.DAPO, offpolicy=OffPolicy.TIS, n_samples_per_prompt=GROUP)
    cfg = LossConfig.from_algo(algo, entropy_coef=entropy_coef)
    want, want_m = run_step(model, batch, cfg, Layout(micro_batches=1, max_tokens=0, chunk_tokens=0))
    layout = Layout(max_tokens=30, chunk_tokens=3, packed=packed)
    got, got_m = run_step(model, batch, cfg, layout, checkpointing)
    assert want["accumulation"] == 1 and got["accumulation"] > 2  # the budget did split the batch
    for key in want:
        if key != "accumulation":
            assert max_rel(got[key], want[key]) < TOL, key
    for key in ("loss", "pg_loss", "entropy"):
        assert got_m[key] == pytest.approx(want_m[key], rel=TOL, abs=1e-14), key


def test_learner_config_checks_the_new_keys() -> None:
    assert LearnerConfig().max_tokens_per_micro_batch > 0 and LearnerConfig().logprob_chunk_tokens > 0
    for key in ("max_tokens_per_micro_batch", "logprob_chunk_tokens"):
        with pytest.raises(ConfigError, match=f"learner.{key}"):
            LearnerConfig(**{key: -1})
