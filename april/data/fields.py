"""One dataset row (a JSON object, or an Arrow row as Python values) -> one `PromptRecord`: the one place
that reads `data.prompt_key`, `data.answer_key` and `data.answer_format`, for every file format alike.

The prompt field holds text, chat messages (a list of {role, content}: kept whole, as JSON, in the
record's "messages" metadata for the worker's chat template; the record's text is the last user message;
every role one of `CHAT_ROLES`, the last message not the assistant's unless `continue_final_message`)
or token ids. The answer field's value (a string or number) becomes the "answer" given to the reward, as
it is or, with answer_format gsm8k, the text after its last "####". Other top-level scalar fields become
metadata. A row that does not fit raises `RecordError` naming the field; where the row is, its source says.

Does not read files, tokenize or apply chat templates (the worker's tokenizer does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from april.config import AnswerFormat
from april.data.records import INT32_MAX, PromptRecord, RecordError

GSM8K_MARK = "####"  # GSM8K's answers end "...\n#### 72"
CHAT_ROLES = ("system", "user", "assistant", "tool")  # april.episode.Role's values: what chat templates take


def lookup(obj: dict[str, Any], dotted_key: str) -> tuple[bool, Any, str]:
    """Follow "a.b.c" through nested objects: (found, value, ""); when a step is missing, (False, None,
    the dotted path of the object that lacks it: "" for `obj` itself)."""
    value: Any = obj
    parts = dotted_key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            return False, None, ".".join(parts[:depth])
        value = value[part]
    return True, value, ""


def put(obj: dict[str, Any], dotted_key: str, value: Any) -> None:
    """Set "a.b.c" in `obj`, making the nested objects on the way."""
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[leaf] = value


def gsm8k_answer(text: str) -> str | None:
    """The final answer GSM8K writes after its last "####", commas dropped ("1,000" -> "1000"); None if
    there is none."""
    _, mark, tail = text.rpartition(GSM8K_MARK)
    answer = tail.strip().replace(",", "")
    return answer if mark and answer else None


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class RecordFields:
    """Where a row keeps its prompt and answer, and whether every row must have an answer (training: the
    reward needs one; `april generate` does not)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"  # empty: no answers
    answer_format: AnswerFormat = AnswerFormat.RAW
    require_answer: bool = True
    continue_final_message: bool = False  # a chat prompt may end with an assistant message

    @property
    def top_keys(self) -> frozenset[str]:
        """The top-level fields the prompt and the answer are read from (they are not metadata)."""
        keys = {self.prompt_key.split(".")[0]}
        if self.answer_key:
            keys.add(self.answer_key.split(".")[0])
        return frozenset(keys)

    def missing_column(self, names: list[str]) -> str | None:
        """For a format whose rows all have the same top-level fields `names`: the problem every row would
        have, or None. The text is the one `record` gives for the row."""
        keys = ", ".join(sorted(names)) or "none"
        if self.prompt_key.split(".")[0] not in names:
            return f"missing prompt field {self.prompt_key!r} (keys present: {keys})"
        if self.answer_key and self.require_answer and self.answer_key.split(".")[0] not in names:
            return f"missing answer field {self.answer_key!r} (keys present: {keys})"
        return None

    def record(self, obj: Any, index: int) -> PromptRecord:
        """The record at dataset position `index` read from `obj`; RecordError naming the field if it
        does not fit."""
        if not isinstance(obj, dict):
            raise RecordError(f"expected a JSON object, got {type(obj).__name__}")
        top = self.top_keys
        metadata = {
            k: str(v)
            for k, v in obj.items()
            if k not in top and v is not None and not isinstance(v, dict | list | bytes)
        }
        ids, text = self._prompt(obj, metadata)
        answer = self._answer(obj)
        if answer is not None:
            metadata["answer"] = answer
        metadata["prompt_index"] = str(index)
        return PromptRecord(index, ids, text, metadata)

    def _missing(self, what: str, key: str, obj: dict[str, Any], where: str) -> RecordError:
        container = lookup(obj, where)[1] if where else obj
        if not isinstance(container, dict):
            return RecordError(
                f"missing {what} field {key!r} ({where!r} is a {type(container).__name__}, not an object)"
            )
        keys = ", ".join(sorted(container)) or "none"
        inside = f" in {where!r}" if where else ""
        return RecordError(f"missing {what} field {key!r} (keys present{inside}: {keys})")

    def _prompt(self, obj: dict[str, Any], metadata: dict[str, str]) -> tuple[np.ndarray, str]:
        key = self.prompt_key
        found, prompt, where = lookup(obj, key)
        if not found:
            raise self._missing("prompt", key, obj, where)
        ids, text = np.zeros(0, dtype=np.int32), ""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RecordError(f"empty prompt in field {key!r}")
            text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]  # Arrow's nulls
            self._check_roles(messages)
            users = [m.get("content") for m in messages if m.get("role") == "user"]
            if not users or not isinstance(users[-1], str) or not users[-1].strip():
                raise RecordError(f"chat prompt {key!r} has no non-empty user message content")
            # keys sorted: Arrow may order a struct's fields differently from the JSON it came from
            text, metadata["messages"] = users[-1], json.dumps(messages, ensure_ascii=False, sort_keys=True)
        elif isinstance(prompt, list) and prompt:
            if not all(type(i) is int and 0 <= i <= INT32_MAX for i in prompt):
                raise RecordError(f"prompt {key!r} must be a string, chat messages or non-negative int ids")
            ids = np.asarray(prompt, dtype=np.int32)
        elif isinstance(prompt, list):
            raise RecordError(f"empty prompt in field {key!r}")
        elif prompt is None:
            raise RecordError(f"prompt field {key!r} is null")
        else:
            raise RecordError(f"prompt {key!r} must be a string or a list, got {type(prompt).__name__}")
        ids.flags.writeable = False
        return ids, text

    def _check_roles(self, messages: list[dict[str, Any]]) -> None:
        """Every message has a role chat templates know (Qwen2.5's drops any other silently, and then adds
        its default system prompt), and the last is not the assistant's unless it is to be continued (a
        reference solution at the end puts the answer in the prompt)."""
        key = self.prompt_key
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise RecordError(
                    f"chat prompt {key!r} message {i}: role {_short(m.get('role'))} is not one of "
                    f"{', '.join(CHAT_ROLES)}"
                )
        if messages[-1]["role"] == "assistant" and not self.continue_final_message:
            raise RecordError(
                f"chat prompt {key!r} ends with an assistant message (its answer would be in the prompt): "
                "drop it, or set data.continue_final_message = true to have the model continue it"
            )

    def _answer(self, obj: dict[str, Any]) -> str | None:
        key = self.answer_key
        if not key:
            return None
        found, answer, where = lookup(obj, key)
        if not found or answer is None:
            if self.require_answer:
                if found:
                    raise RecordError(f"missing answer field {key!r} (it is null)")
                raise self._missing("answer", key, obj, where)
            return None
        if not isinstance(answer, str | int | float) or isinstance(answer, bool):
            raise RecordError(f"answer {key!r} must be a string or number, got {type(answer).__name__}")
        if self.answer_format == AnswerFormat.GSM8K:
            final = gsm8k_answer(str(answer))
            if final is None:
                raise RecordError(
                    f"answer {key!r} has no final answer after {GSM8K_MARK!r} (data.answer_format = "
                    f"'gsm8k'), got {_short(answer)}"
                )
            return final
        return str(answer)
