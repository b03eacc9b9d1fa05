"""The torch engine against slow, obviously-correct references: `model.generate` and full forward passes.

A tiny random Llama-style model is written once per module by `april.hf.make_tiny_model`; every check
drives a real `TorchEngine` on CPU (no fakes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from actors.engine import (  # noqa: E402
    EngineError,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
    run_to_completion,
)
from actors.engines.torch_engine import TorchEngine  # noqa: E402
from april.hf import ModelError, load_model, load_tokenizer, make_tiny_model  # noqa: E402
from april.records import FinishReason  # noqa: E402

GREEDY = SamplingParams(temperature=0.7)
PROMPT_LENS = (3, 7, 1, 12, 5, 9, 2, 15, 4, 6)
BUDGETS = (20, 5, 13, 30, 1, 8, 25, 3, 17, 11)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> torch.nn.Module:
    return load_model(model_dir)


def prompts(seed: int = 0, lens: Sequence[int] = PROMPT_LENS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 259, size=n).astype(np.int32) for n in lens]


def run(
    engine: TorchEngine, inputs: Sequence[np.ndarray], budgets: Sequence[int]
) -> dict[int, GenerationOutput]:
    """Requests join as slots free up (so sequences join mid-way) until all finish; outputs by request id."""
    requests = [GenerationRequest(i, x, b) for i, (x, b) in enumerate(zip(inputs, budgets, strict=True))]
    return {out.request_id: out for out in run_to_completion(engine, requests)}


def reference_logprobs(
    model: torch.nn.Module, prompt: np.ndarray, response: Sequence[int], temp: float
) -> np.ndarray:
    """log_softmax(logits / temp) of each response token from one full forward pass of prompt + response."""
    ids = torch.tensor([*prompt.tolist(), *response], dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(ids.to(next(model.parameters()).device)).logits[0].float().cpu() / temp
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(list(response))[:, None]).squeeze(1).numpy()


def test_greedy_matches_generate_on_mixed_batch(model_dir: Path, model: torch.nn.Module) -> None:
    inputs = prompts()
    width = max(len(p) for p in inputs)
    ids = torch.zeros(len(inputs), width, dtype=torch.long)
    mask = torch.zeros(len(inputs), width, dtype=torch.long)
    for i, p in enumerate(inputs):  # left padding, as generate expects for a decoder-only batch
        ids[i, width - len(p) :] = torch.from_numpy(p.astype(np.int64))
        mask[i, width - len(p) :] = 1
    ref = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max(BUDGETS),
        min_new_tokens=max(BUDGETS),
        eos_token_id=None,
        pad_token_id=0,
    )[:, width:]
    engine = TorchEngine(model_dir, slots=4, sampling=GREEDY, greedy=True)
    outs = run(engine, inputs, BUDGETS)
    for i, budget in enumerate(BUDGETS):
        assert outs[i].token_ids.tolist() == ref[i, :budget].tolist(), f"request {i}"
        assert outs[i].finish_reason == FinishReason.LENGTH
        assert outs[i].versions.tolist() == [0] * budget
    assert engine.active == 0


def test_join_leave_shift_and_trim_keep_greedy_exact(model_dir: Path, model: torch.nn.Module) -> None:
    """Long and short rows interleaved: newcomers longer than the cache width shift it right, and a long
    row leaving lets the shared leading padding be cut; each output must still equal generate's."""
    lens = (40, 2, 70, 5, 1, 33, 8, 90, 3, 12, 50, 6)
    budgets = (6, 60, 4, 45, 9, 2, 70, 5, 30, 14, 3, 40)
    inputs = prompts(seed=8, lens=lens)
    outs = run(TorchEngine(model_dir, slots=3, sampling=GREEDY, greedy=True), inputs, budgets)
    for i, (p, budget) in enumerate(zip(inputs, budgets, strict=True)):
        ids = torch.from_numpy(p.astype(np.int64))[None]
        ref = model.generate(
            ids, do_sample=False, max_new_tokens=budget, min_new_tokens=budget, eos_token_id=None
        )
        assert outs[i].token_ids.tolist() == ref[0, len(p) :].tolist(), f"request {i}"


