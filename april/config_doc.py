"""The configuration reference (docs/configuration.md), rendered from the config dataclasses themselves.

Owns: reading each field's description from its trailing ``# comment`` in the source of april/config.py
(``tokenize`` for the comments, ``ast`` for which line belongs to which field of which class) and
rendering one Markdown table per section: key, type, default, description and the
``APRIL_<SECTION>_<KEY>`` environment variable. Keys, types and defaults come from the dataclasses, so
the page cannot drift from the code; a test compares the committed page with a fresh rendering.

Does not own: the config schema, its defaults or its validation (april/config.py), and it writes no
file: ``python -m april.config_doc > docs/configuration.md`` (``make docs``) regenerates the page.
"""

import ast
import enum
import inspect
import io
import re
import tokenize
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

from april import config

REGENERATE = "python -m april.config_doc > docs/configuration.md  (or: make docs)"

_INTRO = """\
# Configuration reference

<!-- Generated from the dataclasses in april/config.py by april/config_doc.py; do not edit by hand.
     Regenerate: {regenerate} -->

One TOML file with a table per section; every key is optional and unknown keys are errors. Later
sources override earlier ones:

1. the defaults below,
2. the TOML file given with `--config`,
3. `APRIL_<SECTION>_<KEY>` environment variables (booleans: `true/false`, `1/0`, `yes/no`, `on/off`),
4. command-line options: `--set section.key=value` and the few named flags of each command.

`[run]` also accepts `partial_rollout = true` (slime's `--partial-rollout`), which means `mode = "april"`.
The resolved configuration is saved as `config.toml` in the run directory.
"""


@dataclass(frozen=True, slots=True)
class FieldDoc:
    """One row of the reference: a config key and what is known about it."""

    section: str
    key: str
    type: str
    default: str
    description: str  # empty when the field has no trailing comment

    @property
    def env_var(self) -> str:
        return f"APRIL_{self.section}_{self.key}".upper()


def field_comments(source: str) -> dict[str, dict[str, str]]:
    """{class name: {field name: trailing comment text}} for the annotated fields of every class in source.

    A field's comment is the ``#`` comment on any line of its assignment (normally the only line).
    """
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        out[node.name] = {}
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                last = stmt.end_lineno or stmt.lineno
                lines = range(stmt.lineno, last + 1)
                text = " ".join(comments[n] for n in lines if n in comments)
                out[node.name][stmt.target.id] = text
    return out


def _type_name(typ: Any) -> str:
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        return " \\| ".join(f'`"{m.value}"`' for m in typ)
    return f"`{typ.__name__}`" if isinstance(typ, type) else f"`{typ}`"


def _toml(value: object) -> str:
    """A default as it would be written in the TOML file."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _default(f: Field[Any]) -> object:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise ValueError(f"config field {f.name!r} has no default; every config field needs one")


def field_docs() -> list[FieldDoc]:
    """Every config field in section order, then field order, with its description from the source."""
    comments = field_comments(inspect.getsource(config))
    rows: list[FieldDoc] = []
    defaults = config.Config()
    for section in fields(defaults):
        values: Any = getattr(defaults, section.name)  # the section's dataclass, at its defaults
        described = comments.get(type(values).__name__, {})
        for f in fields(values):
            rows.append(
                FieldDoc(
                    section=section.name,
                    key=f.name,
                    type=_type_name(f.type),
                    default=_toml(_default(f)),
                    description=described.get(f.name, ""),
                )
            )
    return rows


_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")


def _cell(text: str) -> str:
    """Markdown table cell text: a pipe would end the cell, and `<name>` would read as an HTML tag."""
    return _TAG_START.sub(r"\\<", text.replace("|", "\\|"))


def render() -> str:
    """The whole reference page as Markdown (ends with one newline)."""
    parts = [_INTRO.format(regenerate=REGENERATE)]
    rows = field_docs()
    for section in dict.fromkeys(r.section for r in rows):
        parts.append(f"\n## `[{section}]`\n\n")
        parts.append("| key | type | default | description | environment variable |\n")
        parts.append("|---|---|---|---|---|\n")
        for r in (r for r in rows if r.section == section):
            default = r.default.replace("|", "\\|")  # a pipe ends the cell even inside backticks
            parts.append(f"| `{r.key}` | {r.type} | `{default}` | {_cell(r.description)} | `{r.env_var}` |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(render(), end="")
