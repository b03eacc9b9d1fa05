"""`april rollouts RUN_DIR`: a run's rollout records in the terminal (the files: docs/rollouts.md).

Without options, the steps (and evaluations) listed with their figures; with `--step`, `--eval` or a
filter, the samples that match, sorted (`--sort`: lowest or highest reward, longest, most aborted) and
cut to `--limit`; with `--sample GROUP/INDEX`, that sample's transcript: the prompt as the model read
it, then its response piece by piece, model tokens and observations told apart, each model piece headed
by its policy version and worker, and a mark where each abort cut it. `--json` prints the same
selection as JSON, for scripts.

`rollouts_command` is the typer command (`cli/main.py` registers it); the work is plain functions (`load`,
`select`, `find_sample`) and pure renderers (`render_steps`, `render_samples`, `render_transcript`, tested
on a capture console). Reads with pyarrow only.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from april.rollouts import MODEL, ROLLOUTS_DIR, eval_versions, read_tables, train_steps
from cli.options import UserError

SORTS = {  # --sort: (column, largest first)
    "lowest-reward": ("reward", False),
    "highest-reward": ("reward", True),
    "longest": ("response_tokens", True),
    "most-aborted": ("aborts", True),
}
LISTED = (  # the columns a listing reads (not the token ids, not the pieces)
    "group_id", "sample_index", "reward", "response_tokens", "model_tokens", "turns", "aborts", "resumes",
    "staleness", "status", "finish_reason", "error", "prompt_text", "prompt_rendered", "response_text",
)  # fmt: skip
TRAIN_LISTED = ("step", "advantage", *LISTED)
EVAL_LISTED = ("eval_version", *LISTED)
SNIPPET = 60  # characters of prompt text in a listing
CUT = "✂ abort"  # where an abort cut the response


class RolloutsError(UserError):
    """The records asked for are not there."""


def numbered_files(run_dir: Path, evaluation: bool) -> dict[int, Path]:
    """The step files (or evaluation files) of `run_dir`; a one-line error when the run has none."""
    if not run_dir.is_dir():
        raise RolloutsError(f"RUN_DIR {str(run_dir)!r} does not exist")
    files = eval_versions(run_dir) if evaluation else train_steps(run_dir)
    if not files:
        kind = "evaluation" if evaluation else "step"
        where = run_dir / ROLLOUTS_DIR / ("eval" if evaluation else "train")
        raise RolloutsError(
            f"no {kind} records in {str(where)!r} (run.rollout_records off, or none trained or evaluated yet)"
        )
    return files


def load(
    run_dir: Path, evaluation: bool, number: int | None, columns: Sequence[str] | None
) -> list[dict[str, Any]]:
    """The rows of one step (or evaluation) `number`, or of all of them, with `columns` (None: all)."""
    files = numbered_files(run_dir, evaluation)
    if number is not None:
        if number not in files:
            option, have = ("--eval", "versions") if evaluation else ("--step", "steps")
            raise RolloutsError(f"{option} {number}: no such records ({have} {_ranges(list(files))})")
        files = {number: files[number]}
    return [row for table in read_tables(list(files.values()), columns) for row in table.to_pylist()]


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for n in numbers:
        if out and n == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def select(
    rows: list[dict[str, Any]], sort: str | None, errors: bool, grep: str | None, limit: int
) -> list[dict[str, Any]]:
    """The rows that match (`errors`: with an error; `grep`: prompt text containing it, any case),
    sorted by `sort` (a key of `SORTS`; NaN last), at most `limit`."""
    if errors:
        rows = [r for r in rows if r["error"]]
    if grep:
        needle = grep.lower()
        rows = [
            r for r in rows if needle in r["prompt_text"].lower() or needle in r["prompt_rendered"].lower()
        ]
    if sort is not None:
        column, largest = SORTS[sort]

        def key(row: dict[str, Any]) -> tuple[bool, float]:
            value = float(row[column])
            return math.isnan(value), -value if largest else value

        rows = sorted(rows, key=key)
    return rows[:limit]


def parse_sample(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if match is None:
        raise RolloutsError(f"--sample {text!r}: expected GROUP/INDEX, e.g. 17/2")
    return int(match.group(1)), int(match.group(2))


def find_sample(run_dir: Path, evaluation: bool, number: int | None, key: tuple[int, int]) -> dict[str, Any]:
    """The whole row of sample `key` (group id, index): in step (or evaluation) `number`, or the first
    file that holds it (a group id is trained once in a run)."""
    files = numbered_files(run_dir, evaluation)
    if number is not None:
        load(run_dir, evaluation, number, ("group_id",))  # a one-line error for a missing number
        files = {number: files[number]}
    for path in files.values():
        (table,) = read_tables([path], ("group_id", "sample_index"))
        groups, indices = table.column("group_id").to_pylist(), table.column("sample_index").to_pylist()
        for i, found in enumerate(zip(groups, indices, strict=True)):
            if found == key:
                (whole,) = read_tables([path])
                row: dict[str, Any] = whole.slice(i, 1).to_pylist()[0]
                return row
    where = f" in {'evaluation' if evaluation else 'step'} {number}" if number is not None else ""
    raise RolloutsError(f"--sample {key[0]}/{key[1]}: no such sample{where}")


# ---------------------------------------------------------------------------------------------- views


def step_summaries(rows: list[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    """Per step (or evaluation, `by` its column): samples, mean reward, accuracy (reward > 0), mean
    response tokens, samples aborted at least once, samples with an error."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(int(row[by]), []).append(row)
    out = []
    for number, members in grouped.items():
        rewards = [r["reward"] for r in members if not math.isnan(r["reward"])]
        out.append(
            {
                by: number,
                "samples": len(members),
                "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
                "accuracy": sum(1 for x in rewards if x > 0) / len(members),
                "response_tokens_mean": sum(r["response_tokens"] for r in members) / len(members),
                "aborted": sum(1 for r in members if r["aborts"]),
                "errors": sum(1 for r in members if r["error"]),
            }
        )
    return out


