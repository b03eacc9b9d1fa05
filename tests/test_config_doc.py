"""docs/configuration.md is the fresh rendering of the config dataclasses, and every field is described."""

from dataclasses import fields
from pathlib import Path

from april import config
from april.config_doc import REGENERATE, field_comments, field_docs, render

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_committed_reference_is_up_to_date() -> None:
    fresh = render()
    committed = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert committed == fresh, f"docs/configuration.md is out of date with april/config.py; run: {REGENERATE}"


def test_every_field_has_a_description() -> None:
    missing = [f"{r.section}.{r.key}" for r in field_docs() if not r.description]
    assert not missing, (
        f"config fields without a description: {', '.join(missing)}; "
        "add a trailing `# comment` to each in april/config.py, then run: " + REGENERATE
    )


def test_every_section_and_field_is_in_the_reference() -> None:
    page = render()
    for section in fields(config.Config):
        assert f"## `[{section.name}]`" in page
        for f in fields(section.default_factory()):  # type: ignore[misc]
            assert f"| `{f.name}` |" in page
            assert f"`APRIL_{section.name.upper()}_{f.name.upper()}`" in page


def test_rows_carry_types_defaults_and_env_vars() -> None:
    rows = {(r.section, r.key): r for r in field_docs()}
    assert rows[("algo", "rollout_batch_size")].type == "`int`"
    assert rows[("algo", "rollout_batch_size")].default == "8"
    assert rows[("run", "mode")].type == '`"sync"` \\| `"april"` \\| `"async"`'
    assert rows[("run", "mode")].default == '"april"'
    assert rows[("data", "shuffle")].default == "true"
    assert rows[("worker", "broker")].default == '"tcp://127.0.0.1:5555"'
    assert rows[("broker", "worker_port")].env_var == "APRIL_BROKER_WORKER_PORT"


def test_comments_are_read_per_class_and_field() -> None:
    source = (
        "class A:\n"
        "    x: int = 1  # the x\n"
        "    y: str = (  # spans\n"
        '        "v"\n'
        "    )  # lines\n"
        "    z: bool = True\n"
        "    # a comment line, not a field\n"
        "\n"
        "class B:\n"
        "    x: int = 2  # B's x\n"
    )
    assert field_comments(source) == {
        "A": {"x": "the x", "y": "spans lines", "z": ""},
        "B": {"x": "B's x"},
    }
