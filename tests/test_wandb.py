"""The learner's wandb run, offline: `MetricsLog` with `learner.wandb_project` writes a real wandb run
under RUN_DIR/wandb (WANDB_MODE=offline) whose history, read back from wandb's own transaction log (the
.wandb file: LevelDB-style log blocks of wandb's protobuf `Record`s), holds every finite numeric field
of every metrics.jsonl line at its step, and whose config is the resolved config; a resume continues the
same wandb run without logging a step twice; `wandb sync` finds the offline run. Without the package
and with wandb_project set, the learner and `april up` stop at start-up with one line saying how to
install it; with wandb_project empty nothing imports wandb.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from april import protocol
from april.config import Config, ConfigError, LearnerConfig, config_to_dict
from april.ledger import Ledger
from april.records import FinishReason, Sample
from april.wire_records import SampleBatch
from cli.main import app
from learner.metrics import MetricsLog, forget_steps_from, step_record
from learner.wandb_sink import STATE_FILE, check_wandb

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 120  # "did not hang": a subprocess that imports the CLI on a loaded machine


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real wandb, offline, with its settings and caches in the test's folder (not the home)."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    yield
    wandb.teardown()  # ends wandb's service process, so none outlives the test


def config(**learner: Any) -> Config:
    return Config(learner=dataclasses.replace(LearnerConfig(), wandb_project="april-test", **learner))


def record(step: int, loss: float, evaluated: bool) -> dict[str, Any]:
    samples = [
        Sample(group_id=g, index=i, prompt_ids=np.array([5, 6], np.int32))
        .extend([7] * (2 + i + step), [-0.5] * (2 + i + step), 0, FinishReason.STOP)
        .scored(float(i))
        for g in range(2)
        for i in range(2)
    ]
    ledger = Ledger(
        issued=2 + step, trained=step, complete_waiting=2, in_flight=0, partial=0, dropped={"failed": step}
    )
    stats = {"aborted": float(step), "eval_accuracy": 0.25 * step, "eval_version": float(step)}
    wire = SampleBatch.from_samples(samples)
    batch = protocol.Batch(step, step, 0, wire, stats if evaluated else {}, ledger)
    return step_record(
        step=step,
        version=step + 1,
        mode="april",
        batch=batch,
        step_time_s=2.0 + step,
        learner_time_s=1.0,
        weight_sync_s=0.1,
        train={"loss": loss, "clip_frac": 0.5 / (step + 1)},
    )


def expected_fields(line: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The reference: every finite number of a metrics line but step and time, nested names joined by /."""
    out: dict[str, Any] = {}
    for key, value in line.items():
        if prefix == "" and key in ("step", "time"):
            continue
        if isinstance(value, dict):
            out.update(expected_fields(value, f"{prefix}{key}/"))
        elif type(value) in (int, float) and math.isfinite(value):
            out[prefix + key] = value
    return out


# ------------------------------------------------------------ wandb's transaction log, read back

BLOCK = 32768  # the log is written in 32 KiB blocks; a record never straddles a block header
HEADER = struct.Struct("<IHB")  # CRC-32 of type byte + data, data length, chunk type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """Every protobuf Record in a .wandb file, checksums verified."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]  # the file header: ident, magic, version (7 bytes)
    pos, pending = 7, b""
    while pos + HEADER.size <= len(data):
        if BLOCK - pos % BLOCK < HEADER.size:  # no room for a chunk header: the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = HEADER.unpack_from(data, pos)
        if crc == length == kind == 0:
            break
        chunk = data[pos + HEADER.size : pos + HEADER.size + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos} of {path}"
        pos += HEADER.size + length
        pending += chunk
        if kind in (FULL, LAST):
            message = wandb_internal_pb2.Record()
            message.ParseFromString(pending)
            pending = b""
            yield message


