"""The learner on samples of episodes: observation tokens are context, never trained on or counted.

- The loss mask of `build_train_batch` against a slow reference that builds it token by token from the
  samples' spans, for random episodes (hypothesis), through the micro-batch cuts the step makes.
- Log-probs of a small random Llama (float64, built here with transformers), padded and packed, chunked
  head and full logits: each model token's equals that of its sequence run alone, so the model reads the
  observations before it; every observation position is 0.
- `policy_loss` on given log-probs, for every algorithm x off-policy mode: a sample's loss, its gradient
  and the step's statistics are unchanged by observation tokens inserted between its turns, whatever
  log-probs sit at their positions.
- `metrics.jsonl`'s `tokens_trained` counts model tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from episode_samples import LOGPROBS, TOKENS, episodes
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from april import protocol  # noqa: E402
from april.config import Algorithm, OffPolicy  # noqa: E402
from april.ledger import Ledger  # noqa: E402
from april.records import FinishReason, Sample  # noqa: E402
from april.wire_records import SampleBatch  # noqa: E402
from learner.batching import (  # noqa: E402
    TrainBatch,
    build_train_batch,
    response_logprobs,
    split_micro_batches,
)
from learner.losses import LossConfig, policy_loss  # noqa: E402
from learner.metrics import step_record  # noqa: E402
from learner.step import balanced_parts, mini_batches  # noqa: E402

VOCAB = 64
CURRENT = 3  # the learner's version in the loss tests


@st.composite
def episode_groups(draw: st.DrawFn, max_groups: int = 3, group: int = 2) -> list[Sample]:
    """Complete groups of finished, scored episodes (single-turn ones among them), shuffled."""
    n = draw(st.integers(1, max_groups), label="groups")
    samples = [
        draw(episodes(10 + g, i, finished=True), label="sample") for g in range(n) for i in range(group)
    ]
    return draw(st.permutations(samples), label="order")


def in_row_order(samples: list[Sample]) -> list[Sample]:
    """The samples in `build_train_batch`'s row order: groups by first appearance, then by index."""
    first: dict[int, int] = {}
    for s in samples:
        first.setdefault(s.group_id, len(first))
    return sorted(samples, key=lambda s: (first[s.group_id], s.index))


def reference_mask(samples: list[Sample], width: int) -> list[list[bool]]:
    """Token by token: response token j of a sample is trained on iff it exists and no observation
    holds it."""
    return [
        [j < s.response_len and not any(o.start <= j < o.end for o in s.observations) for j in range(width)]
        for s in samples
    ]


def reference_versions(samples: list[Sample], width: int) -> list[list[int]]:
    """Token by token: the version of the segment holding response token j, -1 where none does."""
    return [
        [next((g.version for g in s.segments if g.start <= j < g.end), -1) for j in range(width)]
        for s in samples
    ]


def assert_rows_match(part: TrainBatch, full: TrainBatch) -> None:
    """A micro-batch's rows are the full batch's rows `sample_index`, trimmed to its own widths."""
    rows = part.sample_index.tolist()
    tr = part.response_ids.shape[1]
    assert part.response_mask.tolist() == full.response_mask[rows, :tr].tolist()
    assert part.versions.tolist() == full.versions[rows, :tr].tolist()
    assert part.global_tokens == full.global_tokens
    assert not bool(full.response_mask[rows, tr:].any())  # nothing trained was cut off


@settings(max_examples=150, deadline=None)
@given(episode_groups())
def test_loss_mask_is_the_model_tokens_token_by_token(samples: list[Sample]) -> None:
    batch = build_train_batch(samples, n_samples_per_prompt=2)
    ordered = in_row_order(samples)
    tr = batch.response_ids.shape[1]
    want = reference_mask(ordered, tr)
    assert batch.response_mask.dtype == torch.bool
    assert batch.response_mask.tolist() == want
    assert batch.versions.tolist() == reference_versions(ordered, tr)
    assert batch.global_tokens == sum(map(sum, want)) == sum(s.model_tokens for s in samples)
    assert batch.response_lens.tolist() == [s.response_len for s in ordered]  # observations included
    for i, s in enumerate(ordered):  # the model reads the whole sequence: observations are in its input
        p = s.prompt_ids.shape[0]
        assert batch.input_ids[i, p : p + s.response_len].tolist() == s.response_ids.tolist()
        assert int(batch.attention_mask[i].sum()) == p + s.response_len
    for part in [*split_micro_batches(batch, 24), *balanced_parts(batch, 3)]:
        assert_rows_match(part, batch)
    for mini in mini_batches(batch, batch.size // 2, 2):  # one group each, its own normaliser
        rows = mini.sample_index.tolist()
        assert mini.global_tokens == sum(sum(want[r]) for r in rows)


# ---------------------------------------------------------------------------------------------------
# Log-probs under a model: observations are context


def llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        initializer_range=0.1,
    )
    config._attn_implementation = "sdpa"  # packed rows become block-causal from the position ids
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    return model.double().train(False)