def _num(value: float | None, form: str = ".3f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, form)


def render_steps(steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Group:
    parts: list[RenderableType] = []
    for rows, by, title in ((steps, "step", "steps"), (evals, "eval_version", "evaluations")):
        if not rows:
            continue
        table = Table(
            by.replace("_", " "), "samples", "reward", "accuracy", "tokens", "aborted", "errors", title=title
        )
        for r in rows:
            table.add_row(
                str(r[by]), str(r["samples"]), _num(r["reward_mean"]), _num(r["accuracy"]),
                f"{r['response_tokens_mean']:.1f}", str(r["aborted"]), str(r["errors"]),
            )  # fmt: skip
        parts.append(table)
    return Group(*parts)


def render_samples(rows: list[dict[str, Any]], evaluation: bool, width: int = 80) -> Table:
    """The samples, one line each: the figures whole, the prompt cut to what `width` leaves."""
    by = "eval_version" if evaluation else "step"
    headers = ["eval" if evaluation else "step", "sample", "reward", *([] if evaluation else ["adv"])]
    headers += ["tokens", "turns", "aborts", "stale", "finish"]
    cells, prompts = [], []
    for r in rows:
        finish = r["finish_reason"] if r["status"] == "finished" else f"{r['status']}: {r['error'][:40]}"
        cells.append(
            [str(r[by]), f"{r['group_id']}/{r['sample_index']}", _num(r["reward"]),
             *([] if evaluation else [_num(r["advantage"])]), str(r["response_tokens"]), str(r["turns"]),
             str(r["aborts"]), str(r["staleness"]), finish]
        )  # fmt: skip
        prompts.append(" ".join((r["prompt_text"] or r["prompt_rendered"]).split())[:SNIPPET])
    table = Table(title=f"{len(rows)} samples", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    widths = [max([len(header)] + [len(c[k]) for c in cells]) for k, header in enumerate(headers)]
    for header, w in zip(headers, widths, strict=True):
        table.add_column(header, no_wrap=True, width=w)
    left = width - sum(widths) - 2 * len(widths) - 2  # a column's padding is 2, collapsed
    table.add_column("prompt", no_wrap=True, overflow="ellipsis", width=max(8, min(left, SNIPPET)))
    for figures, prompt in zip(cells, prompts, strict=True):
        table.add_row(*(Text(c) for c in figures), Text(prompt))  # Text, not markup: text from the data
    return table


def render_transcript(row: dict[str, Any]) -> Group:
    """One sample: a header line, its prompt as the model read it, then its response piece by piece."""
    where = f"eval v{row['eval_version']}" if "eval_version" in row else f"step {row['step']}"
    figures = [f"reward {_num(row['reward'])}"]
    if "advantage" in row:
        figures += [
            f"advantage {_num(row['advantage'])}",
            f"log-prob {_num(row['behaviour_logprob_mean'])} (engine) / {_num(row['learner_logprob_mean'])} "
            f"(learner)",
            f"max ratio {_num(row['ratio_max'], '.3g')}",
        ]
    head = Text.assemble(
        (f"{where} · sample {row['group_id']}/{row['sample_index']}", "bold"),
        f" · {row['status']} ({row['finish_reason']}) · aborted {row['aborts']}, resumed {row['resumes']}"
        f" · staleness {row['staleness']} · {row['response_tokens']} tokens, turns {row['turns']}\n",
        " · ".join(figures),
    )
    source = Text(f"source {row['source']}, record {row['prompt_index']}", "dim")
    prompt = Text(row["prompt_rendered"] or row["prompt_text"] or _ids(row["prompt_ids"]), "dim")
    parts: list[RenderableType] = [head, source, Text("prompt", "bold underline"), prompt]
    parts += [Text("response", "bold underline"), _response(row)]
    if row["error"]:
        parts.append(Text(f"error: {row['error']}", "bold red"))
    return Group(*parts)


def _response(row: dict[str, Any]) -> Text:
    """Model pieces headed `[vN worker]` when version or worker changes, observations marked, a cut mark
    where each abort fell (a cut at the very start: an abort before any token)."""
    out = Text()
    cuts = list(row["abort_cuts"])
    last: tuple[int, str] | None = None
    out.append(f"{CUT} " * cuts.count(0), "bold red")
    for piece in row["pieces"]:
        text = piece["text"] or _ids(row["response_ids"][piece["start"] : piece["end"]])
        if piece["kind"] == MODEL:
            if last != (piece["version"], piece["worker"]):
                out.append(f"[v{piece['version']} {piece['worker']}] ", "dim cyan")
                last = (piece["version"], piece["worker"])
            out.append(text, "green")
        else:  # on lines of its own
            out.append("\n[observation] ", "dim magenta")
            out.append(text.rstrip("\n"), "magenta")
            out.append("\n")
            last = None
        for _ in range(cuts.count(piece["end"])):
            out.append(f" {CUT} ", "bold red")
            last = None
    return out


def as_json_text(value: Any) -> str:
    """Strict JSON (NaN, a figure the record lacks, as null), one line."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(value), ensure_ascii=False, allow_nan=False)


def _ids(ids: Sequence[int]) -> str:
    return "ids " + " ".join(map(str, ids))


# ---------------------------------------------------------------------------------------------- command


def rollouts_command(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (its rollouts/ folder is read).")],
    step: Annotated[int | None, typer.Option("--step", help="Samples of this learner step.", min=0)] = None,
    eval_version: Annotated[
        int | None, typer.Option("--eval", help="Samples of the evaluation at this version.", min=0)
    ] = None,
    sample: Annotated[
        str | None, typer.Option("--sample", help="Show this sample's transcript: GROUP/INDEX.")
    ] = None,
    sort: Annotated[
        str | None,
        typer.Option("--sort", help="lowest-reward | highest-reward | longest | most-aborted."),
    ] = None,
    errors: Annotated[bool, typer.Option("--errors", help="Only samples with an error.")] = False,
    grep: Annotated[str | None, typer.Option("--grep", help="Only prompts containing this text.")] = None,
    limit: Annotated[int, typer.Option("--limit", help="Samples listed at most.", min=1)] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of tables.")] = False,
) -> None:
    """Show what a run trained on: steps, samples (filtered, sorted) and one sample's transcript."""
    if sort is not None and sort not in SORTS:
        raise RolloutsError(f"--sort {sort!r}: expected one of {', '.join(SORTS)}")
    if step is not None and eval_version is not None:
        raise RolloutsError("--step and --eval: give one of them")
    evaluation = eval_version is not None
    number = eval_version if evaluation else step
    console = Console(soft_wrap=False)
    if sample is not None:
        row = find_sample(run_dir, evaluation, number, parse_sample(sample))
        if as_json:
            print(as_json_text(row))
        else:
            console.print(render_transcript(row))
        return
    if number is None and sort is None and not errors and not grep:
        steps = step_summaries(load(run_dir, False, None, ("step", *LISTED)), "step")
        has_evals = bool(eval_versions(run_dir))
        evals = (
            step_summaries(load(run_dir, True, None, ("eval_version", *LISTED)), "eval_version")
            if has_evals
            else []
        )
        if as_json:
            print(as_json_text({"steps": steps, "evaluations": evals}))
        else:
            console.print(render_steps(steps, evals))
        return
    rows = select(
        load(run_dir, evaluation, number, EVAL_LISTED if evaluation else TRAIN_LISTED),
        sort,
        errors,
        grep,
        limit,
    )
    if as_json:
        print(as_json_text(rows))
    else:
        console.print(render_samples(rows, evaluation, console.width))