def history(path: Path) -> dict[int, dict[str, Any]]:
    """{step: {key: value}} of a .wandb file's history rows, wandb's own keys (_step, _runtime) left out."""
    rows: dict[int, dict[str, Any]] = {}
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            assert r.history.step.num not in rows, f"step {r.history.step.num} logged twice in {path}"
            rows[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def run_config(path: Path) -> dict[str, Any]:
    """The config a .wandb file's run record carries, wandb's own `_wandb` entry left out."""
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "run":
            return {u.key: json.loads(u.value_json) for u in r.run.config.update if u.key != "_wandb"}
    raise AssertionError(f"no run record in {path}")


def offline_files(run_dir: Path) -> list[Path]:
    """The offline runs' .wandb files under RUN_DIR/wandb, in the order they were started."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


# ---------------------------------------------------------------------------------------- tests


@pytest.mark.usefixtures("offline")
def test_offline_run_holds_every_metrics_line_and_the_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = config(wandb_group="g", wandb_tags="smoke, offline")
    log = MetricsLog(run_dir / "metrics.jsonl", config=cfg)
    for step in range(3):
        log.append(record(step, loss=0.5 - 0.1 * step, evaluated=step > 0))
    log.close()

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (wandb_file,) = offline_files(run_dir)
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert wandb_file.name == f"run-{state['id']}.wandb" and state["logged_through"] == 2

    logged = history(wandb_file)
    assert logged == {line["step"]: expected_fields(line) for line in lines}
    # the figures a user looks for, under their metrics.jsonl names: loss, the ledger, the learner's own
    assert [logged[s]["loss"] for s in range(3)] == [0.5, 0.4, 0.3]
    assert logged[2]["ledger/dropped/failed"] == 2 and logged[2]["ledger/trained"] == 2
    assert logged[1]["learner/clip_frac"] == 0.25 and logged[2]["eval_accuracy"] == 0.5
    assert "eval_accuracy" not in logged[0]  # NaN before the first evaluation: left out, as in TensorBoard
    assert run_config(wandb_file) == config_to_dict(cfg)

    dry = subprocess.run(
        [sys.executable, "-m", "wandb", "sync", "--dry-run", str(run_dir / "wandb")],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert dry.returncode == 0 and "Would sync 1 run(s)" in dry.stdout + dry.stderr, dry.stdout + dry.stderr


@pytest.mark.usefixtures("offline")
def test_a_run_of_april_up_logs_every_step_to_wandb(tmp_path: Path) -> None:
    """The whole path: `april up` (sim engine, the learner loop with the simulated trainer) with
    learner.wandb_project set leaves one offline wandb run holding every metrics.jsonl line."""
    run_dir = tmp_path / "r"
    sets = ["worker.engine=sim", "learner.backend=sim", "learner.sim_step_s=0", "learner.wandb_project=e2e"]
    args = ["up", "--headless", "--steps", "2", "--workers", "1", "--run-dir", str(run_dir)]
    done = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", *args, *(f"--set={x}" for x in sets)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S * 3,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (wandb_file,) = offline_files(run_dir)
    assert [line["step"] for line in lines] == [0, 1]
    logged = history(wandb_file)
    # each step's few samples, a wandb table logged with its line (wandb keeps its fields under the name)
    table = "rollouts/samples/"
    assert all(logged[s][table + "_type"] == "table-file" and logged[s][table + "nrows"] > 0 for s in (0, 1))
    metrics = {s: {k: v for k, v in row.items() if not k.startswith(table)} for s, row in logged.items()}
    assert metrics == {line["step"]: expected_fields(line) for line in lines}


@pytest.mark.usefixtures("offline")
def test_resume_continues_the_run_and_logs_no_step_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    cfg = config()
    first = MetricsLog(metrics, config=cfg)
    for step in range(4):
        first.append(record(step, loss=1.0 + step, evaluated=True))
    first.close()

    # the learner crashed after step 3 and resumes from its checkpoint at step 2: steps 2 and 3 again
    forget_steps_from(metrics, 2)
    with caplog.at_level(logging.WARNING, logger="april.learner"):
        resumed = MetricsLog(metrics, config=cfg)
    assert "already holds steps 2-3" in caplog.text
    for step in range(2, 5):
        resumed.append(record(step, loss=2.0 + step, evaluated=True))
    resumed.close()

    before, after = offline_files(run_dir)
    run_id = json.loads((run_dir / STATE_FILE).read_text())["id"]
    assert before.name == after.name == f"run-{run_id}.wandb"  # one wandb run, `wandb sync` joins the two
    first_part, second_part = history(before), history(after)
    assert sorted(first_part) == [0, 1, 2, 3] and sorted(second_part) == [4]
    assert [first_part[s]["loss"] for s in range(4)] == [1.0, 2.0, 3.0, 4.0] and second_part[4]["loss"] == 6.0
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [(x["step"], x["loss"]) for x in lines] == [(0, 1.0), (1, 2.0), (2, 4.0), (3, 5.0), (4, 6.0)]
    assert second_part[4] == expected_fields(lines[-1])


def test_without_wandb_metrics_log_and_the_check_say_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"learner\.wandb_project = 'april-test'.*pip install wandb"):
        check_wandb(config().learner)
    with pytest.raises(ConfigError, match=r"pip install wandb") as raised:
        MetricsLog(tmp_path / "metrics.jsonl", config=config())
    assert "\n" not in str(raised.value)
    check_wandb(LearnerConfig())  # no project: nothing asked of wandb
    MetricsLog(tmp_path / "metrics.jsonl", config=Config()).close()


def test_april_up_without_wandb_stops_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    sets = ["worker.engine=sim", "learner.backend=sim", "learner.wandb_project=april-test"]
    args = ["up", "--headless", "--run-dir", str(tmp_path / "r"), *(f"--set={s}" for s in sets)]
    result = CliRunner().invoke(app, args)
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("april: error: learner.wandb_project") and "pip install wandb" in lines[0]
    assert not (tmp_path / "r" / "logs").exists()  # no child was started


BLOCKED = textwrap.dedent(
    """
    import sys
    from importlib.abc import MetaPathFinder

    class NoWandb(MetaPathFinder):  # wandb absent, whatever this machine has installed
        def find_spec(self, name, path=None, target=None):
            if name == "wandb" or name.startswith("wandb."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoWandb())
    from cli.main import main
    sys.argv = ["april", *sys.argv[1:]]
    main()
    """
)


def test_the_learner_process_without_wandb_prints_one_line(tmp_path: Path) -> None:
    args = ["learner", "--run-dir", str(tmp_path / "run"), "--set=learner.backend=sim"]
    args += ["--set=learner.wandb_project=april-test", "--broker=tcp://127.0.0.1:9"]  # never reached
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED, *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("april: error: learner.wandb_project = 'april-test' needs the wandb package")
    assert "pip install wandb" in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped at start-up, before any step


def test_no_wandb_project_imports_nothing_of_wandb(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from april.config import Config
        from learner.metrics import MetricsLog
        from learner.wandb_sink import check_wandb
        from test_wandb import record

        config = Config()
        check_wandb(config.learner)
        log = MetricsLog(Path({str(tmp_path)!r}) / "metrics.jsonl", config=config)
        log.append(record(0, loss=0.5, evaluated=True))
        log.close()
        print(sorted(m for m in sys.modules if m == "wandb" or m.startswith("wandb.")))
        """
    )
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, env=env, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
