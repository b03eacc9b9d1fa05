"""Rollout records: every trained sample and every evaluation's generations, as Parquet files under
`RUN_DIR/rollouts/` (the contract: docs/rollouts.md).

Owns the files' names (`train/step_NNNNNNNN.parquet`, one per learner step; `eval/vNNNNNN.parquet`, one
per evaluation), their columns (`TRAIN_SCHEMA`, `EVAL_SCHEMA`), the rows made of samples (`rows`: each
response cut into pieces of model tokens and observations, split where a lease ended, each piece with
its policy version, worker and text), the text decoder (`open_decoder`: the tokenizer the workers
tokenize with) and reading the files back. The learner writes the step files
(`learner.step_records`), the broker the evaluation files (`broker.eval_records`), both through
`april.rollout_writer`, which keeps the writing off their loops.

Knows nothing of sockets, torch or the tokenizer's model: decoding is `tokenizers` on tokenizer.json.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from april.records import SETTLED, FinishReason, Sample, SampleStatus
from april.sim.byte_tokenizer import ByteTokenizer

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("april.rollouts")

ROLLOUTS_DIR = "rollouts"
TRAIN_DIR, EVAL_DIR = "train", "eval"
STEP_FILE = re.compile(r"step_(\d{8})\.parquet")
EVAL_FILE = re.compile(r"v(\d{6,})\.parquet")
MODEL, OBSERVATION = "model", "observation"  # the kinds of a piece

Decode = Callable[[Sequence[npt.NDArray[np.int32]]], list[str]]  # token ids -> text, many at once


@functools.cache
def schemas() -> tuple[pa.Schema, pa.Schema]:
    """The train and evaluation files' schemas (built at first use: importing this module needs no
    pyarrow, so a Python without it runs every role with the records off)."""
    import pyarrow as pa

    piece = pa.struct(
        [
            ("kind", pa.string()),  # "model" (generated, trained on) or "observation" (the environment's)
            ("start", pa.int32()),  # response tokens [start, end)
            ("end", pa.int32()),
            ("version", pa.int32()),  # the policy version that generated it; -1 for an observation
            ("worker", pa.string()),  # the worker whose lease produced it
            ("text", pa.string()),
        ]
    )
    sample = [
        ("group_id", pa.int64()),
        ("sample_index", pa.int32()),
        ("source", pa.string()),
        ("prompt_index", pa.int64()),
        ("answer", pa.string()),
        ("metadata", pa.string()),
        ("prompt_text", pa.string()),
        ("prompt_rendered", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_text", pa.string()),
        ("response_ids", pa.list_(pa.int32())),
        ("response_tokens", pa.int32()),
        ("model_tokens", pa.int32()),
        ("turns", pa.int32()),
        ("pieces", pa.list_(piece)),
        ("abort_cuts", pa.list_(pa.int32())),
        ("aborts", pa.int32()),
        ("resumes", pa.int32()),
        ("staleness", pa.int32()),
        ("oldest_version", pa.int32()),
        ("newest_version", pa.int32()),
        ("status", pa.string()),
        ("finish_reason", pa.string()),
        ("reward", pa.float64()),
        ("behaviour_logprob_mean", pa.float64()),
        ("error", pa.string()),
    ]
    learner = [
        ("advantage", pa.float64()),
        ("learner_logprob_mean", pa.float64()),
        ("ratio_max", pa.float64()),
    ]
    head = [("step", pa.int64()), ("learner_version", pa.int64()), ("batch_id", pa.int64())]
    return pa.schema([*head, *sample, *learner]), pa.schema([("eval_version", pa.int64()), *sample])


NO_FIGURES = (math.nan, math.nan, math.nan)  # (advantage, learner mean log-prob, largest ratio)


def train_dir(run_dir: Path) -> Path:
    return run_dir / ROLLOUTS_DIR / TRAIN_DIR


def eval_dir(run_dir: Path) -> Path:
    return run_dir / ROLLOUTS_DIR / EVAL_DIR


def step_file(step: int) -> str:
    return f"step_{step:08d}.parquet"


def eval_file(version: int) -> str:
    return f"v{version:06d}.parquet"


# ---------------------------------------------------------------------------------------------- decoding


def open_decoder(worker_model: str, learner_model: str) -> Decode | None:
    """Text from token ids as the workers tokenize: the byte tokenizer when `worker.model` is empty,
    else the tokenizer.json of `worker.model` (or, on a host that lacks it, `learner.model`), special
    tokens kept. None (said once, here) when there is none to read or the `tokenizers` package is
    missing: the records then keep ids only."""
    if not worker_model:
        byte = ByteTokenizer()
        return lambda many: [byte.decode(ids) for ids in many]
    for model in (worker_model, learner_model):
        path = Path(model) / "tokenizer.json" if model else None
        if path is None or not path.is_file():
            continue
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            log.warning("rollout records keep token ids only: %s (pip install tokenizers)", exc)
            return None
        tok = Tokenizer.from_file(str(path))
        return lambda many: list(tok.decode_batch([ids.tolist() for ids in many], skip_special_tokens=False))
    log.warning(
        "rollout records keep token ids only: no tokenizer.json in %r or %r", worker_model, learner_model
    )
    return None


# ---------------------------------------------------------------------------------------------- rows


@dataclass(frozen=True, slots=True)
class Piece:
    """Response tokens [start, end) of one kind, from one lease (and, for model tokens, one version)."""

    kind: str
    start: int
    end: int
    version: int
    worker: str


def pieces(sample: Sample) -> list[Piece]:
    """The response as its segments and observations in order of position, each split where a lease
    ended inside it; a piece's worker is the one whose lease returned its tokens ("" when unknown)."""
    spans = sorted(
        [(s.start, s.end, MODEL, s.version) for s in sample.segments]
        + [(o.start, o.end, OBSERVATION, -1) for o in sample.observations]
    )
    ends = [lease.end for lease in sample.leases]
    out = []
    for start, end, kind, version in spans:
        cuts = sorted({e for e in ends if start < e < end})
        for a, b in zip([start, *cuts], [*cuts, end], strict=True):
            out.append(Piece(kind, a, b, version, _worker_at(sample, b)))
    return out


