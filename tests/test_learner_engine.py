"""The learner's training engine, DeepSpeed config, weights publishing and checkpoints, on CPU.

Every DeepSpeed run happens in a fresh subprocess (this file run as a script with a JSON spec), so each
test owns its process group and no DeepSpeed global state leaks between tests; two-rank runs are two
such processes on gloo. The loss is a plain LM cross-entropy on a tiny random Llama: the engine knows
nothing of RL. The reference is the torch backend (AdamW + clip_grad_norm_) run in this process.

Tolerances: ZeRO 0-2 in fp32 apply the same element-wise AdamW to the same gradients, so they match the
torch reference to rounding (observed bit-identical); we allow 1e-6 absolute on weights (lr is 1e-3, so
a wrong update would be off by ~1e-3) and 1e-5 relative on grad norms. ZeRO-3 and two-rank runs reduce
in another order: 1e-5 absolute. Resume vs uninterrupted is exact (same process layout, same threads).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from ranks import launch_ranks  # noqa: E402

from april.files import sha256_file  # noqa: E402
from april.hf import load_model, make_tiny_model  # noqa: E402
from april.weights_uri import published_versions  # noqa: E402
from learner import checkpoint, weights  # noqa: E402
from learner.ds_config import deepspeed_config  # noqa: E402
from learner.ds_ops import extensions_dir, use_environment_extensions_dir  # noqa: E402
from learner.engine import TrainEngine, TrainSettings  # noqa: E402

SEQ_LEN = 32
BASE = {"micro_batch_size": 2, "grad_accum_steps": 2, "lr": 1e-3, "weight_decay": 0.01, "grad_clip": 1.0}

needs_deepspeed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed not installed"
)


# ---------------------------------------------------------------------- the training run under test


def lm_loss(model: Any, input_ids: Any) -> Any:
    """Mean next-token cross-entropy of a micro-batch [B, T] of token ids (no padding)."""
    return model(input_ids=input_ids, labels=input_ids).loss


def train(spec: dict[str, Any]) -> None:
    """Train `spec["steps"]` steps (or resume and train up to it); write weights + metrics to spec["out"].

    Each step's global batch [micro * accum * world, SEQ_LEN] is drawn from torch's global RNG, so a
    resumed run only sees the same batches if the RNG was restored. Rank r trains its slice of it.
    `spec["accumulation"]` (optional) gives each step's own micro-batch count (`set_accumulation`).
    """
    if "threads" in spec:
        torch.set_num_threads(spec["threads"])
    s = TrainSettings(**spec["settings"])
    engine = TrainEngine(load_model(spec["model_dir"]), s)
    out, ckpt_dir = Path(spec["out"]), Path(spec["out"]) / "checkpoints"
    start = 0
    if spec.get("resume"):
        found = checkpoint.latest(Path(spec["resume"]))
        assert found is not None, f"no checkpoint under {spec['resume']}"
        start = checkpoint.load(engine, found).step
    else:
        torch.manual_seed(1234)
        random.seed(1234)
        np.random.seed(1234)
    metrics = []
    for step in range(start + 1, spec["steps"] + 1):
        if "accumulation" in spec:
            engine.set_accumulation(spec["accumulation"][step - 1])
        per_rank = s.micro_batch_size * engine.accumulation
        batch = torch.randint(3, 259, (per_rank * engine.world_size, SEQ_LEN))
        mine = batch[engine.rank * per_rank : (engine.rank + 1) * per_rank]
        lr = engine.lr
        losses = [float(engine.forward_backward(lm_loss, mb)) for mb in mine.split(s.micro_batch_size)]
        norm = engine.step()
        probe = [random.random(), float(np.random.rand())]  # python and numpy RNG, restored on resume
        metrics.append(
            {"step": step, "loss": sum(losses) / len(losses), "grad_norm": norm, "lr": lr, "probe": probe}
        )
        if step == spec.get("checkpoint_at"):
            meta = checkpoint.CheckpointMeta(
                step, step, step - 1, engine.world_size, s.backend, s.zero_stage, s.optimizer
            )
            checkpoint.save(engine, ckpt_dir, meta)
    published = engine.state_dict_for_publish()  # a collective under ZeRO-3
    if engine.rank == 0:
        path, sha = weights.publish(published, out / "weights", spec["steps"])
        (out / "result.json").write_text(json.dumps({"metrics": metrics, "path": str(path), "sha": sha}))
    engine.close()  # as the learner does: no rank tears the group down under another's last collective


def optimizer_of_the_cuda_config(spec: dict[str, Any]) -> None:
    """DeepSpeed initialised on CPU with the optimizer section the learner gives it on CUDA (bf16 aside, which
    needs a GPU); writes which optimizer DeepSpeed built from it, after one step with it."""
    import deepspeed

    from learner.engine import init_process_group

    init_process_group("cpu")
    model = load_model(spec["model_dir"])
    args = {**BASE, "micro_batch_size": 1, "grad_accum_steps": 1, "betas": (0.9, 0.999), "eps": 1e-8}
    config = deepspeed_config(**args, zero_stage=spec["zero_stage"], device="cpu", world_size=1)
    config["optimizer"] = deepspeed_config(**args, zero_stage=0, device="cuda", world_size=1)["optimizer"]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    engine.backward(lm_loss(engine, torch.randint(3, 259, (1, SEQ_LEN))))
    engine.step()
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the basic optimizer
    found = {"type": f"{type(optimizer).__module__}.{type(optimizer).__name__}"}
    found["fused"] = optimizer.defaults.get("fused")
    Path(spec["out"]).write_text(json.dumps(found))
    torch.distributed.destroy_process_group()


def run_children(specs: list[dict[str, Any]], tmp: Path) -> None:
    """Run `train` in one subprocess per spec (ranks of one run when there are several), and wait."""
    files = [tmp / f"spec{rank}.json" for rank in range(len(specs))]
    for spec, spec_file in zip(specs, files, strict=True):
        spec_file.write_text(json.dumps(spec))
    launch_ranks(__file__, files, [tmp / f"child{rank}.log" for rank in range(len(specs))])


def result(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The published weights (verified by sha256) and the metrics a run wrote."""
    res = json.loads((out / "result.json").read_text())
    return weights.load_published(Path(res["path"]), res["sha"]), res["metrics"]


