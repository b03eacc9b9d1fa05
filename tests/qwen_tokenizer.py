"""A Qwen2.5/Qwen3-style tokenizer built offline, with the real models' chat templates.

The chat templates in tests/chat_templates/ are those of Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen3-0.6B as
huggingface/huggingface.js records them in packages/jinja/test/e2e.test.js (commit fe42e680), with the
rendering of its Qwen2.5 tool-calling example (qwen2_5_tool_example.txt). The tokenizer reproduces the
structure of Qwen's tokenizer.json (as published with Qwen3-4B): an NFC normalizer, the Split
pre-tokenizer regex below followed by byte-level BPE, `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as
special tokens and the tool/think tags as added non-special tokens, eos `<|im_end|>`. Its merges are
learned here from a small corpus of tool conversations (the real 151k vocabulary is not needed for
token-boundary behaviour: merges across newlines and punctuation are what matter).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
CORPUS = [
    '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}\n</tool_call>',
    "<tool_response>\n19\n</tool_response>\n\nThe answer is 19.\n\n",
    "You are a helpful assistant. What's the temperature in San Francisco now? How about tomorrow?",
    '{"type": "function", "function": {"name": "get_current_temperature", "description": "Get it."}}',
    "def f(x):\n    return x * 2\n\nprint(f(21))\n",
] * 20


@cache
def qwen_tokenizer(template: str = "qwen2_5_instruct") -> Any:
    """A PreTrainedTokenizerFast with Qwen's special tokens and the named template from TEMPLATES."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=list(SPECIAL), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_tokens(list(ADDED))
    fast.chat_template = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    return fast
