"""actors.weights_check: one rule for which tensors a weights file must hold, the same in every engine.

A tiny tied model (lm_head shares the input embedding) written by `save_pretrained`, which leaves lm_head
out, and the learner's `state_dict` files, which carry both names: the torch engine's check (ties from
shared storage) and the vLLM engine's (ties from config.json, tensors from the safetensors headers; no
vLLM needed to read them) must accept and refuse the same files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from actors.engine import WeightLoadError  # noqa: E402
from actors.engines import torch_engine, vllm_engine  # noqa: E402
from actors.weights_check import OUTPUT_EMBEDDING, TensorSpec, check_tensors, tied_embeddings  # noqa: E402
from april.hf import load_model, make_tiny_model  # noqa: E402

EMBED = "model.embed_tokens.weight"


def spec(*shape: int, floating: bool = True) -> TensorSpec:
    return TensorSpec(shape, "F32" if floating else "I64", floating)


WANT = {"a": spec(2, 3), "b": spec(2, 3), "c": spec(4)}


def test_a_tied_group_needs_one_of_its_names_and_the_rest_is_exact() -> None:
    tied = [{"a", "b"}]
    check_tensors(WANT, WANT, tied, "f")
    check_tensors({"a": spec(2, 3), "c": spec(4)}, WANT, tied, "f")
    check_tensors({"b": spec(2, 3), "c": spec(4)}, WANT, tied, "f")
    cases = [
        ({"c": spec(4)}, "f lacks 1 tensors, e.g. 'a'"),
        ({"a": spec(2, 3)}, "f lacks 1 tensors, e.g. 'c'"),
        ({**WANT, "d": spec(1)}, "f has 1 unexpected tensors, e.g. 'd'"),
        ({**WANT, "c": spec(5)}, r"'c' has shape \(5,\), expected \(4,\)"),
        ({**WANT, "c": spec(4, floating=False)}, "'c' has dtype I64, expected floating point"),
    ]
    for got, message in cases:
        with pytest.raises(WeightLoadError, match=message):
            check_tensors(got, WANT, tied, "f")
    with pytest.raises(WeightLoadError, match=r"lacks 1 tensors, e.g. 'b'"):
        check_tensors({"a": spec(2, 3), "c": spec(4)}, WANT, [], "f")  # untied: both are needed


def test_tied_embeddings_reads_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    want = {EMBED: spec(8, 4)}
    assert tied_embeddings(tmp_path, want) == [frozenset({EMBED, OUTPUT_EMBEDDING})]
    assert want[OUTPUT_EMBEDDING] == want[EMBED]  # the name save_pretrained left out
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    assert tied_embeddings(tmp_path, {EMBED: spec(8, 4)}) == []
    (tmp_path / "config.json").unlink()
    assert tied_embeddings(tmp_path, {EMBED: spec(8, 4)}) == []


def _verdicts(model_dir: Path, files: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Each engine's verdict on each file: "" accepted, else the error."""
    params = load_model(model_dir).state_dict()
    want = vllm_engine.read_header(model_dir)
    tied = tied_embeddings(model_dir, want)
    verdicts: dict[str, dict[str, str]] = {"torch": {}, "vllm": {}}
    for name, path in files.items():
        checks = {
            "torch": lambda p: torch_engine._check_state(torch_engine._read_state(p), params, "f"),
            "vllm": lambda p: vllm_engine.check_header(vllm_engine.read_header(p), want, tied, p),
        }
        for engine, check in checks.items():
            try:
                check(path)
                verdicts[engine][name] = ""
            except WeightLoadError as exc:
                verdicts[engine][name] = str(exc).split(":")[0] + (" lacks" if "lacks" in str(exc) else "")
    return verdicts


def test_torch_and_vllm_accept_and_refuse_the_same_files_of_a_tied_model(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model_dir = make_tiny_model(tmp_path / "tied", tie_embeddings=True)
    on_disk = vllm_engine.read_header(model_dir)
    assert EMBED in on_disk and OUTPUT_EMBEDDING not in on_disk  # save_pretrained wrote one name
    full = {k: v.detach().clone().contiguous() for k, v in load_model(model_dir).state_dict().items()}
    assert OUTPUT_EMBEDDING in full  # the learner publishes both
    files = {
        "published": full,
        "pretrained": {k: v for k, v in full.items() if k != OUTPUT_EMBEDDING},
        "no_embedding": {k: v for k, v in full.items() if k not in (EMBED, OUTPUT_EMBEDDING)},
        "no_norm": {k: v for k, v in full.items() if k != "model.norm.weight"},
    }
    paths = {}
    for name, state in files.items():
        paths[name] = tmp_path / f"{name}.safetensors"
        save_file(state, str(paths[name]))
    verdicts = _verdicts(model_dir, paths)
    assert verdicts["torch"] == verdicts["vllm"]
    assert verdicts["vllm"] == {
        "published": "",
        "pretrained": "",
        "no_embedding": "load_weights lacks",
        "no_norm": "load_weights lacks",
    }
