"""The learner's RL step (`learner.step.train_step`) across ranks, updates per batch, and resume.

- Two ranks (gloo, two processes, DeepSpeed ZeRO 0, 3 and (slow) 2) given one batch through
  `share_batch` (only rank 0 holds it; rank 1 decodes rank 0's broadcast) end with the same weights and
  statistics as one rank on the same batch.
- `updates_per_batch = 2` is exactly two one-update steps on the two halves of the groups (advantages are
  per group, each half normalised on its own).
- A checkpoint taken after a step, loaded into a fresh engine, gives the same next step (weights and
  metrics) as the uninterrupted engine.

Children run this file as a script with a JSON spec (as tests/test_learner_engine.py does), so each owns
its process group. Tolerance across rank layouts: 1e-5 (the reduction order differs); same layout: exact.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ranks import launch_ranks  # noqa: E402

from april import protocol  # noqa: E402
from april.config import Algorithm, OffPolicy  # noqa: E402
from april.hf import load_model, make_tiny_model  # noqa: E402
from april.ledger import Ledger  # noqa: E402
from april.records import FinishReason, Sample  # noqa: E402
from april.wire_records import SampleBatch  # noqa: E402
from learner import checkpoint, weights  # noqa: E402
from learner.batching import build_train_batch  # noqa: E402
from learner.engine import TrainEngine, TrainSettings  # noqa: E402
from learner.losses import LossConfig  # noqa: E402
from learner.ranks import share_batch  # noqa: E402
from learner.sample_stats import SampleStats  # noqa: E402
from learner.step import mini_batches, rank_parts, train_step  # noqa: E402

GROUP = 4
VERSION = 3


def loss_cfg(offpolicy: OffPolicy = OffPolicy.TIS) -> LossConfig:
    from april.config import AlgoConfig

    return LossConfig.from_algo(AlgoConfig(algorithm=Algorithm.GRPO, offpolicy=offpolicy))


def rl_samples(seed: int, groups: int = 4) -> list[Sample]:
    """`groups` groups of GROUP finished samples; some resumed across versions VERSION-2..VERSION."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, 259, size=int(rng.integers(2, 6))).astype(np.int32)
        for i in range(GROUP):
            s = Sample(group_id=100 + g, index=i, prompt_ids=prompt, metadata={"answer": "1"})
            rounds = [(VERSION - 1, int(rng.integers(1, 6))), (VERSION, int(rng.integers(1, 9)))]
            if (g + i) % 3 == 0:
                rounds = rounds[1:]
            for k, (version, n) in enumerate(rounds):
                reason = FinishReason.STOP if k == len(rounds) - 1 else FinishReason.ABORT
                lps = (-rng.random(n) * 3 - 0.05).astype(np.float32)
                s = s.extend(rng.integers(3, 259, size=n).astype(np.int32), lps, version, reason)
                if reason == FinishReason.ABORT:
                    s = s.resumed()
            out.append(s.scored(float(rng.integers(0, 2))))
    return out


def batch_message(samples: list[Sample]) -> protocol.Batch:
    return protocol.Batch(7, 0, VERSION, SampleBatch.from_samples(samples), {}, Ledger())


def settings(backend: str, zero_stage: int = 0, accum: int = 2) -> TrainSettings:
    return TrainSettings(
        backend=backend,  # type: ignore[arg-type]
        zero_stage=zero_stage,
        grad_accum_steps=accum,
        lr=1e-3,
        weight_decay=0.01,
        grad_clip=1.0,
    )


# ---------------------------------------------------------------------- the child (one rank)