def torch_reference(model_dir: Path, out: Path, steps: int, **settings: Any) -> Path:
    train({"model_dir": str(model_dir), "out": str(out), "steps": steps, "settings": {**settings}})
    return out


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, hidden=64, layers=2)


# ---------------------------------------------------------------------- ds_config


def _cfg(**over: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "zero_stage": 2,
        "micro_batch_size": 4,
        "grad_accum_steps": 8,
        "lr": 1e-6,
        "weight_decay": 0.1,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "grad_clip": 1.0,
        "device": "cpu",
        "world_size": 2,
    }
    return deepspeed_config(**{**args, **over})


def test_ds_config_cpu_is_fp32_torch_adamw() -> None:
    cfg = _cfg()
    assert cfg["train_batch_size"] == 4 * 8 * 2
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 8
    assert cfg["zero_optimization"] == {"stage": 2}
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": False} and cfg["fp16"] == {"enabled": False}
    assert cfg["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 1e-6, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
    }
    json.dumps(cfg)  # plain JSON values only


def test_ds_config_gpu_is_bf16_torch_fused_adamw_or_deepspeeds_fused_adam() -> None:
    cfg = _cfg(device="cuda", zero_stage=3, world_size=8, grad_clip=0.0)
    assert cfg["bf16"] == {"enabled": True}
    # the default: torch's fused AdamW, which needs no build
    assert cfg["optimizer"]["params"]["torch_adam"] is True and cfg["optimizer"]["params"]["fused"] is True
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["train_batch_size"] == 4 * 8 * 8
    assert cfg["gradient_clipping"] == 0.0
    deepspeeds = _cfg(device="cuda", adam_impl="deepspeed")["optimizer"]["params"]
    assert deepspeeds["torch_adam"] is False and "fused" not in deepspeeds  # FusedAdam, built at first use
    assert _cfg(adam_impl="deepspeed") == _cfg()  # on CPU both are torch.optim.AdamW


