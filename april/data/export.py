"""`export_jsonl`: a prompt source's first records, in draw order, written as JSON Lines that
`FilePromptSource` reads back (`april task export` writes the built-in task this way).

The prompt is written as chat messages if the record has them, else as token ids if it has any, else as
text; the answer goes under `answer_key` (nested for a dotted key); other metadata stays top-level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from april.data.fields import put
from april.data.records import PromptSource


def export_jsonl(
    source: PromptSource,
    path: str | Path,
    count: int,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> None:
    """Write the records at cursors 0..count-1 of `source` to `path`, one JSON object a line."""
    if not 0 <= count <= len(source):
        raise ValueError(f"export count must be in [0, {len(source)}] (the source size), got {count}")
    with Path(path).open("w", encoding="utf-8") as out:
        for cursor in range(count):
            record = source.get(cursor)
            meta = dict(record.metadata)
            meta.pop("prompt_index", None)
            messages, answer = meta.pop("messages", None), meta.pop("answer", None)
            prompt: Any = json.loads(messages) if messages else record.prompt_ids.tolist() or record.text
            obj: dict[str, Any] = dict(meta)
            put(obj, prompt_key, prompt)
            if answer is not None and answer_key:
                put(obj, answer_key, answer)
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")
