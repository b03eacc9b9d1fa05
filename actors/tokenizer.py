"""Text <-> token ids for the worker: the model's own tokenizer, or a byte tokenizer when there is no model.

The broker deals in token ids; the worker tokenizes prompts that arrive as text (once, on first lease;
resumes reuse the ids) and decodes responses for the reward. `HFTokenizer` wraps a Hugging Face tokenizer
saved with the model (applying its chat template when the record carries chat `messages`; a model without
one is given the last user message's text, the record's text, and says so once: `no_chat_template`);
`april.sim.byte_tokenizer.ByteTokenizer` serves the sim engine and tests. Heavy imports stay inside
`HFTokenizer`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

log = logging.getLogger("april.tokenizer")


def no_chat_template(model_dir: Path | str) -> str:
    """The one line said when chat prompts meet a model whose tokenizer has no chat template."""
    return (
        f"{model_dir} has no chat template: chat prompts are given to it as the text of their last user "
        "message (system and earlier messages left out)"
    )


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode_prompt(self, text: str, metadata: dict[str, str]) -> npt.NDArray[np.int32]: ...

    def decode(self, ids: npt.NDArray[np.int32]) -> str: ...


class HFTokenizer:
    def __init__(self, model_dir: Path | str) -> None:
        from april.hf import load_tokenizer

        self.model_dir = model_dir
        self.tok: Any = load_tokenizer(model_dir)
        eos = self.tok.eos_token_id
        self.eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        self._said_no_template = False

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode_prompt(self, text: str, metadata: dict[str, str]) -> npt.NDArray[np.int32]:
        messages = metadata.get("messages")
        if messages and self.has_chat_template:
            chat = json.loads(messages)
            # a prompt that ends with the assistant's message (data.continue_final_message) is continued
            ends_with_answer = bool(chat) and chat[-1].get("role") == "assistant"
            ids = self.tok.apply_chat_template(
                chat,
                add_generation_prompt=not ends_with_answer,
                continue_final_message=ends_with_answer,
                tokenize=True,
            )
            if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding (a UserDict)
                ids = ids["input_ids"]
        else:
            if messages and not self._said_no_template:
                log.warning("%s", no_chat_template(self.model_dir))
                self._said_no_template = True
            ids = self.tok(text, add_special_tokens=True)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    def render(self, ids: npt.NDArray[np.int32]) -> str:
        """`ids` as the model reads them: decoded with the special tokens (a chat template's markers)."""
        return str(self.tok.decode(ids.tolist(), skip_special_tokens=False))

    def decode(self, ids: npt.NDArray[np.int32]) -> str:
        return str(self.tok.decode(ids.tolist(), skip_special_tokens=True))
