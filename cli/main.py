"""The `april` command: one typer app whose commands compose the roles (docs/design.md section 9).

Thin by design: each command resolves the config, then calls a plain function of the role it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from april.config import Mode
from april.hf import TINY_MODEL
from cli.bench_cmd import bench_command
from cli.broker_cmd import run_broker
from cli.data_cmd import SAMPLE, data_app
from cli.keys_cmd import keys_app
from cli.options import AprilGroup, ConfigOpt, SetOpt, resolve_config
from cli.rollouts_cmd import rollouts_command
from cli.sft_cmd import sft_command, task_app
from cli.simulate_cmd import simulate_command
from cli.status_cmd import status_command

app = typer.Typer(
    cls=AprilGroup,  # user and usage errors: one line (cli.options)
    name="april",
    help="Active Partial Rollouts: RL for LLMs with over-provisioned, abortable, resumable rollouts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModeOpt = Annotated[Mode | None, typer.Option("--mode", help="sync | april | async (run.mode).")]
PartialOpt = Annotated[
    bool | None,
    typer.Option("--partial-rollout/--no-partial-rollout", help="slime flag: same as --mode april."),
]
RbsOpt = Annotated[int | None, typer.Option("--rollout-batch-size", help="Groups per training step.")]
OsbsOpt = Annotated[int | None, typer.Option("--over-sampling-batch-size", help="Groups in flight (april).")]
NspOpt = Annotated[int | None, typer.Option("--n-samples-per-prompt", help="Samples per group.")]


@app.command()
def broker(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory (state in RUN_DIR/broker/).")],
    config: ConfigOpt = None,
    bind_host: Annotated[str | None, typer.Option("--bind-host", help="Address to bind (127.0.0.1).")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Restore the state saved in RUN_DIR/broker/.")
    ] = False,
    mode: ModeOpt = None,
    partial_rollout: PartialOpt = None,
    rollout_batch_size: RbsOpt = None,
    over_sampling_batch_size: OsbsOpt = None,
    n_samples_per_prompt: NspOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run the broker: workers connect on 5555, the learner and `april status` on 5556, PUB on 5557."""
    cfg = resolve_config(
        config,
        set_,
        run__mode=mode,
        run__partial_rollout=partial_rollout,
        algo__rollout_batch_size=rollout_batch_size,
        algo__over_sampling_batch_size=over_sampling_batch_size,
        algo__n_samples_per_prompt=n_samples_per_prompt,
        broker__bind_host=bind_host,
    )
    run_broker(cfg, run_dir, resume)