def _worker_at(sample: Sample, end: int) -> str:
    """The worker of the first lease that ended at or after `end` (it produced the tokens before it)."""
    for lease in sample.leases:
        if lease.end >= end:
            return lease.worker
    return ""


def abort_cuts(sample: Sample) -> list[int]:
    """Where each interruption fell: the end of every lease span but a settled sample's last."""
    ends = [lease.end for lease in sample.leases]
    return ends[:-1] if sample.status in SETTLED else ends


@dataclass(frozen=True, slots=True)
class Context:
    """What a row needs beyond its sample: the data source, the version staleness is measured against,
    and the decoder (None: no text)."""

    source: str
    version: int
    decode: Decode | None


def rows(
    samples: Sequence[Sample],
    context: Context,
    figures: Callable[[Sample], tuple[float, float, float]] | None = None,
) -> list[dict[str, Any]]:
    """One row of `SAMPLE_FIELDS` (and, with `figures`, `LEARNER_FIELDS`) per sample."""
    cut = [pieces(s) for s in samples]
    texts = _decoded(samples, cut, context.decode)
    out = []
    for s, ps, (prompt, response, piece_texts) in zip(samples, cut, texts, strict=True):
        versions = [seg.version for seg in s.segments]
        beh = [s.response_logprobs[seg.start : seg.end] for seg in s.segments]
        model_lps = np.concatenate(beh) if beh else np.zeros(0, np.float32)
        kinds = [p.kind for p in ps]
        row: dict[str, Any] = {
            "group_id": s.group_id,
            "sample_index": s.index,
            "source": context.source,
            "prompt_index": _int(s.metadata.get("prompt_index", ""), -1),
            "answer": s.metadata.get("answer", ""),
            "metadata": json.dumps(s.metadata, ensure_ascii=False, sort_keys=True),
            "prompt_text": s.prompt_text,
            "prompt_rendered": prompt,
            "prompt_ids": s.prompt_ids.tolist(),
            "response_text": response,
            "response_ids": s.response_ids.tolist(),
            "response_tokens": s.response_len,
            "model_tokens": s.model_tokens,
            "turns": sum(1 for i, k in enumerate(kinds) if k == MODEL and (i == 0 or kinds[i - 1] != MODEL)),
            "pieces": [
                {
                    "kind": p.kind,
                    "start": p.start,
                    "end": p.end,
                    "version": p.version,
                    "worker": p.worker,
                    "text": text,
                }
                for p, text in zip(ps, piece_texts, strict=True)
            ],
            "abort_cuts": abort_cuts(s),
            "aborts": len(abort_cuts(s)),
            "resumes": s.resumes,
            "staleness": s.staleness(context.version),
            "oldest_version": min(versions, default=-1),
            "newest_version": max(versions, default=-1),
            "status": SampleStatus(s.status).name.lower(),
            "finish_reason": FinishReason(s.finish_reason).name.lower(),
            "reward": float(s.reward),
            "behaviour_logprob_mean": float(model_lps.mean(dtype=np.float64)) if model_lps.size else math.nan,
            "error": s.error,
        }
        if figures is not None:
            advantage, logprob_mean, ratio = figures(s)
            row.update(advantage=advantage, learner_logprob_mean=logprob_mean, ratio_max=ratio)
        out.append(row)
    return out


