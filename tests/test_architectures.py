"""Real model architectures end to end on CPU: Llama, Qwen2 and Qwen3, tied and untied embeddings, at
their released vocabulary sizes (Llama-3: 128,256; Qwen2/Qwen3: 151,936), random-initialised from
transformers' own classes by `april.hf.make_tiny_model` (nothing downloaded; the byte-level tokenizer of
the shipped tiny model). Hidden size 64, 2 layers, head size 32 (the smallest vLLM's CPU attention takes,
so tests/test_vllm_architectures.py builds the same models), grouped-query attention (2 query heads per
key/value head), as the released models have.

- The torch engine's reported log-probs, for responses generated in two rounds (a partial rollout
  interrupted and resumed from prompt + partial response, as APRIL does), agree with the learner's
  recomputation (`learner.batching.response_logprobs`, padded and packed) within 1e-3 (measured: at
  most 3e-6).
- `april up --headless --steps 3` trains 3 steps on a Qwen3-shaped model directory (tied embeddings, as
  Qwen3-4B has) with the torch engine and the default DeepSpeed learner.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from actors.engine import (  # noqa: E402
    Engine,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    run_to_completion,
)
from actors.engines.torch_engine import TorchEngine  # noqa: E402
from april.hf import REAL_VOCAB_SIZES, ModelError, load_model, make_tiny_model  # noqa: E402
from april.ports import free_ports  # noqa: E402
from april.records import FinishReason, Sample  # noqa: E402
from learner.batching import build_train_batch, response_logprobs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1}
CASES = [(arch, tied) for arch in ("llama", "qwen2", "qwen3") for tied in (False, True)]
LOGPROB_ATOL = 1e-3  # the bound asked for; float32 on CPU agreed to at most 3e-6 (all six models)
TEMPERATURE = 0.8
GROUP = 2


def arch_model(root: Path, architecture: str, tied: bool, seed: int = 0) -> Path:
    """A random `architecture` model with its real vocabulary under `root`."""
    name = f"{architecture}-{'tied' if tied else 'untied'}"
    return make_tiny_model(
        root / name,
        seed=seed,
        architecture=architecture,
        tie_embeddings=tied,
        vocab_size=REAL_VOCAB_SIZES[architecture],
        **SHAPE,  # type: ignore[arg-type]
    )


def generate(engine: Engine, inputs: list[np.ndarray], budgets: list[int]) -> list[GenerationOutput]:
    """Requests join as slots free up (so rows join mid-way) until all finish; outputs in input order."""
    requests = [GenerationRequest(i, x, b) for i, (x, b) in enumerate(zip(inputs, budgets, strict=True))]
    outs = {out.request_id: out for out in run_to_completion(engine, requests)}
    return [outs[i] for i in range(len(inputs))]


def partial_rollouts(engine: Engine, seed: int) -> list[Sample]:
    """GROUP samples for each of 3 prompts, each generated in two rounds: a first round cut short (an
    interrupted partial rollout) and a second resumed from prompt + partial response."""
    rng = np.random.default_rng(seed)
    samples = []
    for g, n in enumerate((3, 9, 5)):
        prompt = rng.integers(3, 259, size=n).astype(np.int32)
        samples += [Sample(group_id=g, index=i, prompt_ids=prompt) for i in range(GROUP)]
    first = generate(engine, [s.prompt_ids for s in samples], [3 + s.index for s in samples])
    samples = [
        s.extend(o.token_ids, o.logprobs, 0, FinishReason.ABORT).resumed()
        for s, o in zip(samples, first, strict=True)
    ]
    second = generate(engine, [s.resume_input() for s in samples], [6 + 2 * s.group_id for s in samples])
    return [
        s.extend(o.token_ids, o.logprobs, 0, FinishReason.LENGTH).scored(float(s.index))
        for s, o in zip(samples, second, strict=True)
    ]


def assert_learner_agrees(model_dir: Path, samples: list[Sample], architecture: str, tied: bool) -> None:
    """The learner's recomputed log-probs (padded and packed) of `samples` equal the engine's, within
    LOGPROB_ATOL; and the model is the real-vocabulary `architecture` the test asked for."""
    batch = build_train_batch(samples, n_samples_per_prompt=GROUP)
    model = load_model(model_dir, dtype="float32")  # how the learner loads it on CPU
    vocab = REAL_VOCAB_SIZES[architecture]
    assert model.get_output_embeddings().weight.shape[0] == vocab
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    assert int(batch.response_ids.max()) >= 259  # sampled beyond the tokenizer: the whole vocabulary is live
    assert all(len(s.segments) == 1 and s.resumes == 1 for s in samples)
    mask = batch.response_mask
    with torch.no_grad():
        for packed in (False, True):
            learner = response_logprobs(model, batch, TEMPERATURE, packed=packed)
            err = float((learner - batch.behaviour_logprobs).abs()[mask].max())
            assert err < LOGPROB_ATOL, f"packed={packed}: max |engine - learner| = {err}"
    # a wide, random distribution: log-probs far from 0, so agreement is not agreement on certainty
    assert float(batch.behaviour_logprobs[mask].mean()) < -1.0


@pytest.mark.parametrize(
    ("architecture", "tied"), CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES]
)
def test_torch_engine_logprobs_match_the_learner_recomputation(
    tmp_path: Path, architecture: str, tied: bool
) -> None:
    model_dir = arch_model(tmp_path, architecture, tied)
    engine = TorchEngine(model_dir, slots=4, sampling=SamplingParams(temperature=TEMPERATURE, seed=1))
    samples = partial_rollouts(engine, seed=2)
    assert_learner_agrees(model_dir, samples, architecture, tied)


def test_april_up_trains_three_steps_on_a_qwen3_shaped_model(tmp_path: Path) -> None:
    model_dir = arch_model(tmp_path, "qwen3", tied=True)
    run_dir = tmp_path / "run"
    names = ("worker_port", "learner_port", "pub_port")
    ports = [f"--set=broker.{n}={p}" for n, p in zip(names, free_ports(3), strict=True)]
    cfg = tmp_path / "qwen3.toml"
    cfg.write_text(
        '[run]\nmode = "april"\n'
        "[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 4\nn_samples_per_prompt = 2\n"
        "max_new_tokens = 8\ntemperature = 1.0\n"
        f'[worker]\nengine = "torch"\nslots = 4\nmodel = "{model_dir}"\n'
        f'[learner]\nmodel = "{model_dir}"\nlr = 1e-3\ncheckpoint_every = 3\n'
    )
    proc = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "up", "--headless", "--config", str(cfg),
         "--run-dir", str(run_dir), "--steps", "3", "--workers", "1", *ports],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2, 3]
    assert all(x["samples"] == 4 and x["loss"] == x["loss"] for x in lines)  # 4 samples a step, no NaN
    assert (run_dir / "weights" / "v000003.safetensors").is_file()
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()


def test_an_unknown_architecture_is_refused_with_one_line(tmp_path: Path) -> None:
    expected = r"^make_tiny_model: architecture 'gpt2', expected one of llama, qwen2, qwen3$"
    with pytest.raises(ModelError, match=expected):
        make_tiny_model(tmp_path / "m", architecture="gpt2")
    assert not (tmp_path / "m").exists()  # refused before writing anything
