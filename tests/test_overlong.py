"""DAPO's overlong handling, wired (learner.overlong, called by learner.model_trainer): the soft punishment
reaches the rewards before advantages and overlong filtering takes truncated samples out of the loss.

The shaped rewards are checked against DAPO's formula written plainly here; the wiring through the
trainer a training run uses (`ModelTrainer.train` on a tiny model) is checked by the step's figures.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from april import protocol  # noqa: E402
from april.config import AlgoConfig, Algorithm, Config, ConfigError, LearnerConfig, load_config  # noqa: E402
from april.hf import make_tiny_model  # noqa: E402
from april.ledger import Ledger  # noqa: E402
from april.records import FinishReason, Sample  # noqa: E402
from april.wire_records import SampleBatch  # noqa: E402
from learner.batching import build_train_batch  # noqa: E402
from learner.model_trainer import ModelTrainer  # noqa: E402
from learner.overlong import apply_overlong, truncated_rows  # noqa: E402

MAX_NEW = 10
GROUP = 4
# (response length, finish reason) per sample of two groups: the budget is MAX_NEW tokens
SHAPES = [
    [(3, FinishReason.STOP), (10, FinishReason.LENGTH), (7, FinishReason.STOP), (9, FinishReason.STOP)],
    [(10, FinishReason.LENGTH), (1, FinishReason.STOP), (8, FinishReason.STOP), (6, FinishReason.STOP)],
]


def samples(seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for g, shapes in enumerate(SHAPES):
        prompt = rng.integers(3, 200, size=3).astype(np.int32)
        for i, (n, reason) in enumerate(shapes):
            s = Sample(group_id=50 + g, index=i, prompt_ids=prompt)
            lps = (-rng.random(n) - 0.1).astype(np.float32)
            s = s.extend(rng.integers(3, 200, size=n).astype(np.int32), lps, 2, reason)
            out.append(s.scored(float(i % 2)))
    random.Random(seed).shuffle(out)  # the batch restores group order; truncated_rows must follow it
    return out


def dapo_reward_term(length: int, max_new: int, buffer: int, penalty: float) -> float:
    """DAPO (section 3.4), as the paper writes it."""
    if length <= max_new - buffer:
        return 0.0
    if length <= max_new:
        return ((max_new - buffer) - length) / buffer * penalty
    return -penalty


def test_buffer_defaults_on_for_dapo_only() -> None:
    assert AlgoConfig(algorithm=Algorithm.DAPO, max_new_tokens=20480).overlong_buffer_tokens == 4096
    assert AlgoConfig(algorithm=Algorithm.GRPO).overlong_buffer_tokens == 0
    assert AlgoConfig(algorithm=Algorithm.DAPO, overlong_buffer=0).overlong_buffer_tokens == 0
    assert AlgoConfig(algorithm=Algorithm.GSPO, overlong_buffer=16).overlong_buffer_tokens == 16
    assert not AlgoConfig(algorithm=Algorithm.DAPO).overlong_filter
    with pytest.raises(
        ConfigError, match=r"^algo\.overlong_buffer = 300: must be <= algo\.max_new_tokens \(256\)"
    ):
        load_config(env={}, overrides={"algo.overlong_buffer": 300})
    with pytest.raises(ConfigError, match=r"^algo\.overlong_penalty = -1\.0: must be >= 0"):
        load_config(env={}, overrides={"algo.overlong_penalty": -1.0})


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_apply_overlong_shapes_rewards_and_filters_truncated_samples(overlong_filter: bool) -> None:
    algo = AlgoConfig(
        algorithm=Algorithm.DAPO,
        max_new_tokens=MAX_NEW,
        overlong_buffer=4,
        overlong_penalty=0.5,
        overlong_filter=overlong_filter,
    )
    given = samples()
    batch = build_train_batch(given, n_samples_per_prompt=GROUP)
    truncated = truncated_rows(given, batch)
    shaped, stats = apply_overlong(batch, truncated, algo)
    by_key = {s.key: s for s in given}
    order = sorted(by_key, key=lambda k: ([s.group_id for s in given].index(k[0]), k[1]))
    tokens = 0
    for row, key in enumerate(order):
        s = by_key[key]
        want = s.reward + dapo_reward_term(s.response_len, MAX_NEW, 4, 0.5)
        assert float(shaped.rewards[row]) == pytest.approx(want, abs=1e-6), (row, key)
        assert bool(truncated[row]) == (s.finish_reason == FinishReason.LENGTH)
        dropped = overlong_filter and s.finish_reason == FinishReason.LENGTH
        assert int(shaped.response_mask[row].sum()) == (0 if dropped else s.response_len)
        tokens += 0 if dropped else s.response_len
    assert shaped.global_tokens == tokens
    assert stats.filtered == (2 if overlong_filter else 0)
    assert stats.penalised == 5  # lengths 7, 8, 9, 10, 10 are past max_new - buffer = 6
    assert stats.penalty_mean < 0


def test_truncated_rows_refuses_samples_out_of_the_batch_order() -> None:
    given = samples()
    batch = build_train_batch(given, n_samples_per_prompt=GROUP)
    first = given[0].group_id  # the other group seen first: the groups' rows swap and their lengths differ
    flipped = [s for s in given if s.group_id != first] + [s for s in given if s.group_id == first]
    with pytest.raises(ValueError, match="row order"):
        truncated_rows(flipped, batch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, hidden=32, layers=1)


def train_once(model_dir: Path, tmp_path: Path, algo: AlgoConfig) -> dict[str, float]:
    config = Config(algo=algo, learner=LearnerConfig(model=str(model_dir), backend="torch", lr=1e-3))
    trainer = ModelTrainer(config, tmp_path)
    trainer.start(lambda phase, detail: None)
    given = samples(1)
    message = protocol.Batch(3, 0, 2, SampleBatch.from_samples(given), {}, Ledger())
    return trainer.train(message, 2).metrics


def test_the_trainer_applies_dapo_overlong_shaping_and_filtering(model_dir: Path, tmp_path: Path) -> None:
    common = {"max_new_tokens": MAX_NEW, "rollout_batch_size": 2, "n_samples_per_prompt": GROUP}
    dapo = AlgoConfig(algorithm=Algorithm.DAPO, overlong_filter=True, **common)  # default buffer: 10 / 5 = 2
    got = train_once(model_dir, tmp_path / "dapo", dapo)
    # lengths 9, 10, 10 are past 10 - 2: punished; the two truncated ones are out of the loss
    assert got["overlong_penalised"] == 3 and got["overlong_filtered"] == 2
    all_tokens = sum(n for shapes in SHAPES for n, _ in shapes)
    assert got["tokens_trained"] == all_tokens - 20
    plain = train_once(model_dir, tmp_path / "grpo", AlgoConfig(algorithm=Algorithm.GRPO, **common))
    assert plain["overlong_penalised"] == 0 and plain["overlong_filtered"] == 0
    assert plain["tokens_trained"] == all_tokens
