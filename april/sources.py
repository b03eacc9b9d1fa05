"""Which prompt source a config names (`[data] source`, `[data] eval_source`): `open_source`.

Sits above `april.data` (records, the synthetic source, dataset files) and the generated tasks' sources
(`april.task`, `april.envs.calculator`, `april.envs.reasoning_gym`, `april.envs.verifiers_adapter`), which
all import `april.data`: the dependency points one way, so no import in `april/` goes round a cycle
(tests/test_import_cycles.py). Knows no source's rules; only which name opens which.
"""

from __future__ import annotations

from april.config import DataConfig, EnvConfig
from april.data import DatasetError, FilePromptSource, PromptSource, SyntheticPromptSource
from april.envs.calculator import CalculatorPromptSource
from april.envs.reasoning_gym import ReasoningGymSource
from april.envs.verifiers_adapter import VerifiersPromptSource, is_verifiers
from april.task import TaskPromptSource

GENERATED_SOURCES = (
    "synthetic",
    "task",
    "calculator",
    "verifiers",
)  # `data.source` names that are not dataset paths
GENERATED_PREFIXES = ("reasoning_gym:",)  # nor are these: a generator and its arguments


def is_generated(source: str) -> bool:
    """`source` names a generator, not a dataset path."""
    return source in GENERATED_SOURCES or source.startswith(GENERATED_PREFIXES)


def open_source(data_config: DataConfig, seed: int, env: EnvConfig | None = None) -> PromptSource:
    """The source named by `[data] source`: "synthetic", "task" (the built-in task), "calculator" (the
    built-in multi-turn task, `april.envs.calculator`), "reasoning_gym:TASK[,TASK...]" (the package's
    generators, `april.envs.reasoning_gym`, seeded by `data.seed` or else the run's), "verifiers" (the
    dataset of the verifiers environment `env` names, `april.envs.verifiers_adapter`) or a dataset path."""
    # a verifiers environment brings its dataset: the default source (synthetic token ids) gives way to it
    if data_config.source == "verifiers" or (
        data_config.source == "synthetic" and env is not None and is_verifiers(env.name)
    ):
        if env is None or not is_verifiers(env.name):
            got = "" if env is None else env.name
            raise DatasetError(f"data.source = 'verifiers' needs env.name = 'verifiers:MODULE', got {got!r}")
        return VerifiersPromptSource(env.name, env.args)
    if data_config.source.startswith("reasoning_gym:"):
        return ReasoningGymSource(
            data_config.source, data_config.size, data_config.generator_seed(seed), data_config.options
        )
    if data_config.source == "calculator":
        return CalculatorPromptSource(seed=seed)
    if data_config.source == "task":
        return TaskPromptSource(seed=seed)
    if data_config.source == "synthetic":
        return SyntheticPromptSource(
            data_config.synthetic_size,
            seed=seed,
            prompt_len_min=data_config.synthetic_prompt_len_min,
            prompt_len_max=data_config.synthetic_prompt_len_max,
            vocab_size=data_config.synthetic_vocab_size,
            shuffle=data_config.shuffle,
        )
    return FilePromptSource(
        data_config.source,
        prompt_key=data_config.prompt_key,
        answer_key=data_config.answer_key,
        answer_format=data_config.answer_format,
        seed=seed,
        shuffle=data_config.shuffle,
        continue_final_message=data_config.continue_final_message,
    )
