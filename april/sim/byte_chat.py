"""The conversation format of the sim engine's byte tokenizer: each message's content as its bytes.

Owns the chat format a worker uses when it plays episodes with no model (`worker.engine = "sim"`): a
prompt is its messages' contents, an observation its messages' contents, a model turn its content and
nothing else; no role markers, no tool-call blocks, no stop token inserted anywhere. So an observation
of n bytes is n tokens, as `april simulate` counts an observation of n tokens, and a turn ends where
the engine ended it. Parsing a turn gives its text as an assistant message without tool calls.

Knows nothing of environments or engines; `april.chat` holds the formats of real tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from april.chat import ChatFormat
from april.episode import Message, Role, Tool
from april.sim.byte_tokenizer import ByteTokenizer


class ByteChat(ChatFormat):
    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tok = tokenizer
        self.stop_ids = tuple(tokenizer.eos_token_ids)
        self.stop_texts = ("",) * len(self.stop_ids)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[int]:
        del tools
        return self._encode("".join(m.content for m in messages))

    def turn_ids(self, turn: Message) -> list[int]:
        return self._encode(turn.content)

    def observation_ids(self, messages: Sequence[Message], *, after_stop: bool = True) -> list[int]:
        del after_stop  # no stop token closes a turn here, so none opens an observation either
        return self._encode("".join(m.content for m in messages))

    def parse_turn(self, text: str) -> Message:
        return Message(Role.ASSISTANT, text)

    def _encode(self, text: str, special: bool = False) -> list[int]:
        del special
        return [int(i) for i in self.tok.encode_prompt(text, {})]

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(np.asarray(ids, dtype=np.int32)))