def test_the_settings_name_the_adamw_they_step_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the learner reports as its engine (the broker's status shows it): backend, device, AdamW,
    and on CUDA the node's GPUs `april up` gave it."""
    from learner.model_trainer import engine_summary

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    cuda = TrainSettings(backend="deepspeed", zero_stage=2, device="cuda")
    assert engine_summary(cuda, 8) == "DeepSpeed ZeRO-2 on cuda, torch fused AdamW, 8 ranks"
    deepspeeds = TrainSettings(backend="deepspeed", device="cuda:1", adam_impl="deepspeed")
    assert engine_summary(deepspeeds, 1) == "DeepSpeed ZeRO-0 on cuda:1, DeepSpeed FusedAdam, 1 rank"
    assert engine_summary(TrainSettings(backend="torch"), 1) == "torch on cpu, torch AdamW, 1 rank"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert engine_summary(cuda, 4) == "DeepSpeed ZeRO-2 on cuda, torch fused AdamW, 4 ranks, GPUs 0,1,2,3"
    assert engine_summary(TrainSettings(backend="torch"), 1) == "torch on cpu, torch AdamW, 1 rank"  # no GPU
    with pytest.raises(ValueError, match="needs backend = 'deepspeed'"):
        TrainSettings(backend="torch", adam_impl="deepspeed")


def test_ds_config_is_pure() -> None:
    assert _cfg() == _cfg()
    assert _cfg() is not _cfg()


@pytest.mark.parametrize(
    ("field", "value"),
    [("zero_stage", 4), ("micro_batch_size", 0), ("grad_accum_steps", 0), ("world_size", 0), ("lr", 0.0),
     ("betas", (0.9, 1.0)), ("eps", 0.0), ("device", "tpu"), ("weight_decay", -1.0),
     ("adam_impl", "apex")],
)  # fmt: skip
def test_ds_config_rejects_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        _cfg(**{field: value})


# ---------------------------------------------------------------------- engine: DeepSpeed vs torch


@needs_deepspeed
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_deepspeed_steps_match_torch(model_dir: Path, tmp_path: Path, zero_stage: int) -> None:
    """Two AdamW steps (clipping active, 2 micro-batches accumulated) equal plain torch's."""
    ref_w, ref_m = result(torch_reference(model_dir, tmp_path / "torch", 2, backend="torch", **BASE))
    out = tmp_path / "ds"
    settings = {"backend": "deepspeed", "zero_stage": zero_stage, **BASE}
    run_children([{"model_dir": str(model_dir), "out": str(out), "steps": 2, "settings": settings}], tmp_path)
    ds_w, ds_m = result(out)
    init = load_model(model_dir).state_dict()
    assert max_diff(ref_w, init) > 1e-4  # the steps did move the weights
    assert ref_m[0]["grad_norm"] > BASE["grad_clip"]  # and clipping was active
    atol = 1e-6 if zero_stage < 3 else 1e-5
    assert max_diff(ds_w, ref_w) <= atol
    for got, want in zip(ds_m, ref_m, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


@needs_deepspeed
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_match_one_rank(
    model_dir: Path, tmp_path: Path, zero_stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 gloo ranks x (2 samples, 1 micro-batch) == 1 rank x (2 samples x 2 micro-batches); and two ranks
    compile no DeepSpeed op either (ZeRO's collectives are torch.distributed's)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    ref_w, ref_m = result(torch_reference(model_dir, tmp_path / "torch", 2, backend="torch", **BASE))
    out = tmp_path / "ds"
    settings = {**BASE, "backend": "deepspeed", "zero_stage": zero_stage, "grad_accum_steps": 1}
    spec = {"model_dir": str(model_dir), "out": str(out), "steps": 2, "settings": settings, "threads": 1}
    run_children([spec, spec], tmp_path)
    ds_w, ds_m = result(out)
    assert max_diff(ds_w, ref_w) <= 1e-5
    for got, want in zip(ds_m, ref_m, strict=True):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert compiled_ops(tmp_path / "extensions") == []


@needs_deepspeed
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_accumulation_may_change_between_steps(model_dir: Path, tmp_path: Path, zero_stage: int) -> None:
    """3, then 1, then 2 micro-batches per step (token-budgeted micro-batches vary so): DeepSpeed applies
    each step at its own boundary with its own 1/accumulation, as plain torch does."""
    schedule = [3, 1, 2]
    ref = {"model_dir": str(model_dir), "out": str(tmp_path / "torch"), "steps": 3, "accumulation": schedule}
    train({**ref, "settings": {**BASE, "backend": "torch"}})
    ref_w, ref_m = result(tmp_path / "torch")
    settings = {**BASE, "backend": "deepspeed", "zero_stage": zero_stage}
    run_children([{**ref, "out": str(tmp_path / "ds"), "settings": settings}], tmp_path)
    ds_w, ds_m = result(tmp_path / "ds")
    assert max_diff(ref_w, load_model(model_dir).state_dict()) > 1e-4
    assert max_diff(ds_w, ref_w) <= 1e-6
    for got, want in zip(ds_m, ref_m, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


@needs_deepspeed
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_deepspeed_builds_torchs_fused_adamw_from_the_cuda_config(
    model_dir: Path, tmp_path: Path, zero_stage: int
) -> None:
    """The learner's default on CUDA needs no op built: `"torch_adam": true, "fused": true` makes DeepSpeed
    0.19.8 hand `fused=True` on to torch.optim.AdamW (`runtime/engine.py`, `get_optimizer_configuration`
    pops only its own keys). Checked on CPU, where torch's fused AdamW runs too."""
    out = tmp_path / "optimizer.json"
    spec = {"probe": True, "model_dir": str(model_dir), "out": str(out), "zero_stage": zero_stage}
    run_children([spec], tmp_path)
    assert json.loads(out.read_text()) == {"type": "torch.optim.adamw.AdamW", "fused": True}


# ---------------------------------------------------------------------- DeepSpeed's compiled ops


def compiled_ops(extensions: Path) -> list[str]:
    """The ops torch's JIT built (or started to build) under TORCH_EXTENSIONS_DIR `extensions`."""
    return sorted(p.name for p in extensions.iterdir()) if extensions.is_dir() else []


@needs_deepspeed
def test_a_one_rank_deepspeed_engine_compiles_no_op(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's communication backend compiles its shared-memory op at any world size unless told the
    op is unusable; on 2 cores that took 30 s to minutes before the first step. Training never uses it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    settings = {"backend": "deepspeed", "zero_stage": 0, **BASE}
    run_children(
        [{"model_dir": str(model_dir), "out": str(tmp_path / "ds"), "steps": 1, "settings": settings}],
        tmp_path,
    )
    _, metrics = result(tmp_path / "ds")
    assert [m["step"] for m in metrics] == [1]  # it trained
    assert compiled_ops(tmp_path / "extensions") == []


def test_each_environment_compiles_ops_into_its_own_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An op compiled by one virtual environment has other include paths than another's: sharing one
    directory made each environment rebuild what the other built last."""
    root = tmp_path / "cache"
    one, other = extensions_dir("/work/a/.venv", root), extensions_dir("/work/b/.venv", root)
    assert one.parent == root == other.parent and one != other
    assert extensions_dir("/work/a/.venv", root) == one and one.name.startswith("venv-")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    use_environment_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")  # a directory the user named stays
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    use_environment_extensions_dir()
    from torch.utils.cpp_extension import get_default_build_root

    chosen = os.environ["TORCH_EXTENSIONS_DIR"]
    assert chosen == str(extensions_dir(sys.prefix, Path(get_default_build_root())))


# ---------------------------------------------------------------------- checkpoint and resume


def _resume_specs(model_dir: Path, tmp_path: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """An uninterrupted 3-step run that checkpoints after step 2, and a fresh run resuming from it."""
    full = {"model_dir": str(model_dir), "out": str(tmp_path / "full"), "steps": 3, "checkpoint_at": 2}
    resumed = {"model_dir": str(model_dir), "out": str(tmp_path / "resumed"), "steps": 3}
    resumed["resume"] = str(tmp_path / "full" / "checkpoints")
    return [{**full, "settings": settings}, {**resumed, "settings": settings}]


def _assert_same_next_step(tmp_path: Path) -> None:
    full_w, full_m = result(tmp_path / "full")
    res_w, res_m = result(tmp_path / "resumed")
    assert [m["step"] for m in res_m] == [3]
    assert res_m[0] == full_m[-1]  # loss, grad norm, lr (warm-up schedule) and RNG probes: exact
    assert max_diff(res_w, full_w) == 0.0
    full_sha = json.loads((tmp_path / "full" / "result.json").read_text())["sha"]
    assert json.loads((tmp_path / "resumed" / "result.json").read_text())["sha"] == full_sha  # same bytes


def test_torch_checkpoint_resume_equals_uninterrupted(model_dir: Path, tmp_path: Path) -> None:
    settings = {"backend": "torch", **BASE, "warmup_steps": 4}
    full, resumed = _resume_specs(model_dir, tmp_path, settings)
    train(full)
    train(resumed)
    _assert_same_next_step(tmp_path)
    found = checkpoint.latest(tmp_path / "full" / "checkpoints")
    assert found is not None and found.name == "step_00000002"
    meta = json.loads((found / checkpoint.META).read_text())
    assert meta == {"step": 2, "version": 2, "last_batch_id": 1, "world_size": 1, "backend": "torch",
                    "zero_stage": 0, "optimizer": "torch AdamW"}  # fmt: skip


@needs_deepspeed
@pytest.mark.parametrize(
    ("zero_stage", "ranks"),
    # ZeRO-3 over two ranks (weights and optimizer state split by rank) in the default suite; the others slow
    [(2, 1), (3, 2), pytest.param(3, 1, marks=pytest.mark.slow), pytest.param(2, 2, marks=pytest.mark.slow)],
)
def test_deepspeed_checkpoint_resume_equals_uninterrupted(
    model_dir: Path, tmp_path: Path, zero_stage: int, ranks: int
) -> None:
    settings = {"backend": "deepspeed", "zero_stage": zero_stage, **BASE, "warmup_steps": 4}
    if ranks > 1:  # each rank one micro-batch of 2 samples, one torch thread per rank on a small box
        settings = {**settings, "grad_accum_steps": 1}
    full, resumed = _resume_specs(model_dir, tmp_path, settings)
    if ranks > 1:
        full, resumed = ({**spec, "threads": 1} for spec in (full, resumed))
    run_children([full] * ranks, tmp_path)
    run_children([resumed] * ranks, tmp_path)
    _assert_same_next_step(tmp_path)


def test_a_checkpoint_resumes_only_into_the_layout_that_wrote_it(tmp_path: Path) -> None:
    """Another number of ranks, backend or ZeRO stage is refused with one line naming both layouts (the
    whole path through `april learner --resume`: tests/test_learner_integration.py)."""
    meta = checkpoint.CheckpointMeta(4, 4, 3, world_size=2, backend="deepspeed", zero_stage=3)
    path = tmp_path / "step_00000004"
    checkpoint.check_resumable(path, meta, world_size=2, backend="deepspeed", zero_stage=3)  # the same: fine
    for world, backend, stage, runs in [
        (1, "deepspeed", 3, "1 rank of DeepSpeed ZeRO-3"),
        (4, "deepspeed", 3, "4 ranks of DeepSpeed ZeRO-3"),
        (2, "deepspeed", 2, "2 ranks of DeepSpeed ZeRO-2"),
        (1, "torch", 0, "1 rank of plain torch"),
    ]:
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.check_resumable(path, meta, world_size=world, backend=backend, zero_stage=stage)
        message = str(info.value)
        assert "\n" not in message and str(path) in message
        assert f"written by 2 ranks of DeepSpeed ZeRO-3; this learner runs {runs}:" in message
    torch_meta = checkpoint.CheckpointMeta(4, 4, 3, world_size=1, backend="torch", zero_stage=2)
    checkpoint.check_resumable(path, torch_meta, world_size=1, backend="torch", zero_stage=0)  # no stages


def test_a_checkpoint_resumes_only_with_an_optimizer_that_holds_its_state(tmp_path: Path) -> None:
    """torch's AdamW, fused or not, keeps one state; DeepSpeed's FusedAdam another: a resume across them is
    one line with the fix. An older checkpoint that does not say which is taken as it is."""
    path = tmp_path / "step_00000004"
    layout = {"world_size": 1, "backend": "deepspeed", "zero_stage": 0}
    fused = checkpoint.CheckpointMeta(4, 4, 3, **layout, optimizer="DeepSpeed FusedAdam")
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.check_resumable(path, fused, **layout, optimizer="torch fused AdamW")
    assert str(info.value) == (
        f"checkpoint {path} holds the state of DeepSpeed FusedAdam; this learner steps torch fused AdamW: "
        'set learner.adam_impl="deepspeed" to resume it, or start a new run'
    )
    torch_adamw = checkpoint.CheckpointMeta(4, 4, 3, **layout, optimizer="torch AdamW")  # written on CPU
    checkpoint.check_resumable(path, torch_adamw, **layout, optimizer="torch fused AdamW")
    older = checkpoint.CheckpointMeta(4, 4, 3, **layout)
    checkpoint.check_resumable(path, older, **layout, optimizer="DeepSpeed FusedAdam")


def test_checkpoint_latest_ignores_incomplete(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "none") is None
    (tmp_path / "step_00000005").mkdir()  # no meta.json: a copy in progress or a crash
    (tmp_path / ".tmp-step_00000007").mkdir()
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / checkpoint.META).write_text("{}")
    assert checkpoint.latest(tmp_path) == tmp_path / "step_00000003"


def test_rng_state_round_trips_through_json() -> None:
    state = json.loads(json.dumps(checkpoint.rng_state()))
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    checkpoint.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want


# ---------------------------------------------------------------------- publishing weights


def test_publish_loads_back_into_the_model(model_dir: Path, tmp_path: Path) -> None:
    model = load_model(model_dir)
    engine = TrainEngine(model, TrainSettings(backend="torch", lr=1e-3))
    path, sha = weights.publish(engine.state_dict_for_publish(), tmp_path / "w", 7)
    assert path == tmp_path / "w" / "v000007.safetensors"
    assert sha == sha256_file(path)
    fresh = make_tiny_model(tmp_path / "other", seed=1, hidden=64, layers=2)
    other = load_model(fresh)
    other.load_state_dict(weights.load_published(path, sha))  # strict: every key, right shapes
    assert max_diff(other.state_dict(), model.state_dict()) == 0.0


def test_corrupted_file_fails_verification(tmp_path: Path) -> None:
    path, sha = weights.publish({"w": torch.arange(64, dtype=torch.float32)}, tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(weights.WeightsError, match="sha256"):
        weights.load_published(path, sha)
    with pytest.raises(weights.WeightsError, match="cannot read"):
        weights.load_published(tmp_path / "v000099.safetensors", sha)


def test_crash_mid_write_never_leaves_a_partial_version(tmp_path: Path, monkeypatch: Any) -> None:
    tensors = {"w": torch.ones(4)}
    weights.publish(tensors, tmp_path, 1)
    (tmp_path / ".v000002.crashed.tmp").write_bytes(b"half a file")  # a previous crash's leftover

    def crash(*_: Any, **__: Any) -> None:
        (tmp_path / ".v000002.partial.tmp").write_bytes(b"half")
        raise OSError("disk full")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        weights.publish(tensors, tmp_path, 2)
    monkeypatch.undo()
    assert published_versions(tmp_path) == [1]  # no v000002.safetensors, half or whole
    assert not (tmp_path / "v000002.safetensors").exists()
    weights.publish(tensors, tmp_path, 2)
    assert published_versions(tmp_path) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001.safetensors", "v000002.safetensors"]


def test_publish_keeps_the_last_versions(tmp_path: Path) -> None:
    for v in range(6):
        weights.publish({"w": torch.full((2,), float(v))}, tmp_path, v, keep=3)
    assert published_versions(tmp_path) == [3, 4, 5]
    weights.publish({"w": torch.zeros(2)}, tmp_path, 6, keep=2)
    assert published_versions(tmp_path) == [5, 6]
    with pytest.raises(ValueError, match="keep"):
        weights.publish({"w": torch.zeros(2)}, tmp_path, 7, keep=1)


def test_engine_enforces_the_accumulation_count(model_dir: Path) -> None:
    engine = TrainEngine(load_model(model_dir), TrainSettings(backend="torch", grad_accum_steps=2))
    ids = torch.randint(3, 259, (1, 8))
    engine.forward_backward(lm_loss, ids)
    with pytest.raises(RuntimeError, match="expected 2"):
        engine.step()
    with pytest.raises(RuntimeError, match="step\\(\\) first"):
        engine.zero_grad()
    engine.forward_backward(lm_loss, ids)
    with pytest.raises(RuntimeError, match="expected 2"):
        engine.forward_backward(lm_loss, ids)
    assert engine.step() > 0 and engine.steps == 1
    engine.set_accumulation(1)
    engine.forward_backward(lm_loss, ids)
    with pytest.raises(RuntimeError, match="accumulated"):
        engine.set_accumulation(2)
    assert engine.step() > 0 and engine.steps == 2
    with pytest.raises(ValueError, match="expected >= 1"):
        engine.set_accumulation(0)


if __name__ == "__main__":  # a child process of the DeepSpeed tests: python test_learner_engine.py SPEC
    child = json.loads(Path(sys.argv[1]).read_text())
    if child.get("probe"):
        optimizer_of_the_cuda_config(child)
    else:
        train(child)
