"""The torch engine replays a fixed script exactly as the engine before the static-shape decode step did.

tests/data/torch_engine_golden.json was written by that engine (commit c3753dc, float32 on CPU) for the
cases of tests/engine_script.py: the shipped tiny Llama and a random Qwen3 with grouped-query attention,
sampled (temperature, top-k, top-p, stop tokens, greedy rows among sampled ones) and greedy, with rows
joining and leaving mid-run, weights loads, an abort and resumes. The same seed and the same calls must
give the same outputs from the same calls: tokens, finish reasons and versions equal, log-probs within
LOGPROB_ATOL (float32 rounding of a different but equivalent order of operations; measured: 5e-6).
The decode step's shapes rounded up to buckets (as on CUDA) are checked against the same data in
tests/test_cuda_graphs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_script import CASES, Case, assert_same, golden, run_case

LOGPROB_ATOL = 1e-5


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_replays_the_recorded_outputs(case: Case, tmp_path: Path) -> None:
    assert_same(run_case(case, tmp_path), golden()[case.name], LOGPROB_ATOL)