@pytest.fixture(scope="module")
def model() -> Any:
    return llama()


def small_tokens(samples: list[Sample]) -> list[Sample]:
    """The samples with every token id folded into the model's vocabulary."""
    return [
        dataclasses.replace(s, prompt_ids=s.prompt_ids % VOCAB, response_ids=s.response_ids % VOCAB)
        for s in samples
    ]


@settings(max_examples=12, deadline=None)
@given(episode_groups(max_groups=2))
def test_logprobs_read_observations_as_context_and_are_zero_on_them(
    model: Any, samples: list[Sample]
) -> None:
    samples = small_tokens(samples)
    batch = build_train_batch(samples, n_samples_per_prompt=2)
    ordered = in_row_order(samples)
    temperature = 0.8
    with torch.no_grad():
        forms = {
            (packed, chunk): response_logprobs(model, batch, temperature, packed=packed, chunk_tokens=chunk)
            for packed in (False, True)
            for chunk in (0, 3)
        }
    for i, s in enumerate(ordered):
        sequence = torch.from_numpy(np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64))[None, :]
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0] / temperature  # this sequence alone, unpadded
        p = s.prompt_ids.shape[0]
        for j in range(s.response_len):
            want = float(
                logits[p + j - 1, int(s.response_ids[j])] - torch.logsumexp(logits[p + j - 1], dim=0)
            )
            trained = bool(batch.response_mask[i, j])
            for form, logp in forms.items():
                got = float(logp[i, j])
                assert (abs(got - want) < 1e-9) if trained else got == 0.0, (form, i, j, got, want)
    for logp in forms.values():
        assert bool((logp[~batch.response_mask] == 0).all())


def test_a_different_observation_changes_the_next_turn_s_logprobs(model: Any) -> None:
    """The model sees the observation: the same turns after another tool result have other log-probs."""

    def episode(observation: list[int]) -> Sample:
        s = Sample(1, 0, np.array([5, 6, 7], np.int32)).resumed()
        s = s.extend([8, 9], [-1.0, -1.0], 0, FinishReason.NONE).observed(observation)
        return s.extend([10, 11], [-1.0, -1.0], 0, FinishReason.STOP).scored(1.0)

    logps = []
    for observation in ([20, 21, 22], [30, 31, 32]):
        batch = build_train_batch([episode(observation)])
        with torch.no_grad():
            logps.append(response_logprobs(model, batch, 1.0))
    a, b = logps
    assert torch.equal(a[0, :2], b[0, :2])  # the first turn comes before the observation
    assert (a[0, 2:5] == 0).all() and (b[0, 2:5] == 0).all()
    assert (a[0, 5:7] - b[0, 5:7]).abs().min() > 1e-6  # the second turn reads it


# ---------------------------------------------------------------------------------------------------
# The loss on given log-probs: inserted observations change nothing


@st.composite
def turns_and_observations(
    draw: st.DrawFn,
) -> tuple[list[tuple[int, list[int], list[float]]], list[list[int]]]:
    """Turns (version, ids, behaviour log-probs), and the observation after each turn ([] for none)."""
    n = draw(st.integers(1, 4), label="turns")
    out, version = [], draw(st.integers(CURRENT - 2, CURRENT), label="first version")
    for k in range(n):  # the last turn under the current weights: some tokens always get loss
        version = CURRENT if k == n - 1 else min(CURRENT, version + draw(st.integers(0, 1), label="step"))
        k = draw(st.integers(1, 4), label="turn tokens")
        ids = draw(st.lists(TOKENS, min_size=k, max_size=k), label="ids")
        lps = draw(st.lists(LOGPROBS, min_size=k, max_size=k), label="logprobs")
        out.append((version, ids, lps))
    observations = [draw(st.lists(TOKENS, max_size=3), label="observation") for _ in range(n)]
    return out, observations


def build(group_id: int, index: int, turns: list[Any], observations: list[list[int]] | None) -> Sample:
    s = Sample(group_id, index, np.array([1, 2], np.int32)).resumed()
    for k, (version, ids, lps) in enumerate(turns):
        s = s.extend(ids, lps, version, FinishReason.NONE)
        if observations is not None and k < len(turns) - 1:
            s = s.observed(observations[k])
    return s.extend([], [], turns[-1][0], FinishReason.STOP).scored(float((group_id + index) % 2))


def model_values(batch: TrainBatch, values: list[np.ndarray], junk: float) -> torch.Tensor:
    """`[B, Tr]` with row b's model tokens given `values[b]` in order, `junk` everywhere else."""
    out = torch.full(batch.response_mask.shape, junk, dtype=torch.float64)
    for b, row in enumerate(values):
        out[b, batch.response_mask[b]] = torch.from_numpy(row)
    return out