def test_greedy_requests_in_a_sampling_engine_decode_argmax(model_dir: Path) -> None:
    """Evaluation requests (`greedy=True`) batched with sampled ones: the greedy rows give exactly what a
    greedy engine gives, the sampled rows still sample."""
    inputs = prompts(seed=6, lens=(4, 9, 3, 7))
    budgets = [12] * 4
    sampling = SamplingParams(temperature=1.5, seed=4)
    reference = run(TorchEngine(model_dir, slots=4, sampling=sampling, greedy=True), inputs, budgets)
    engine = TorchEngine(model_dir, slots=4, sampling=sampling)
    engine.add([GenerationRequest(i, inputs[i], budgets[i], greedy=i % 2 == 0) for i in range(4)])
    outs: dict[int, GenerationOutput] = {}
    while engine.active:
        outs.update((o.request_id, o) for o in engine.step())
    for i in (0, 2):
        assert outs[i].token_ids.tolist() == reference[i].token_ids.tolist(), f"greedy request {i}"
        np.testing.assert_allclose(outs[i].logprobs, reference[i].logprobs, atol=1e-5, rtol=0)
    sampled = [outs[i].token_ids.tolist() != reference[i].token_ids.tolist() for i in (1, 3)]
    assert any(sampled), "the non-greedy requests decoded greedily too"


@pytest.mark.parametrize(
    ("sampling", "greedy"),
    [
        (SamplingParams(temperature=1.0, seed=1), False),
        (SamplingParams(temperature=0.6, top_p=0.9, top_k=50, seed=2), False),
        (SamplingParams(temperature=1.7, seed=3), True),
    ],
)
def test_logprobs_equal_full_forward(
    model_dir: Path, model: torch.nn.Module, sampling: SamplingParams, greedy: bool
) -> None:
    inputs = prompts(seed=5)
    engine = TorchEngine(model_dir, slots=3, sampling=sampling, greedy=greedy)
    outs = run(engine, inputs, BUDGETS)
    for i, p in enumerate(inputs):
        got = outs[i]
        assert got.logprobs.dtype == np.float32 and got.logprobs.shape == got.token_ids.shape
        ref = reference_logprobs(model, p, got.token_ids.tolist(), sampling.temperature)
        np.testing.assert_allclose(got.logprobs, ref, atol=1e-4, rtol=0)


def test_abort_then_resume_on_fresh_engine_continues_greedy(model_dir: Path, model: torch.nn.Module) -> None:
    inputs = prompts(seed=7, lens=(4, 9, 2, 6))
    budget = 24
    full = run(TorchEngine(model_dir, slots=4, sampling=GREEDY, greedy=True), inputs, [budget] * 4)

    first = TorchEngine(model_dir, slots=4, sampling=GREEDY, greedy=True)
    first.add([GenerationRequest(i, p, budget) for i, p in enumerate(inputs[:3])])
    for _ in range(5):
        assert first.step() == []
    first.add([GenerationRequest(3, inputs[3], budget)])  # added, never stepped: aborts with no tokens
    partials = {o.request_id: o for o in first.abort()}
    assert first.active == 0 and first.step() == []
    assert sorted(partials) == [0, 1, 2, 3]
    assert {o.finish_reason for o in partials.values()} == {FinishReason.ABORT}
    assert [len(partials[i].token_ids) for i in range(4)] == [5, 5, 5, 0]  # one token per step

    second = TorchEngine(model_dir, slots=4, sampling=GREEDY, greedy=True, version=1)
    resumed_inputs = [np.concatenate([inputs[i], partials[i].token_ids]) for i in range(4)]
    rest = run(second, resumed_inputs, [budget - len(partials[i].token_ids) for i in range(4)])
    for i in range(4):
        tokens = np.concatenate([partials[i].token_ids, rest[i].token_ids])
        assert tokens.tolist() == full[i].token_ids.tolist()
        logprobs = np.concatenate([partials[i].logprobs, rest[i].logprobs])
        np.testing.assert_allclose(logprobs, full[i].logprobs, atol=1e-4, rtol=0)
        assert set(rest[i].versions.tolist()) <= {1}


def test_sampling_is_reproducible_by_seed(model_dir: Path) -> None:
    inputs = prompts(seed=3)

    def sample(seed: int, **kw: float) -> list[list[int]]:
        engine = TorchEngine(model_dir, slots=4, sampling=SamplingParams(temperature=1.0, seed=seed, **kw))
        outs = run(engine, inputs, BUDGETS)
        return [outs[i].token_ids.tolist() for i in range(len(inputs))]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)
    greedy = run(TorchEngine(model_dir, slots=4, sampling=GREEDY, greedy=True), inputs, BUDGETS)
    as_lists = [greedy[i].token_ids.tolist() for i in range(len(inputs))]
    assert sample(13, top_k=1) == as_lists  # top-k 1 and a tiny nucleus leave only the argmax
    assert sample(14, top_p=1e-6) == as_lists


