"""The byte tokenizer: text as its UTF-8 bytes, shifted past the tiny model's three special ids.

Shared by the two places that tokenize without a model: the rollout worker running the sim engine
(`actors.factory`) and `april simulate`'s simulated workers (`broker.sim.engines`), so a text prompt has
the same length in both. Lossless for any text. Knows no model and no chat template (`actors.tokenizer`
wraps a model's own tokenizer).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

BYTE_OFFSET = 3  # ids 0, 1, 2 are pad, bos, eos, as in the tiny model's tokenizer


class ByteTokenizer:
    """UTF-8 bytes shifted past the three special ids."""

    eos_token_ids: tuple[int, ...] = (2,)

    def encode_prompt(self, text: str, metadata: dict[str, str]) -> npt.NDArray[np.int32]:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET

    def decode(self, ids: npt.NDArray[np.int32]) -> str:
        a = np.asarray(ids, dtype=np.int64)
        data = (a[(a >= BYTE_OFFSET) & (a < BYTE_OFFSET + 256)] - BYTE_OFFSET).astype(np.uint8).tobytes()
        return data.decode("utf-8", "replace")
