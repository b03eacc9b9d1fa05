"""Hugging Face model directories, shared by the rollout side and the learner: check, load, make tiny ones.

Owns everything that touches `transformers` model/tokenizer loading: checking that a model directory is
complete (one readable `ModelError` line per missing piece), loading it on a device and dtype,
`make_tiny_model` (a small random Llama, Qwen2 or Qwen3 model plus a byte-level tokenizer, written offline and
deterministic by seed, for tests, benchmarks and the built-in task) and the torch thread setting. It lives
in `april/` because workers (torch, vLLM engines, tokenizers) and the learner both load models, and roles
never import each other.

Does not generate (that is `actors.engines.torch_engine`) and never downloads: directories only.
Heavy imports (torch, transformers, tokenizers) happen inside the functions, never at import time, so
`april` stays importable without torch (tests/test_dependencies.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelError(Exception):
    """A model directory that is missing, incomplete or unreadable; the message is one readable line."""


TINY_MODEL = (
    Path(__file__).resolve().parents[1] / "models" / "tiny"
)  # the shipped model (`april sft` made it)
TINY_CALCULATOR_MODEL = TINY_MODEL.with_name("tiny-calculator")  # `april sft --task calculator` made it

# Special tokens of the tiny byte-level tokenizer; the 256 byte tokens follow them.
TINY_PAD, TINY_BOS, TINY_EOS = "<|pad|>", "<|bos|>", "<|eos|>"
TINY_SPECIALS = (TINY_PAD, TINY_BOS, TINY_EOS)


def check_model_dir(model_dir: Path | str, *, tokenizer: bool = True) -> Path:
    """Return `model_dir` as a Path, or raise ModelError naming the first missing piece."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelError(f"model directory {str(path)!r} does not exist (expected an HF model directory)")
    if not (path / "config.json").is_file():
        raise ModelError(f"model directory {str(path)!r} has no config.json")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise ModelError(f"model directory {str(path)!r} has no weights (expected *.safetensors)")
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(
            f"model directory {str(path)!r} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    return path


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """`"auto"` is float32 on CPU and bfloat16 on CUDA; names like "float16" map to torch dtypes."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ModelError(f"dtype {dtype!r} is not a torch dtype (expected auto, float32, bfloat16, float16)")
    return resolved


def load_model(
    model_dir: Path | str, device: str = "cpu", dtype: str | torch.dtype = "auto"
) -> PreTrainedModel:
    """The causal LM in `model_dir` on `device`, in eval mode, with SDPA attention."""
    from transformers import AutoModelForCausalLM

    path = check_model_dir(model_dir, tokenizer=False)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype, device), attn_implementation="sdpa", local_files_only=True
        )
    except Exception as exc:  # from_pretrained raises many types (OSError, SafetensorError, ValueError...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load model from {str(path)!r}: {first}") from exc
    model.to(device)  # type: ignore[arg-type]  # transformers types `.to` through a decorator
    model.eval()  # type: ignore[no-untyped-call]
    return model


def load_tokenizer(model_dir: Path | str) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model in `model_dir`."""
    from transformers import AutoTokenizer

    path = check_model_dir(model_dir, tokenizer=True)
    try:
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load tokenizer from {str(path)!r}: {first}") from exc
    return tok


def make_tiny_tokenizer(digit_groups: bool = False, words: tuple[str, ...] = ()) -> PreTrainedTokenizerBase:
    """A byte-level tokenizer (3 specials + 256 byte tokens) built from code, usable offline. With
    `digit_groups`, runs of digits are split into groups of up to three, each one token (as Llama-3's
    tokenizer splits numbers): 1,100 more tokens, merged from the digit bytes. `words` are whole tokens
    too, matched before anything else (as the frequent strings of a task are, in a BPE tokenizer trained
    on its text)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    groups = [f"{n:0{w}d}" for w in (2, 3) for n in range(10**w)] if digit_groups else []
    vocab = {tok: i for i, tok in enumerate((*TINY_SPECIALS, *byte_tokens, *groups))}
    merges = [(g[:-1], g[-1]) for g in groups]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated"), byte_level])
        if digit_groups
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token=TINY_PAD, bos_token=TINY_BOS, eos_token=TINY_EOS
    )
    fast.add_tokens([AddedToken(w, normalized=False, special=False) for w in words])
    return fast


# The architectures `make_tiny_model` builds: name -> (transformers config class, model class).
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
# The released models' vocabularies (Llama-3: 128,256; Qwen2 and Qwen3: 151,936 incl. padding rows).
REAL_VOCAB_SIZES = {"llama": 128_256, "qwen2": 151_936, "qwen3": 151_936}


def make_tiny_model(
    model_dir: Path | str,
    seed: int = 0,
    *,
    vocab_size: int = 320,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = 2048,
    init_std: float = 0.1,
    architecture: str = "llama",
    tie_embeddings: bool = False,
    digit_groups: bool = False,
    words: tuple[str, ...] = (),
) -> Path:
    """Write a random causal LM + byte-level tokenizer (`make_tiny_tokenizer(digit_groups, words)`) to
    `model_dir`; return the path.

    `architecture` is one of `ARCHITECTURES`: "llama" (Llama-3's layout), "qwen2" (biases on q/k/v) or
    "qwen3" (RMSNorm on q and k); `tie_embeddings` shares the input embedding with the output head, as
    the small Qwen models do. Same arguments and seed give the same weights. `vocab_size` must cover the
    tokenizer's 259 tokens (with digit groups or words it grows to the tokenizer's size); ids above that
    are valid model outputs that decode to nothing (a real vocabulary, e.g. `REAL_VOCAB_SIZES["qwen3"]`,
    gives a real model's output layer and softmax width).
    pad/bos/eos are ids 0/1/2. `init_std` is larger than Llama's 0.02 so that a random model has peaked
    (not near-uniform) next-token distributions, which keeps greedy comparisons away from numerical ties.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = make_tiny_tokenizer(digit_groups, words)
    if digit_groups or words:
        vocab_size = max(vocab_size, len(tokenizer))
    if vocab_size < len(tokenizer):
        raise ModelError(f"make_tiny_model: vocab_size {vocab_size} < tokenizer size {len(tokenizer)}")
    if architecture not in ARCHITECTURES:
        raise ModelError(
            f"make_tiny_model: architecture {architecture!r}, expected one of {', '.join(ARCHITECTURES)}"
        )
    config_class, model_class = ARCHITECTURES[architecture]
    config = getattr(transformers, config_class)(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tie_embeddings,
    )
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer in backward (non-reentrant `torch.utils.checkpoint`, which works with
    inputs that need no gradient); transformers renamed the method in 5.x, both names are accepted."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def set_torch_threads(n: int) -> None:
    """Use `n` intra-op threads (and as many inter-op threads, if torch still allows setting them)."""
    import torch

    torch.set_num_threads(max(1, n))
    # torch allows this once, before any parallel work; later calls raise and change nothing
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(max(1, n))


def model_context_length(model: Any) -> int:
    """Most positions the model can attend over (max_position_embeddings); 2**31 when it does not say."""
    config = model.config.get_text_config(decoder=True)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else 2**31
