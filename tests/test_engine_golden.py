"""The torch engine replays a fixed script exactly as the engine before the static-shape decode step did.

tests/data/torch_engine_golden.json was written by that engine (commit c3753dc, float32 on CPU) for the
cases of tests/engine_script.py: the shipped tiny Llama and a random Qwen3 with grouped-query attention,
sampled (temperature, top-k, top-p, stop tokens, greedy rows among sampled ones) and greedy, with rows
joining and leaving mid-run, weights loads, an abort and resumes. The same seed and the same calls must
give the same outputs from the same calls: tokens, finish reasons and versions equal, log-probs within
LOGPROB_ATOL (float32 rounding of a different but equivalent order of operations).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_script import CASES, GOLDEN, Case, run_case

LOGPROB_ATOL = 1e-5


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [(o["call"], o["request_id"]) for o in got] == [(o["call"], o["request_id"]) for o in want]
    for g, w in zip(got, want, strict=True):
        where = f"request {w['request_id']} (call {w['call']})"
        assert g["token_ids"] == w["token_ids"], where
        assert g["finish_reason"] == w["finish_reason"], where
        assert g["versions"] == w["versions"], where
        np.testing.assert_allclose(g["logprobs"], w["logprobs"], atol=LOGPROB_ATOL, rtol=0, err_msg=where)


@pytest.fixture(scope="module")
def golden() -> dict[str, list[dict[str, Any]]]:
    data: dict[str, list[dict[str, Any]]] = json.loads(GOLDEN.read_text())
    return data


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_replays_the_recorded_outputs(case: Case, golden: dict[str, Any], tmp_path: Path) -> None:
    assert_same(run_case(case, tmp_path), golden[case.name])