def loss_of(batch: TrainBatch, cfg: LossConfig, values: dict[str, list[np.ndarray]], junk: float) -> Any:
    new = model_values(batch, values["new"], junk).requires_grad_(True)
    advantages = torch.linspace(-1.0, 1.0, batch.size, dtype=torch.float64)
    loss, stats = policy_loss(
        new,
        torch.where(batch.response_mask, batch.behaviour_logprobs.double(), junk),  # junk: never read
        model_values(batch, values["proximal"], junk),
        advantages,
        batch.response_mask,
        batch.versions,
        CURRENT,
        cfg,
        num_samples=batch.global_samples,
        num_tokens=batch.global_tokens,
        logp_ref=model_values(batch, values["ref"], junk),
        entropy=model_values(batch, values["entropy"], -junk),
    )
    (grad,) = torch.autograd.grad(loss, new)
    return float(loss.detach()), [g[m] for g, m in zip(grad, batch.response_mask, strict=True)], stats.host()


ALGOS = list(Algorithm)
MODES = list(OffPolicy)


@pytest.mark.parametrize("offpolicy", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("algorithm", ALGOS, ids=[a.value for a in ALGOS])
@settings(max_examples=25, deadline=None)
@given(st.lists(turns_and_observations(), min_size=4, max_size=4), st.integers(0, 2**31 - 1))
def test_inserted_observations_change_neither_loss_nor_gradient_nor_stats(
    algorithm: Algorithm, offpolicy: OffPolicy, episodes_turns: list[Any], seed: int
) -> None:
    cfg = LossConfig(
        algorithm=algorithm,
        offpolicy=offpolicy,
        eps_low=0.25,
        eps_high=0.35,
        max_new_tokens=32,
        kl_coef=0.1,
        entropy_coef=0.01,
        is_mask_high=4.0 if offpolicy in (OffPolicy.TIS, OffPolicy.DECOUPLED) else 0.0,
    )
    plain = [build(g // 2, g % 2, turns, None) for g, (turns, _) in enumerate(episodes_turns)]
    with_obs = [build(g // 2, g % 2, turns, obs) for g, (turns, obs) in enumerate(episodes_turns)]
    a, b = build_train_batch(plain), build_train_batch(with_obs)
    assert a.global_tokens == b.global_tokens
    rng = np.random.default_rng(seed)
    lengths = [s.model_tokens for s in plain]
    behaviour = [a.behaviour_logprobs[i][a.response_mask[i]].double().numpy() for i in range(a.size)]
    values = {  # near the behaviour's, so that the clip and the IS bounds leave some tokens their loss
        name: [lps + rng.uniform(-0.3, 0.3, lps.shape) for lps in behaviour]
        for name in ("new", "proximal", "ref")
    }
    values["entropy"] = [rng.random(n) * 2 for n in lengths]
    loss_a, grad_a, stats_a = loss_of(a, cfg, values, junk=0.0)
    loss_b, grad_b, stats_b = loss_of(b, cfg, values, junk=-37.5)  # anything at the observations
    assert math.isfinite(loss_a) and abs(loss_a - loss_b) <= 1e-12 * max(1.0, abs(loss_a)), (loss_a, loss_b)
    for x, y in zip(grad_a, grad_b, strict=True):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-14)
    assert any(bool(g.abs().sum() > 0) for g in grad_a)
    for name in (
        "tokens",
        "kept_tokens",
        "offpolicy_tokens",
        "samples",
        "units",
        "staleness_sum",
        "staleness_max",
    ):
        assert getattr(stats_a, name) == getattr(stats_b, name), name
    assert stats_a.approx_kl_sum == pytest.approx(stats_b.approx_kl_sum, rel=1e-10, abs=1e-14)
    assert stats_b.tokens == sum(lengths)


# ---------------------------------------------------------------------------------------------------
# metrics.jsonl


def test_tokens_trained_counts_model_tokens_and_lengths_the_whole_response() -> None:
    s0 = Sample(1, 0, np.array([1], np.int32)).resumed().extend([2, 3], [-1.0, -1.0], 0, FinishReason.NONE)
    s0 = s0.observed([4, 5, 6]).extend([7], [-1.0], 0, FinishReason.STOP).scored(1.0)
    s1 = Sample(1, 1, np.array([1], np.int32)).resumed().extend([2], [-1.0], 0, FinishReason.STOP).scored(0.0)
    batch = protocol.Batch(1, 0, 0, SampleBatch.from_samples([s0, s1]), {}, Ledger())
    record = step_record(
        step=0,
        version=0,
        mode="sync",
        batch=batch,
        step_time_s=1.0,
        learner_time_s=1.0,
        weight_sync_s=0.0,
        train={},
    )
    assert record["tokens_trained"] == 4  # 3 + 1 model tokens; the 3 observation tokens are context
    assert record["tokens_generated"] == 4  # the broker's figure when it sends one, else the same count
    assert record["response_len_max"] == 6 and record["response_len_mean"] == 3.5