def test_stop_token_ends_with_stop_and_is_included(model_dir: Path) -> None:
    inputs = prompts(seed=9, lens=(5, 8))
    free = run(TorchEngine(model_dir, slots=2, sampling=GREEDY, greedy=True), inputs, [30, 30])
    stop = int(free[0].token_ids[4])
    first = free[0].token_ids.tolist().index(stop)
    params = SamplingParams(temperature=0.7, stop_token_ids=(stop,))
    outs = run(TorchEngine(model_dir, slots=2, sampling=params, greedy=True), inputs, [30, 30])
    assert outs[0].token_ids.tolist() == free[0].token_ids[: first + 1].tolist()
    assert outs[0].finish_reason == FinishReason.STOP
    other = free[1].token_ids.tolist()
    expected = other[: other.index(stop) + 1] if stop in other else other
    assert outs[1].token_ids.tolist() == expected
    assert outs[1].finish_reason == (FinishReason.STOP if stop in other else FinishReason.LENGTH)


def test_zero_budget_and_context_limit(tmp_path: Path) -> None:
    small = make_tiny_model(tmp_path / "ctx", seed=1, max_positions=16)
    engine = TorchEngine(small, slots=4, sampling=GREEDY, greedy=True)
    long_input = np.arange(3, 15, dtype=np.int32)  # 12 of the 16 positions
    full_input = np.arange(3, 19, dtype=np.int32)  # all 16
    engine.add(
        [
            GenerationRequest(0, np.array([5, 6], dtype=np.int32), 0),
            GenerationRequest(1, long_input, 10),
            GenerationRequest(2, full_input, 10),
        ]
    )
    assert engine.active == 3
    outs: dict[int, GenerationOutput] = {}
    while engine.active:
        outs.update((o.request_id, o) for o in engine.step())
    assert outs[0].token_ids.size == 0 and outs[0].finish_reason == FinishReason.LENGTH
    assert outs[2].token_ids.size == 0 and outs[2].finish_reason == FinishReason.LENGTH
    assert outs[1].token_ids.size == 4 and outs[1].finish_reason == FinishReason.LENGTH  # clipped to fit


def perturbed_weights(model_dir: Path, path: Path, scale: float = 0.05) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in load_model(model_dir).state_dict().items()}
    gen = torch.Generator().manual_seed(123)
    for v in state.values():
        v.add_(torch.randn(v.shape, generator=gen) * scale)
    save_file(state, str(path))
    return state


def test_load_weights_between_steps_switches_version(model_dir: Path, tmp_path: Path) -> None:
    inputs = prompts(seed=4, lens=(5, 3))
    budget = 20
    base = run(TorchEngine(model_dir, slots=2, sampling=GREEDY, greedy=True), inputs, [budget] * 2)
    path = tmp_path / "v1.safetensors"
    state = perturbed_weights(model_dir, path)

    engine = TorchEngine(model_dir, slots=2, sampling=GREEDY, greedy=True)
    engine.add([GenerationRequest(i, p, budget) for i, p in enumerate(inputs)])
    k = 5
    for _ in range(k):  # one token per step, from version 0
        engine.step()
    engine.load_weights(path, version=1)
    assert engine.version == 1
    outs = run(engine, [], [])
    new_model = load_model(model_dir)
    new_model.load_state_dict(state)
    for i, p in enumerate(inputs):
        got = outs[i]
        assert got.versions.tolist() == [0] * k + [1] * (budget - k)
        assert got.token_ids[:k].tolist() == base[i].token_ids[:k].tolist()
        assert got.token_ids.tolist() != base[i].token_ids.tolist()
        # tokens after the load are exactly the new policy's: greedy and log-probs under the new weights
        ref = reference_logprobs(new_model, p, got.token_ids.tolist(), GREEDY.temperature)
        np.testing.assert_allclose(got.logprobs[k:], ref[k:], atol=1e-4, rtol=0)
        prefix = torch.tensor([*p.tolist(), *got.token_ids[:k].tolist()], dtype=torch.long)[None]
        cont = new_model.generate(prefix, do_sample=False, max_new_tokens=budget - k, eos_token_id=None)
        assert cont[0, prefix.shape[1] :].tolist() == got.token_ids[k:].tolist()


def test_load_weights_from_hf_directory(model_dir: Path, tmp_path: Path) -> None:
    engine = TorchEngine(model_dir, slots=1, sampling=GREEDY, greedy=True)
    other = make_tiny_model(tmp_path / "other", seed=5)
    engine.load_weights(other, version=3)
    outs = run(engine, prompts(lens=(4,)), [6])
    ref = run(TorchEngine(other, slots=1, sampling=GREEDY, greedy=True), prompts(lens=(4,)), [6])
    assert outs[0].token_ids.tolist() == ref[0].token_ids.tolist()
    assert outs[0].versions.tolist() == [3] * 6


