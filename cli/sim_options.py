"""The options `april simulate` and `april bench --engine sim` share: the simulated cluster's cost model
(decode step A + B x active sequences, prefill C per input token, learner step L, the engines' prefix
caches), the prompt length, the samples per group, the staleness bound, the resume options and the
modes. One declaration each, so the two commands cannot drift apart in meaning, help or default. The
step cost's defaults are `april.engine_cost.EngineCost`'s, the ones the sim engine of `april up --engine
sim` also starts from (a 4B model on one H100-class GPU per engine)."""

from __future__ import annotations

from typing import Annotated

import typer

from april.config import OverSampling, PromptOrder, ResumeKV
from april.engine_cost import DEFAULT_COST

COST = DEFAULT_COST  # the default step cost (A, B, C)
LEARNER_STEP_S = 20.0  # default simulated learner step (train + publish), s
PROMPT_LEN = 256  # default prompt tokens of every simulated sample
DATASET_SIZE = 10000  # default prompts in the simulated dataset (data.synthetic_size's default)
MODES = "sync,april,async"
PANEL = "Simulated cluster (april simulate; april bench --engine sim)"

DecodeMs = Annotated[float, typer.Option(help="A: decode step base time, ms.", min=0, rich_help_panel=PANEL)]
DecodeMsPerSeq = Annotated[
    float, typer.Option(help="B: added per active sequence, ms.", min=0, rich_help_panel=PANEL)
]
PrefillMsPerToken = Annotated[
    float,
    typer.Option(
        help="C: prefill per input token (prompt, or prompt + partial on resume), ms.",
        min=0,
        rich_help_panel=PANEL,
    ),
]
LearnerStepS = Annotated[
    float, typer.Option(help="L: learner step + weights publish, s.", min=0, rich_help_panel=PANEL)
]
PromptLen = Annotated[int, typer.Option(help="Prompt tokens of every sample.", min=1, rich_help_panel=PANEL)]
SamplesPerPrompt = Annotated[int, typer.Option(help="Samples per group.", min=1)]
MaxStaleness = Annotated[int, typer.Option(help="async: versions a sample may lag (eta).", min=0)]
Modes = Annotated[str, typer.Option(help="Comma list of modes, run in this order.")]
PromptCorr = Annotated[
    float,
    typer.Option(
        help="How much a response's length is its prompt's, in [0, 1): lengths of one prompt's samples "
        "(and of the prompt in every epoch) correlate (april/sample_draw.py); 0: independent.",
        min=0,
        max=0.999,
        rich_help_panel=PANEL,
    ),
]
DatasetSize = Annotated[
    int, typer.Option(help="Prompts in the dataset: they recur every epoch.", min=1, rich_help_panel=PANEL)
]
OverSamplingOpt = Annotated[
    OverSampling,
    typer.Option(help="april: a fixed round target, or auto (planned per round, the batch size is the cap)."),
]
PromptOrderOpt = Annotated[
    PromptOrder,
    typer.Option(
        help="Which drawn prompt is issued next: the data's order, or the shortest / longest predicted "
        "(per-prompt length history) of the next --prompt-window first."
    ),
]
PromptWindow = Annotated[
    int,
    typer.Option(help="--prompt-order: prompts drawn ahead; each is issued within this many groups.", min=1),
]
PrefixCacheTokens = Annotated[
    int,
    typer.Option(
        help="KV tokens each engine keeps for interrupted samples (their prefix cache; 0 = none).",
        min=0,
        rich_help_panel=PANEL,
    ),
]
ResumeAffinity = Annotated[
    bool,
    typer.Option(help="A partial goes back to the engine it left (its cached prefix) if that one has room."),
]
ResumeKVOption = Annotated[
    ResumeKV,
    typer.Option(
        help="recompute: a weight update empties the prefix caches (exact; real engines); reuse: kept.",
        case_sensitive=False,
    ),
]