@app.command()
def worker(
    broker_address: Annotated[str | None, typer.Option("--broker", help="Broker worker port.")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="torch | sglang | vllm | sim.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="HF model directory.")] = None,
    slots: Annotated[int | None, typer.Option("--slots", help="Concurrent generations.")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run a rollout worker: lease samples from the broker, generate, stream them back."""
    from cli.worker_cmd import run_worker

    cfg = resolve_config(
        config,
        set_,
        worker__broker=broker_address,
        worker__engine=engine,
        worker__model=model,
        worker__slots=slots,
    )
    run_worker(cfg)


@app.command()
def learner(
    run_dir: Annotated[
        Path, typer.Option("--run-dir", help="Run directory (metrics, weights, checkpoints).")
    ],
    broker_address: Annotated[str | None, typer.Option("--broker", help="The broker's learner port.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="HF model directory to train.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint.")] = False,
    steps: Annotated[int | None, typer.Option("--steps", help="Learner steps to train (run.steps).")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run the learner: exactly-N batches, the configured loss, weights published as v+1 each step."""
    from cli.learner_cmd import run_learner_process

    cfg = resolve_config(config, set_, learner__broker=broker_address, learner__model=model, run__steps=steps)
    code = run_learner_process(cfg, run_dir, resume)
    if code:
        raise typer.Exit(code)


@app.command()
def generate(
    prompts: Annotated[
        Path,
        typer.Option(
            "--prompts",
            help="Prompts (answer optional): JSONL, JSON, Parquet, Arrow or a save_to_disk directory.",
            exists=True,
        ),
    ],
    engine: Annotated[str | None, typer.Option("--engine", help="torch | sglang | vllm | sim.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="HF model directory.")] = None,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt.", min=1)] = 1,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", help="Budget per sample.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per sample.")] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run an engine on a prompt file without a broker and print every sample and tokens/s."""
    from cli.generate_cmd import generate as run_generate

    cfg = resolve_config(
        config, set_, worker__engine=engine, worker__model=model, algo__max_new_tokens=max_new_tokens
    )
    run_generate(cfg, prompts, n, as_json)


app.command("status")(status_command)
app.command("rollouts")(rollouts_command)
app.command("simulate")(simulate_command)
app.command("bench")(bench_command)
app.command("sft")(sft_command)
app.add_typer(task_app, name="task")
app.add_typer(keys_app, name="keys")
app.add_typer(data_app, name="data")


@data_app.command("inspect")
def data_inspect(
    source: Annotated[
        str | None, typer.Argument(help="Dataset path, synthetic or task (data.source; default: config's).")
    ] = None,
    model: Annotated[
        Path, typer.Option("--model", help="HF model directory whose tokenizer counts prompt tokens.")
    ] = TINY_MODEL,
    sample: Annotated[
        int, typer.Option("--sample", help="Records tokenized for the length percentiles (0: all).", min=0)
    ] = SAMPLE,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Records, fields, the first prompt as the model reads it, prompt token percentiles (data.* keys)."""
    from cli.data_cmd import inspect_dataset, render

    cfg = resolve_config(config, set_, data__source=source)
    print(render(inspect_dataset(cfg, model, sample)))


@app.command("openenv-gateway")
def openenv_gateway(
    bind: Annotated[str, typer.Option("--bind", help="Address to serve on (tcp://HOST:PORT).")],
    allow_remote: Annotated[
        bool, typer.Option("--allow-remote", help="Bind a non-loopback address (a private network).")
    ] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Hold the OpenEnv sessions of env.name's server for the workers (env.gateway = its address)."""
    from cli.openenv_cmd import run_gateway

    run_gateway(resolve_config(config, set_), bind, allow_remote)


@app.command()
def up(
    config: ConfigOpt = None,
    mode: ModeOpt = None,
    engine: Annotated[str | None, typer.Option("--engine", help="torch | sim | sglang | vllm.")] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            "-k",
            help="Rollout workers, one per engine (default: as the GPUs fit; 2 on CPU).",
            min=1,
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Learner steps (run.steps).", min=1)] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run directory (runs/<name>).")] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue the run in this directory.", file_okay=False)
    ] = None,
    headless: Annotated[
        bool,
        typer.Option(
            "--headless",
            help="One progress line per step instead of the dashboard (so too when stdout is no terminal).",
        ),
    ] = False,
    set_: SetOpt = None,
    screenshot: Annotated[
        Path | None, typer.Option("--screenshot", help="Save the dashboard as SVG one step before the end.")
    ] = None,
    plan: Annotated[
        bool, typer.Option("--plan", help="Print which GPUs each process would get, and exit.")
    ] = False,
    json_: Annotated[bool, typer.Option("--json", help="With --plan: the processes as JSON.")] = False,
    gpus: Annotated[
        int | None, typer.Option("--gpus", help="With --plan: plan for a node of this many GPUs.", min=0)
    ] = None,
) -> None:
    """Run broker, workers and learner with a live dashboard (default: built-in task, tiny model)."""
    from cli.up_cmd import UpOptions, run_up

    opts = UpOptions(
        config=config,
        mode=mode,
        engine=engine,
        workers=workers,
        steps=steps,
        run_dir=run_dir,
        resume=resume,
        headless=headless,
        sets=tuple(set_ or ()),
        screenshot=screenshot,
        plan=plan,
        json=json_,
        gpus=gpus,
    )
    raise typer.Exit(run_up(opts))


def main() -> None:
    app(prog_name="april")  # also when started as `python -c "from cli.main import main; main()"`
