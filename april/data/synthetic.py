"""The synthetic prompt source: seeded random token-id prompts, each derived from (seed, index) alone.

Owns `SyntheticPromptSource` (`[data] source = "synthetic"`): prompt lengths drawn in
[prompt_len_min, prompt_len_max], token ids in [FIRST_TOKEN_ID, vocab_size), the answer the ids' sum
modulo 10, the text the ids joined by spaces. Reads no file and needs no tokenizer.
"""

from __future__ import annotations

import numpy as np

from april.data import records
from april.data.records import INT32_MAX, CursorMap, KeptRecords, PromptRecord

FIRST_TOKEN_ID = 3  # ids 0, 1, 2 are reserved for pad / bos / eos in synthetic prompts
_TOKEN_TEXT_MAX = 1 << 16  # vocabularies up to this size get a table of token texts (~60 bytes an entry)


def record_bytes(tokens: int) -> int:
    """A synthetic record's size as kept, measured with tracemalloc: about 1.1 kB a record and 7 bytes a
    token (its array and text). The default dataset (10,000 prompts of 8-64 tokens) takes about 14 MB and
    is built once a run: building a prompt costs the broker about 27 us (mostly seeding its generator),
    looking it up a dict access."""
    return 1024 + 8 * tokens


class SyntheticPromptSource:
    """Seeded random token-id prompts; each one derived from (seed, index), so get() is O(length)."""

    def __init__(
        self,
        size: int = 10000,
        *,
        seed: int = 0,
        prompt_len_min: int = 8,
        prompt_len_max: int = 64,
        vocab_size: int = 1000,
        shuffle: bool = True,
    ) -> None:
        if size <= 0:
            raise ValueError(f"synthetic size must be > 0, got {size}")
        if not 0 < prompt_len_min <= prompt_len_max:
            raise ValueError(
                f"need 0 < prompt_len_min <= prompt_len_max, got {prompt_len_min}, {prompt_len_max}"
            )
        if not FIRST_TOKEN_ID < vocab_size <= INT32_MAX:
            raise ValueError(f"synthetic vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
        self.seed, self.len_min, self.len_max, self.vocab_size = (
            seed,
            prompt_len_min,
            prompt_len_max,
            vocab_size,
        )
        self._map = CursorMap(size, seed, shuffle)
        # each token id's text, for the prompt text (a join of table entries, not one str() per token)
        self._token_text = [str(i) for i in range(vocab_size)] if vocab_size <= _TOKEN_TEXT_MAX else None
        self._kept = KeptRecords(records.KEPT_PROMPT_BYTES, lambda r: record_bytes(len(r.prompt_ids)))

    def __len__(self) -> int:
        return self._map.size

    def get(self, cursor: int) -> PromptRecord:
        """The record at `cursor`: built from (seed, index), or the same record again while it is kept."""
        index = self._map.index(cursor)
        record = self._kept.get(index)
        if record is None:
            record = self._build(index)
            self._kept.put(index, record)
        return record

    def _build(self, index: int) -> PromptRecord:
        rng = np.random.default_rng((self.seed, index))
        length = int(rng.integers(self.len_min, self.len_max + 1))
        ids = rng.integers(FIRST_TOKEN_ID, self.vocab_size, size=length, dtype=np.int32)
        ids.flags.writeable = False
        tokens = ids.tolist()
        answer = str(sum(tokens) % 10)  # Python ints: exact, as the int64 sum it replaces
        table = self._token_text
        text = " ".join([table[t] for t in tokens] if table is not None else map(str, tokens))
        return PromptRecord(index, ids, text, {"prompt_index": str(index), "answer": answer})

    def describe(self) -> str:
        return (
            f"synthetic(size={len(self)}, seed={self.seed}, len=[{self.len_min},{self.len_max}], "
            f"vocab={self.vocab_size}, shuffle={self._map.shuffle})"
        )