def child(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    engine = TrainEngine(load_model(spec["model_dir"]), settings("deepspeed", spec["zero_stage"]))
    mine = batch_message(rl_samples(spec["seed"])) if engine.rank == 0 else None
    batch = share_batch(mine, 1 << 26)
    assert batch is not None
    train = build_train_batch(batch.samples.to_samples(), n_samples_per_prompt=GROUP)
    per_sample = SampleStats(train.size, "cpu")
    stats = train_step(
        engine,
        train,
        loss_cfg(),
        version=VERSION,
        temperature=1.0,
        group_size=GROUP,
        updates=spec["updates"],
        per_sample=per_sample,
    )
    published = engine.state_dict_for_publish()
    if engine.rank == 0:
        path, sha = weights.publish(published, Path(spec["out"]), 1)
        figures = [per_sample.logprob_mean.tolist(), per_sample.ratio_max.tolist()]
        Path(spec["out"], "result.json").write_text(
            json.dumps({"stats": stats, "path": str(path), "sha": sha, "figures": figures})
        )
    engine.close()  # as the learner does: no rank tears the group down under another's last collective


def run_ranks(spec: dict[str, Any], world: int, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The published weights, and the step's statistics with each sample's figures under "figures"."""
    out = tmp / f"out-{world}"
    out.mkdir()
    spec_file = tmp / f"spec-{world}.json"
    spec_file.write_text(json.dumps({**spec, "out": str(out)}))
    launch_ranks(__file__, [spec_file] * world, [tmp / f"rank{world}-{r}.log" for r in range(world)])
    res = json.loads((out / "result.json").read_text())
    return weights.load_published(Path(res["path"]), res["sha"]), {**res["stats"], "figures": res["figures"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, hidden=64, layers=2)


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("zero_stage", [0, 3, pytest.param(2, marks=pytest.mark.slow)])
def test_two_ranks_match_one_rank(model_dir: Path, tmp_path: Path, zero_stage: int) -> None:
    pytest.importorskip("deepspeed")
    spec = {"model_dir": str(model_dir), "zero_stage": zero_stage, "seed": 5, "updates": 2}
    one, one_stats = run_ranks(spec, 1, tmp_path)
    two, two_stats = run_ranks(spec, 2, tmp_path)
    start = load_model(model_dir).state_dict()
    assert max_diff(one, start) > 1e-4, "the step did not move the weights"
    assert max_diff(one, two) < 1e-5
    for key in ("loss", "clip_frac", "approx_kl", "is_weight_mean", "is_weight_max", "offpolicy_token_frac"):
        assert one_stats[key] == pytest.approx(two_stats[key], rel=1e-5, abs=1e-7), key
    assert one_stats["updates"] == two_stats["updates"] == 2
    # each sample's figures come from the one rank that trained it, summed over ranks to rank 0
    assert np.allclose(one_stats["figures"], two_stats["figures"], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- one process, plain torch


def torch_engine(model_dir: Path, accum: int = 2) -> TrainEngine:
    torch.manual_seed(0)
    return TrainEngine(load_model(model_dir), settings("torch", accum=accum))


def step(engine: TrainEngine, samples: list[Sample], updates: int = 1) -> dict[str, float]:
    batch = build_train_batch(samples, n_samples_per_prompt=GROUP)
    return train_step(
        engine, batch, loss_cfg(), version=VERSION, temperature=1.0, group_size=GROUP, updates=updates
    )


def test_two_updates_are_two_steps_on_the_halves(model_dir: Path) -> None:
    samples = rl_samples(1, groups=4)
    a = torch_engine(model_dir)
    stats = step(a, samples, updates=2)
    b = torch_engine(model_dir)
    first, second = step(b, samples[: 2 * GROUP]), step(b, samples[2 * GROUP :])
    assert a.steps == b.steps == 2
    # the halves are padded to their own widths, so sums run in another order: rounding only (a wrong
    # update is off by ~lr = 1e-3)
    assert max_diff(a.module.state_dict(), b.module.state_dict()) < 1e-5
    assert stats["loss"] == pytest.approx((first["loss"] + second["loss"]) / 2, rel=1e-6)
    assert stats["updates"] == 2


def reference_figures(model: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """Each sample on its own, full logits: the mean log-prob of its model tokens and the largest
    exp(log-prob - behaviour log-prob) over them (NaN without model tokens)."""
    means, ratios = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids]), dtype=torch.int64)[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            p = s.prompt_ids.shape[0]
            lp = [
                float(logp[p + j - 1, int(s.response_ids[j])]) for seg in s.segments for j in range(*seg[1:])
            ]
            beh = [float(s.response_logprobs[j]) for seg in s.segments for j in range(*seg[1:])]
            means.append(sum(lp) / len(lp) if lp else math.nan)
            ratios.append(max(math.exp(a - b) for a, b in zip(lp, beh, strict=True)) if lp else math.nan)
    return means, ratios


def test_each_samples_figures_equal_a_plain_forward_of_it_alone(model_dir: Path) -> None:
    """Per-sample learner log-prob and largest ratio (`SampleStats`), gathered part by part over
    token-balanced micro-batches, against each sample forwarded alone before the update; the advantages
    are the batch's group advantages. An episode's observations are not model tokens."""
    samples = rl_samples(3, groups=2)
    episode = samples[0].resumed().observed([70, 71]).extend([9], [-0.5], VERSION, FinishReason.STOP)
    samples[0] = episode.scored(samples[0].reward)
    engine = torch_engine(model_dir, accum=3)
    means, ratios = reference_figures(engine.module, samples)
    batch = build_train_batch(samples, n_samples_per_prompt=GROUP)
    per_sample = SampleStats(batch.size, "cpu")
    train_step(
        engine, batch, loss_cfg(), version=VERSION, temperature=1.0, group_size=GROUP, per_sample=per_sample
    )
    assert np.allclose(per_sample.logprob_mean, means, rtol=1e-5, atol=1e-5)
    assert np.allclose(per_sample.ratio_max, ratios, rtol=1e-4)
    rewards = np.array([s.reward for s in samples]).reshape(-1, GROUP)
    spread = rewards.std(axis=1, ddof=1, keepdims=True)
    expected = np.where(spread > 0, (rewards - rewards.mean(axis=1, keepdims=True)) / (spread + 1e-6), 0.0)
    assert np.allclose(per_sample.advantage, expected.reshape(-1), atol=1e-5)


def test_mini_batches_keep_groups_whole_and_normalise_on_their_own() -> None:
    batch = build_train_batch(rl_samples(2, groups=5), n_samples_per_prompt=GROUP)
    parts = mini_batches(batch, 2, GROUP)
    assert [p.size for p in parts] == [2 * GROUP, 3 * GROUP] or [p.size for p in parts] == [
        3 * GROUP,
        2 * GROUP,
    ]
    assert sum(p.size for p in parts) == batch.size
    for p in parts:
        assert p.global_samples == p.size and p.global_tokens == int(p.response_lens.sum())
        assert len(set(p.group_index.tolist())) * GROUP == p.size
    with pytest.raises(ValueError, match="updates_per_batch = 6"):
        mini_batches(batch, 6, GROUP)


def test_resume_from_checkpoint_gives_the_same_next_step(model_dir: Path, tmp_path: Path) -> None:
    first, second = rl_samples(3), rl_samples(4)
    a = torch_engine(model_dir)
    step(a, first)
    meta = checkpoint.CheckpointMeta(step=1, version=1, last_batch_id=0, backend="torch")
    saved = checkpoint.save(a, tmp_path / "ckpt", meta)
    expected = step(a, second)
    b = torch_engine(model_dir)
    assert checkpoint.load(b, saved).step == 1
    got = step(b, second)
    assert max_diff(a.module.state_dict(), b.module.state_dict()) == 0.0
    assert got == expected  # every metric of the next step, exactly


def empty_response(group_id: int, index: int, prompt_len: int) -> Sample:
    """A prompt that filled the context: back finished (length) with no response token."""
    prompt = np.arange(3, 3 + prompt_len).astype(np.int32)
    return Sample(group_id=group_id, index=index, prompt_ids=prompt).extend(
        [], [], VERSION, FinishReason.LENGTH
    )


def test_a_part_of_only_empty_responses_trains_and_adds_nothing(model_dir: Path) -> None:
    # the longest sample (by prompt + response) has no response: token balancing puts it in a part alone,
    # a part whose response tensors are [1, 0]; that crashed the loss's statistics, and the broker re-sent
    # the unacked batch to the restarted learner, which crashed again
    samples = rl_samples(6, groups=2)
    samples[0] = empty_response(samples[0].group_id, 0, 120).scored(0.0)
    batch = build_train_batch(samples, n_samples_per_prompt=GROUP)
    parts = [p.response_ids.shape[1] for p in rank_parts(batch, 2, 0, 1)]
    assert 0 in parts, parts  # the test exercises what it says
    engine = torch_engine(model_dir)
    got = step(engine, samples)
    assert all(math.isfinite(v) for v in got.values()), got
    assert max_diff(engine.module.state_dict(), load_model(model_dir).state_dict()) > 1e-4
    # the empty sample adds no token and no sample with tokens; the others all trained
    assert got["tokens_trained"] == float(batch.response_mask.sum())


def test_share_batch_without_a_process_group_passes_the_batch_through() -> None:
    msg = batch_message(rl_samples(0, groups=1))
    assert share_batch(msg, 1 << 20) is msg
    assert share_batch(None, 1 << 20) is None


if __name__ == "__main__":
    child(json.loads(Path(sys.argv[1]).read_text()))


def test_a_batch_with_ids_outside_the_vocabulary_is_refused_with_a_clear_error() -> None:
    from learner.client import BatchError, check_batch

    msg = batch_message(rl_samples(0, groups=2))
    check_batch(msg, 2 * GROUP, GROUP, vocab_size=259)
    with pytest.raises(BatchError, match=r"ids range \d+\.\.\d+ is outside the model.s vocabulary 0\.\.199"):
        check_batch(msg, 2 * GROUP, GROUP, vocab_size=200)
