"""Which tensors a weights file must hold to load into a model: one rule for every engine that checks one.

`check_tensors(got, want, tied, source)`: no tensor the model lacks, every tensor of the model present
unless it is tied to one that is (a tied group, e.g. `lm_head.weight` and the input embedding, needs one of
its names: `save_pretrained` writes one, the learner's `state_dict` both), the same shapes, floating point
where the model's is. The engines differ only in how they learn the model's tensors and ties: the torch
engine from its parameters (tied ones share storage), the vLLM engine, which never holds the model in this
process, from the checkpoint's header and its config's `tie_word_embeddings` (`tied_embeddings`). SGLang's
servers match names themselves; what april reads back from them (`sglang_broadcast.check_version`)
compares values, not names. Raises WeightLoadError (one line); loads nothing.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from actors.engine import WeightLoadError

OUTPUT_EMBEDDING = "lm_head.weight"
# Hugging Face names of the input embedding (Llama/Qwen/Mistral, GPT-2, GPT-NeoX) that lm_head is tied to
INPUT_EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "gpt_neox.embed_in.weight")


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: str  # as the source names it (torch.bfloat16, BF16), for messages only
    floating: bool


def check_tensors(
    got: Mapping[str, TensorSpec],
    want: Mapping[str, TensorSpec],
    tied: Iterable[Collection[str]],
    source: str,
) -> None:
    """WeightLoadError unless `got` (a file's tensors) may load into a model of tensors `want` whose
    `tied` groups share storage; `source` names the file in the message."""
    unexpected = sorted(set(got) - set(want))
    if unexpected:
        raise WeightLoadError(
            f"load_weights: {source} has {len(unexpected)} unexpected tensors, e.g. {unexpected[0]!r}"
        )
    groups = [sorted(g, key=list(want).index) for g in tied if len(g) > 1]
    grouped = {name for group in groups for name in group}
    groups += [[name] for name in want if name not in grouped]
    missing = sorted(group[0] for group in groups if not any(name in got for name in group))
    if missing:
        raise WeightLoadError(f"load_weights: {source} lacks {len(missing)} tensors, e.g. {missing[0]!r}")
    for name, spec in got.items():
        model = want[name]
        if spec.shape != model.shape:
            raise WeightLoadError(f"load_weights: {name!r} has shape {spec.shape}, expected {model.shape}")
        if model.floating and not spec.floating:
            raise WeightLoadError(f"load_weights: {name!r} has dtype {spec.dtype}, expected floating point")


def tied_embeddings(model_dir: Path, want: dict[str, TensorSpec]) -> list[frozenset[str]]:
    """The tied group of a checkpoint whose config.json sets `tie_word_embeddings`: lm_head and the input
    embedding (added to `want` with the embedding's spec when the checkpoint left lm_head out). None
    when the config does not tie them or names no input embedding we know."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return []
    embedding = next((name for name in INPUT_EMBEDDINGS if name in want), None)
    if not isinstance(config, dict) or config.get("tie_word_embeddings") is not True or embedding is None:
        return []
    want.setdefault(OUTPUT_EMBEDDING, want[embedding])
    return [frozenset({embedding, OUTPUT_EMBEDDING})]
