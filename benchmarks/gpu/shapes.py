"""The model shapes the GPU check runs, with random weights built offline from a transformers config.

`qwen3-1.7b` and `qwen3-0.6b` are the released Qwen3 models' shapes (their config.json: hidden size,
layers, 16 query / 8 key-value heads of 128, the 151,936-token vocabulary, tied embeddings); the weights
are random, which changes no step time. `qwen3-smoke` is the same architecture at a size a CPU runs in
seconds (a 512-token vocabulary), for `--smoke`. Nothing is downloaded. Building on the GPU in the
target dtype skips a float32 copy on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Qwen3Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 151_936
    max_positions: int = 40_960

    def config(self) -> Any:
        from transformers import Qwen3Config

        config = Qwen3Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_positions,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        config._attn_implementation = "sdpa"
        return config


SHAPES = {
    "qwen3-1.7b": Qwen3Shape(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144),
    "qwen3-0.6b": Qwen3Shape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
    "qwen3-smoke": Qwen3Shape(
        hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512
    ),
}


def build(shape: Qwen3Shape, device: str, dtype: Any, seed: int = 0) -> Any:
    """A randomly initialised Qwen3ForCausalLM of `shape`, made on `device` in `dtype`."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(shape.config())
    finally:
        torch.set_default_dtype(default)
    return model


def write_model_dir(shape: Qwen3Shape, path: Path, device: str, dtype: Any, seed: int = 0) -> Path:
    """`build`, saved as an HF model directory (config + safetensors; no tokenizer: engines take ids)."""
    model = build(shape, device, dtype, seed)
    model.save_pretrained(path)
    del model
    return path