def test_bad_weights_raise_and_keep_old_weights(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    inputs = prompts(seed=6, lens=(6,))
    base = run(TorchEngine(model_dir, slots=1, sampling=GREEDY, greedy=True), inputs, [16])
    good = {k: v.clone() for k, v in load_model(model_dir).state_dict().items()}
    missing = dict(good)
    missing.pop("model.norm.weight")
    extra = {**good, "model.bogus": torch.zeros(3)}
    shaped = {**good, "model.norm.weight": torch.zeros(7)}
    bad_files = {}
    for name, state in (("missing", missing), ("extra", extra), ("shape", shaped)):
        bad_files[name] = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(bad_files[name]))
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    bad_files["garbage"] = tmp_path / "garbage.safetensors"
    bad_files["absent"] = tmp_path / "nope.safetensors"
    (tmp_path / "empty_dir").mkdir()
    bad_files["empty_dir"] = tmp_path / "empty_dir"

    engine = TorchEngine(model_dir, slots=1, sampling=GREEDY, greedy=True)
    engine.add([GenerationRequest(0, inputs[0], 16)])
    engine.step()
    for name, path in bad_files.items():
        with pytest.raises(WeightLoadError):
            engine.load_weights(path, version=1)
        assert engine.version == 0, name
        engine.step()
    outs = run(engine, [], [])
    assert outs[0].token_ids.tolist() == base[0].token_ids.tolist()
    assert outs[0].versions.tolist() == [0] * 16


def test_add_rejects_bad_requests(model_dir: Path) -> None:
    engine = TorchEngine(model_dir, slots=2, sampling=GREEDY)
    with pytest.raises(EngineError, match="slots"):
        engine.add([GenerationRequest(i, np.array([4], dtype=np.int32), 3) for i in range(3)])
    with pytest.raises(EngineError, match="input_ids"):
        engine.add([GenerationRequest(0, np.zeros(0, dtype=np.int32), 3)])
    engine.add([GenerationRequest(0, np.array([4], dtype=np.int32), 3)])
    with pytest.raises(EngineError, match="already active"):
        engine.add([GenerationRequest(0, np.array([4], dtype=np.int32), 3)])
    with pytest.raises(EngineError, match="temperature"):
        TorchEngine(model_dir, slots=2, sampling=SamplingParams(temperature=0.0))


def test_hf_errors_name_the_missing_piece(model_dir: Path, tmp_path: Path) -> None:
    import shutil

    with pytest.raises(ModelError, match="does not exist"):
        load_model(tmp_path / "absent")
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer"):
        load_tokenizer(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no weights"):
        load_model(broken)
    (broken / "config.json").unlink()
    with pytest.raises(ModelError, match=r"no config\.json"):
        TorchEngine(broken, slots=1, sampling=GREEDY)


def test_tiny_model_is_deterministic_and_tokenizer_round_trips(model_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    tok = load_tokenizer(model_dir)
    text = "12 + 30 = 42, héllo"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


@pytest.mark.gpu
def test_greedy_matches_generate_on_cuda(model_dir: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = load_model(model_dir, device="cuda", dtype="float32")
    inputs = prompts(seed=2)
    outs = run(
        TorchEngine(model_dir, slots=4, sampling=GREEDY, device="cuda", dtype="float32", greedy=True),
        inputs,
        BUDGETS,
    )
    for i, (p, budget) in enumerate(zip(inputs, BUDGETS, strict=True)):
        ids = torch.from_numpy(p.astype(np.int64))[None].cuda()
        ref = model.generate(
            ids, do_sample=False, max_new_tokens=budget, min_new_tokens=budget, eos_token_id=None
        )
        assert outs[i].token_ids.tolist() == ref[0, len(p) :].tolist(), f"request {i}"
        lps = reference_logprobs(model, p, outs[i].token_ids.tolist(), GREEDY.temperature)
        np.testing.assert_allclose(outs[i].logprobs, lps, atol=1e-4, rtol=0)


def test_two_workers_of_one_run_draw_different_samples(model_dir: Path) -> None:
    """One generator per torch engine, salted with the worker id by the factory: two workers of one run
    (same run seed) sample different tokens for the same prompts, and a worker is reproducible."""
    from actors.factory import make_engine
    from april.config import WorkerConfig

    inputs = prompts(seed=5)

    def sample(worker_id: str) -> list[list[int]]:
        cfg = WorkerConfig(engine="torch", model=str(model_dir), slots=4, worker_id=worker_id)
        engine = make_engine(cfg, SamplingParams(temperature=1.0, seed=7), lambda req: None, 0)  # type: ignore[arg-type,return-value]
        assert isinstance(engine, TorchEngine)
        outs = run(engine, inputs, BUDGETS)
        return [outs[i].token_ids.tolist() for i in range(len(inputs))]

    assert sample("w0") == sample("w0")
    assert sample("w0") != sample("w1")