def _decoded(
    samples: Sequence[Sample], cut: Sequence[list[Piece]], decode: Decode | None
) -> list[tuple[str, str, list[str]]]:
    """(rendered prompt, response text, each piece's text) per sample: one decoder call for them all."""
    if decode is None:
        return [("", "", [""] * len(ps)) for ps in cut]
    wanted: list[npt.NDArray[np.int32]] = []
    for s, ps in zip(samples, cut, strict=True):
        wanted += [s.prompt_ids, s.response_ids, *(s.response_ids[p.start : p.end] for p in ps)]
    texts = iter(decode(wanted))
    return [(next(texts), next(texts), [next(texts) for _ in ps]) for ps in cut]


def _int(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def train_table(
    step: int,
    learner_version: int,
    batch_id: int,
    samples: Sequence[Sample],
    context: Context,
    figures: dict[tuple[int, int], tuple[float, float, float]] | None,
) -> pa.Table:
    """The records of one learner step (`TRAIN_SCHEMA`); `figures` by sample key (None: NaN)."""
    found = figures or {}
    made = rows(samples, context, lambda s: found.get(s.key, NO_FIGURES))
    head = {"step": step, "learner_version": learner_version, "batch_id": batch_id}
    import pyarrow as pa

    return pa.Table.from_pylist([{**head, **row} for row in made], schema=schemas()[0])


def eval_table(eval_version: int, samples: Sequence[Sample], context: Context) -> pa.Table:
    """The records of one evaluation (`EVAL_SCHEMA`), one row per held-out prompt."""
    made = rows(samples, context)
    import pyarrow as pa

    return pa.Table.from_pylist([{"eval_version": eval_version, **row} for row in made], schema=schemas()[1])


# ---------------------------------------------------------------------------------------------- reading


def numbered(directory: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    """The complete files of `directory` by their number (a temporary file of a write cut short by a
    crash starts with "." and is never one of them)."""
    if not directory.is_dir():
        return {}
    found = ((pattern.fullmatch(p.name), p) for p in directory.iterdir())
    return dict(sorted((int(m.group(1)), p) for m, p in found if m))


def train_steps(run_dir: Path) -> dict[int, Path]:
    return numbered(train_dir(run_dir), STEP_FILE)


def eval_versions(run_dir: Path) -> dict[int, Path]:
    return numbered(eval_dir(run_dir), EVAL_FILE)


def read_tables(paths: Sequence[Path], columns: Sequence[str] | None = None) -> Iterator[pa.Table]:
    """Each file's table (only `columns` when given), in order."""
    import pyarrow.parquet as pq

    for path in paths:
        yield pq.read_table(path, columns=list(columns) if columns is not None else None)
