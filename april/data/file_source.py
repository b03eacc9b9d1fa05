"""`FilePromptSource`: a dataset file or directory, in any format `april.data.rows` reads, as a
`PromptSource`.

Opening checks every row once (every format alike: the first bad row is one `DatasetError` line naming
where it is and the field, with how many more rows are bad), so a run never meets a bad record after it
has started. Records are built from their rows and kept within `KEPT_PROMPT_BYTES`; one that was dropped
is built again from its row when it is drawn, so a dataset larger than the budget is not held as
records (only as its rows: see each format's module).
"""

from __future__ import annotations

from pathlib import Path

from april.config import AnswerFormat
from april.data import records
from april.data.fields import RecordFields
from april.data.records import CursorMap, DatasetError, KeptRecords, PromptRecord, RecordError
from april.data.rows import Rows, open_rows


def record_bytes(record: PromptRecord) -> int:
    """A file record's size as kept, estimated: its fixed parts, ids, text and metadata strings."""
    return 1024 + 8 * len(record.prompt_ids) + len(record.text) + sum(map(len, record.metadata.values()))


class FilePromptSource:
    """The dataset at `path` as prompt records, in its own order or shuffled anew each epoch.

    Every row needs its answer field when `require_answer` is set (training: the reward needs it);
    otherwise (`april generate`) a row without one gives a record without "answer" in its metadata. A chat
    prompt may end with an assistant message only with `continue_final_message` (`data.` of that name)."""

    def __init__(
        self,
        path: str | Path,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        answer_format: AnswerFormat = AnswerFormat.RAW,
        seed: int = 0,
        shuffle: bool = True,
        require_answer: bool = True,
        continue_final_message: bool = False,
    ) -> None:
        self.path = Path(path)
        self.fields = RecordFields(
            prompt_key, answer_key, answer_format, require_answer, continue_final_message
        )
        self.rows: Rows = open_rows(self.path, self.fields)
        self._kept = KeptRecords(records.KEPT_PROMPT_BYTES, record_bytes)
        self._check_every_row()
        self._map = CursorMap(len(self.rows), seed, shuffle)

    def _check_every_row(self) -> None:
        rows = self.rows
        if not len(rows):
            raise DatasetError(f"{self.path}: dataset is empty (no records)")
        if rows.columns is not None and (problem := self.fields.missing_column(rows.columns)):
            raise _bad(f"{rows.where(0)}: {problem}", len(rows))
        first, bad = "", 0
        for index, row in rows.scan():
            try:
                if isinstance(row, RecordError):
                    raise row
                record = self.fields.record(row, index)
            except RecordError as exc:
                bad += 1
                first = first or f"{rows.where(index)}: {exc}"
                continue
            if not bad:
                self._kept.put(index, record)
        if bad:
            raise _bad(first, bad)

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, cursor: int) -> PromptRecord:
        """The record at `cursor`: the same record again while it is kept, else built from its row."""
        index = self._map.index(cursor)
        record = self._kept.get(index)
        if record is None:
            try:
                record = self.fields.record(self.rows.row(index), index)
            except RecordError as exc:  # it was checked at opening: the file changed since
                where = self.rows.where(index)
                raise DatasetError(f"{where}: {exc} (changed since it was opened?)") from None
            self._kept.put(index, record)
        return record

    def describe(self) -> str:
        fields = self.fields
        raw = fields.answer_format == AnswerFormat.RAW
        answer = "" if raw else f", answer_format={fields.answer_format.value!r}"
        return (
            f"{self.rows.kind}({self.path}, {len(self)} prompts, prompt_key={fields.prompt_key!r}, "
            f"answer_key={fields.answer_key!r}{answer}, shuffle={self._map.shuffle})"
        )


def _bad(first: str, bad: int) -> DatasetError:
    more = f" (and {bad - 1} more bad records)" if bad > 1 else ""
    return DatasetError(first + more)
