"""Typed, frozen run configuration: schema, loading, precedence, validation and writing.

Owns: one frozen dataclass per TOML section (``[run]``, ``[algo]``, ``[data]``, ``[broker]``,
``[worker]``, ``[learner]``) with its defaults and range checks; ``load_config``, which layers
dataclass defaults < TOML file < ``APRIL_<SECTION>_<KEY>`` environment variables < ``section.key``
overrides; the slime-style ``run.partial_rollout`` alias; ``write_config``, which saves the resolved
config as TOML that loads back to an equal ``Config``. Every error is a ``ConfigError`` with one
readable line naming ``section.key``, the value got and what was expected.

Does not own: any role logic. Roles read the fields they need; nothing here starts, connects to or
computes anything, and nothing is done at import time.
"""

import dataclasses
import enum
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from april.files import write_text_atomic
from april.ports import endpoint_problem
from april.sim.engine_cost import DEFAULT_COST as SIM_COST
from april.sim.engine_cost import EngineCost


class ConfigError(ValueError):
    """A bad config value, key or file; the message is one user-facing line."""


class Mode(enum.StrEnum):
    SYNC = "sync"
    APRIL = "april"
    ASYNC = "async"


class Algorithm(enum.StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    DAPO = "dapo"
    GSPO = "gspo"


class OverSampling(enum.StrEnum):
    FIXED = "fixed"  # every april round keeps over_sampling_batch_size groups
    AUTO = "auto"  # each round's target is planned from observed lengths, capped there (broker/round_plan.py)


class PromptOrder(enum.StrEnum):
    ISSUE = "issue"  # prompts are issued in the data's order
    SHORTEST_FIRST = "shortest_first"  # predicted shortest of the next `prompt_window` first (policy)
    LONGEST_FIRST = "longest_first"  # predicted longest of the next `prompt_window` first


class OffPolicy(enum.StrEnum):
    NONE = "none"
    MASK = "mask"
    TIS = "tis"
    DECOUPLED = "decoupled"


class ISLevel(enum.StrEnum):
    """How the importance weight pi_prox / pi_beh of `tis` and `decoupled` is formed (learner.losses)."""

    TOKEN = "token"  # one weight per token
    SEQUENCE = "sequence"  # the product over the sample's tokens, one weight per sample
    GEOMETRIC = "geometric"  # the geometric mean over the sample's tokens, one weight per sample


class KLEstimator(enum.StrEnum):
    """Estimator of KL to the reference model per token, d = log pi_theta - log pi_ref (learner.losses)."""

    K1 = "k1"  # d
    K2 = "k2"  # d^2 / 2
    K3 = "k3"  # exp(-d) - 1 + d


class ResumeKV(enum.StrEnum):
    """What a resumed partial's prefix KV is after a weight update (april.sim.prefix_cache)."""

    RECOMPUTE = "recompute"  # flushed with the update: re-prefilled under the new weights (exact)
    REUSE = "reuse"  # kept: the resume attends to KV of the weights that generated it (cheaper)


class AdamImpl(enum.StrEnum):
    """Which AdamW the learner steps with on CUDA (docs/learner.md); on CPU both are torch.optim.AdamW."""

    TORCH = "torch"  # torch.optim.AdamW, fused on CUDA: nothing to build
    DEEPSPEED = "deepspeed"  # DeepSpeed's FusedAdam on CUDA, built with nvcc at first use


class WeightsTransport(enum.StrEnum):
    """How a published weights version reaches the workers (docs/design.md section 6)."""

    AUTO = "auto"  # the learner's file where the worker sees it, the network transport otherwise
    FILE = "file"  # workers read <run>/weights/ (a shared filesystem)
    NETWORK = "network"  # workers pull each version from the learner's weight service (no shared filesystem)
    BROADCAST = "broadcast"  # a collective (gloo/NCCL) to engines that take one; network for the others


def _fmt(value: object) -> str:
    return repr(value.value) if isinstance(value, enum.Enum) else repr(value)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {_fmt(value)}: {expected}")


def _endpoint(name: str, address: str) -> None:
    problem = endpoint_problem(address)
    _check(problem is None, name, address, problem or "")


# worker.device, learner.device: "auto" (cuda when torch sees a GPU, else cpu), "cpu", "cuda", "cuda:N".
# Only the form is checked here (no torch); whether the GPU is there is april.devices' (at start).
DEVICE = re.compile(r"(auto|cpu|cuda(?::(\d+))?)")


def _device(name: str, value: str) -> None:
    _check(DEVICE.fullmatch(value) is not None, name, value, "expected 'auto', 'cpu', 'cuda' or 'cuda:N'")


def _splits(command: str) -> bool:
    """Whether `command` splits as a shell would split it (no unclosed quote)."""
    try:
        shlex.split(command)
    except ValueError:
        return False
    return True


def _positive(section: object, prefix: str, *names: str) -> None:
    for n in names:
        v = getattr(section, n)
        _check(v > 0, f"{prefix}.{n}", v, "must be > 0")


@dataclass(frozen=True, slots=True)
class RunConfig:
    name: str = "april"  # run name; the default run directory is runs/<name>
    run_dir: str = ""  # empty: runs/<name>
    seed: int = 0  # seeds the prompt order, synthetic prompts and sampling
    steps: int = 20  # learner steps (batches trained) in the run
    mode: Mode = Mode.APRIL  # scheduling: sync baseline, april partial rollouts, async (docs/design.md 4)
    eval_every: int = 0  # steps between evaluations on the held-out prompts (and at the end); 0 = off
    rollout_records: bool = True  # write <run>/rollouts/: every trained sample per step, every evaluation
    rollout_records_groups: int = 0  # groups recorded per step: 0 = all; k: k of them, drawn per step

    def __post_init__(self) -> None:
        _check(bool(self.name), "run.name", self.name, "must be a non-empty string")
        _positive(self, "run", "steps")
        _check(self.eval_every >= 0, "run.eval_every", self.eval_every, "must be >= 0 (0 = off)")
        _check(
            self.rollout_records_groups >= 0,
            "run.rollout_records_groups",
            self.rollout_records_groups,
            "must be >= 0 (0 = every group)",
        )

    @property
    def partial_rollout(self) -> bool:
        """slime's --partial-rollout: true exactly when the mode is april."""
        return self.mode == Mode.APRIL


@dataclass(frozen=True, slots=True)
class AlgoConfig:
    algorithm: Algorithm = Algorithm.GRPO  # advantage estimator and loss (docs/learner.md)
    rollout_batch_size: int = 8  # prompts per train step
    over_sampling_batch_size: int = 16  # prompts in flight per step (>= rollout_batch_size); auto: the cap
    over_sampling: OverSampling = OverSampling.FIXED  # april: fixed target, or planned per round (auto)
    prompt_order: PromptOrder = PromptOrder.ISSUE  # which drawn prompt is issued next (length history)
    prompt_window: int = 64  # prompt_order: prompts drawn ahead; each is issued within this many groups
    n_samples_per_prompt: int = 4  # samples per group (GRPO's baseline is taken over a group)
    max_new_tokens: int = 256  # response budget per sample, across all its resumed segments
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    max_staleness: int = 1  # policy versions a sample may lag the learner
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal (not counted in N)
    offpolicy: OffPolicy = OffPolicy.NONE  # handling of tokens from older policy versions (docs/learner.md)
    tis_cap: float = 2.0  # offpolicy tis: cap C of the importance weight min(ratio, C) (>= 1)
    is_level: ISLevel = ISLevel.TOKEN  # tis, decoupled: weight per token, sequence (product) or geometric
    is_mask_low: float = 0.0  # tis, decoupled: a weight below this gets no loss (rejected); 0 = off
    is_mask_high: float = -1.0  # tis, decoupled: a weight above it gets no loss; 0 = off; < 0: decoupled 5
    overlong_buffer: int = -1  # DAPO soft overlong punishment ramp (tokens); 0 = off; < 0: dapo 1/5 of max
    overlong_penalty: float = 1.0  # reward lost by a response at max_new_tokens (soft overlong punishment)
    overlong_filter: bool = False  # DAPO overlong filtering: truncated samples (budget used up) get no loss
    resume_affinity: bool = False  # a partial goes back to the worker it left (its prefix cache) if room

    def __post_init__(self) -> None:
        _positive(self, "algo", "rollout_batch_size", "over_sampling_batch_size", "prompt_window")
        _positive(self, "algo", "n_samples_per_prompt", "max_new_tokens", "temperature")
        _check(
            self.over_sampling_batch_size >= self.rollout_batch_size,
            "algo.over_sampling_batch_size",
            self.over_sampling_batch_size,
            f"must be >= algo.rollout_batch_size ({self.rollout_batch_size})",
        )
        _check(0 < self.top_p <= 1, "algo.top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "algo.top_k", self.top_k, "must be >= 0 (0 = off)")
        _check(self.max_staleness >= 0, "algo.max_staleness", self.max_staleness, "must be >= 0")
        _check(self.tis_cap >= 1, "algo.tis_cap", self.tis_cap, "must be >= 1")
        _check(0 <= self.is_mask_low < 1, "algo.is_mask_low", self.is_mask_low, "must be in [0, 1) (0 = off)")
        _check(
            self.is_mask_high <= 0 or self.is_mask_high > 1,
            "algo.is_mask_high",
            self.is_mask_high,
            "must be > 1, 0 (off) or < 0 (the offpolicy's default)",
        )
        _check(
            self.overlong_buffer <= self.max_new_tokens,
            "algo.overlong_buffer",
            self.overlong_buffer,
            f"must be <= algo.max_new_tokens ({self.max_new_tokens}); 0 = off, < 0 = the algorithm's default",
        )
        _check(self.overlong_penalty >= 0, "algo.overlong_penalty", self.overlong_penalty, "must be >= 0")

    @property
    def samples_per_batch(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def overlong_buffer_tokens(self) -> int:
        """The soft overlong punishment's buffer in tokens, resolved: `overlong_buffer` when >= 0, else
        DAPO's own proportion for `dapo` (its 4,096-token buffer of 20,480: max_new_tokens / 5) and 0 (off)
        for the others, as verl's DAPO recipe turns it on and its default reward manager leaves it off."""
        if self.overlong_buffer >= 0:
            return self.overlong_buffer
        return self.max_new_tokens // 5 if self.algorithm == Algorithm.DAPO else 0

    @property
    def is_mask_high_resolved(self) -> float:
        """`is_mask_high` resolved: when < 0, 5 for `decoupled` (AReaL's examples: behav_imp_weight_cap 5.0,
        which masks rather than truncates) and 0 (off) otherwise (`tis` already truncates at tis_cap)."""
        if self.is_mask_high >= 0:
            return self.is_mask_high
        return 5.0 if self.offpolicy == OffPolicy.DECOUPLED else 0.0


class AnswerFormat(enum.StrEnum):
    """How the answer field's value becomes the answer given to the reward (april.data.fields)."""

    RAW = "raw"  # the value as it is (a number as its text)
    GSM8K = "gsm8k"  # the text after the last "####", commas dropped: GSM8K's "...\n#### 1,000" -> "1000"


@dataclass(frozen=True, slots=True)
class DataConfig:
    source: str = "synthetic"  # "synthetic", "task", "calculator", "reasoning_gym:TASK,..." or a dataset path
    prompt_key: str = "prompt"  # field holding the prompt: text, chat messages or token ids (dotted: nested)
    answer_key: str = "answer"  # field holding the reference answer given to the reward; empty: none
    answer_format: AnswerFormat = AnswerFormat.RAW  # raw: as it is; gsm8k: the text after its last "####"
    shuffle: bool = True  # a new seeded permutation of the prompts each epoch; false: file order
    synthetic_prompt_len_min: int = 8  # synthetic source: shortest prompt, in tokens
    synthetic_prompt_len_max: int = 64  # synthetic source: longest prompt, in tokens
    synthetic_vocab_size: int = 1000  # synthetic source: prompt token ids are drawn below this
    synthetic_size: int = 10000  # synthetic source: prompts in the dataset (an epoch)
    continue_final_message: bool = False  # a chat prompt may end with an assistant turn the model continues
    eval_size: int = -1  # held-out prompts per evaluation, never trained on; -1: auto (docs/data.md)
    eval_source: str = ""  # a dataset of its own for the held-out prompts (verl's val_files); "": source
    size: int = 10000  # reasoning_gym source: questions per task (an epoch); held-out ones come after them
    seed: int = -1  # reasoning_gym source: the generators' seed; -1: run.seed
    options: str = ""  # reasoning_gym source: JSON object, task name -> its config options ({} each)

    def __post_init__(self) -> None:
        _positive(self, "data", "synthetic_prompt_len_min", "synthetic_vocab_size", "synthetic_size", "size")
        _check(self.eval_size >= -1, "data.eval_size", self.eval_size, "must be >= 0, or -1 (auto)")
        _check(
            self.synthetic_prompt_len_max >= self.synthetic_prompt_len_min,
            "data.synthetic_prompt_len_max",
            self.synthetic_prompt_len_max,
            f"must be >= data.synthetic_prompt_len_min ({self.synthetic_prompt_len_min})",
        )

    def generator_seed(self, run_seed: int) -> int:
        """The reasoning_gym generators' seed: `seed`, or the run's when it is -1."""
        return run_seed if self.seed == -1 else self.seed


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    bind_host: str = "127.0.0.1"  # address the broker binds; non-loopback needs CurveZMQ keys
    worker_port: int = 5555  # ROUTER port the workers connect to
    learner_port: int = 5556  # ROUTER port the learner and `april status` connect to
    pub_port: int = 5557  # PUB port of the read-only status feed (dashboard)
    heartbeat_interval_s: float = 1.0  # seconds between heartbeats, both ways
    liveness: int = 3  # missed heartbeats before a peer is declared dead
    abort_timeout_s: float = 5.0  # seconds to wait for a worker to confirm an abort before re-sending
    abort_retries: int = 3  # abort re-sends before the worker is declared dead and its leases re-queued
    max_message_bytes: int = 268435456  # 256 MiB
    max_buffered_samples: int = 16384  # bound on samples held: issuing pauses at it (back-pressure)
    snapshot_interval_s: float = 30.0  # seconds between snapshots of the broker state to <run>/broker
    curve_keys_dir: str = ""  # CurveZMQ keys (`april keys generate DIR`), read by every role; empty: no CURVE
    debug_ledger: bool = False  # check the ledger balances after every state change (slow; for tests)
    metrics_port: int = 0  # Prometheus endpoint on bind_host:metrics_port; 0 = off
    min_workers: int = 0  # lease nothing until this many workers registered (equal starts in benchmarks)
    stop_after_failures: int = 64  # stop the run once this many samples in a row failed alike; 0: never

    def __post_init__(self) -> None:
        _positive(self, "broker", "heartbeat_interval_s", "liveness", "abort_timeout_s")
        _positive(self, "broker", "max_message_bytes", "max_buffered_samples", "snapshot_interval_s")
        _check(self.abort_retries >= 0, "broker.abort_retries", self.abort_retries, "must be >= 0")
        _check(self.min_workers >= 0, "broker.min_workers", self.min_workers, "must be >= 0")
        _check(
            self.stop_after_failures >= 0,
            "broker.stop_after_failures",
            self.stop_after_failures,
            "must be >= 0",
        )
        seen: dict[int, str] = {}
        for n in ("worker_port", "learner_port", "pub_port"):
            port = getattr(self, n)
            _check(1 <= port <= 65535, f"broker.{n}", port, "must be a port in 1..65535")
            _check(port not in seen, f"broker.{n}", port, f"must differ from broker.{seen.get(port)}")
            seen[port] = n


# worker.vllm_dtype: empty (the device's default) or a dtype vLLM's `--dtype` takes (vllm/config/model.py)
# Response positions per log-prob chunk (the output head and log-softmax are applied to this many final
# hidden states at a time): 512 x a 151,936-token vocabulary is 311 MB of float32 logits per chunk.
DEFAULT_LOGPROB_CHUNK_TOKENS = 512
VLLM_DTYPES = ("", "auto", "float32", "float", "bfloat16", "float16", "half")
# worker.sim_tool_ms: median 1 s, p99 30 s (sigma = ln 30 / 2.326), 30 s at most (a tool's time-out)
SIM_TOOL_MS = "lognormal:median=1000,sigma=1.46,cap=30000"
# worker.gpu_memory_fraction: the torch engine's share of its GPU for weights and KV cache (docs/engines.md).
# Half: on one GPU the learner takes the rest. The cache takes only what its rows need, often far less.
GPU_MEMORY_FRACTION = 0.5
# worker.result_hold_ms: held longer, results would wait on the order of a heartbeat (april.peer_link)
MAX_RESULT_HOLD_MS = 1000.0


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    broker: str = "tcp://127.0.0.1:5555"  # the broker's worker port
    engine: str = "torch"  # inference engine: torch | sglang | vllm | sim
    slots: int = 8  # concurrent generations per worker
    model: str = ""  # Hugging Face model directory (torch, vllm need one); empty: byte-level tokenizer
    reward: str = "exact"  # built-in name or "module:function"
    reward_timeout_s: float = 10.0  # seconds one reward call may take before it scores as failed
    result_hold_ms: float = 0.0  # hold results and freed slots up to this long, as one message; 0: at once
    usage_report_s: float = 0.1  # seconds between usage reports while generating: the phase split's grain
    worker_id: str = ""  # empty: <hostname>-<pid>
    device: str = "auto"  # torch, vllm engines: auto (cuda if torch sees a GPU, else cpu), cpu, cuda, cuda:N
    max_seq_len: int = 0  # torch, vllm: tokens one sequence holds, prompt + response; 0 = the model's context
    gpus_per_engine: int = 1  # april up: GPUs of each engine (sglang, vllm: its tensor-parallel size)
    torch_threads: int = 1  # intra-op threads per worker process (several processes share the cores)
    gpu_memory_fraction: float = GPU_MEMORY_FRACTION  # torch on CUDA: most of the GPU for weights + KV cache
    sglang_urls: str = ""  # comma-separated server URLs (one SGLang server per GPU or TP group)
    sglang_weights_dir: str = ""  # sglang: a directory per weights version, for its servers (empty: temp)
    # `april up` with engine sglang and no sglang_urls starts one server per engine (cli/sglang_servers.py)
    sglang_launch: str = ""  # april up: the command starting a server (shlex); empty: -m sglang.launch_server
    sglang_args: str = ""  # april up: more server flags after april's own, e.g. "--mem-fraction-static 0.7"
    sglang_port: int = 30000  # april up: server i listens on 127.0.0.1, port sglang_port + i
    sglang_start_timeout_s: float = 900.0  # april up: seconds a server may take to answer /health
    sim_lengths: str = "lognormal:median=64,sigma=1.0,cap=512"  # sim engine: response-length spec
    sim_time_scale: float = 1.0  # sim engine: wall seconds per simulated second
    sim_prompt_corr: float = 0.0  # sim engine: how much a length is the prompt's, in [0, 1) (sample_draw)
    # one cost model with april simulate's engines: april/sim/engine_cost.py holds the defaults and formula
    sim_decode_ms: float = SIM_COST.decode_ms  # sim engine: A, ms a step (A + B x active + C x prefilled)
    sim_decode_ms_per_seq: float = SIM_COST.decode_ms_per_seq  # sim engine: B, ms per active sequence
    sim_prefill_ms_per_token: float = SIM_COST.prefill_ms_per_token  # sim engine: C, ms per prefilled token
    sim_prefix_cache_tokens: int = SIM_COST.prefix_cache_tokens  # sim engine: KV tokens kept for partials
    # april simulate's episodes: each turn's length is sim_lengths'; env.max_turns, max_turn_tokens bind
    sim_turns: str = ""  # sim episodes: model turns per episode (a length spec); empty: single-turn samples
    sim_tool_ms: str = SIM_TOOL_MS  # sim episodes: ms a tool call takes (a length spec); empty: none
    sim_observation_tokens: str = "lognormal:median=32,sigma=0.8,cap=1024"  # sim episodes: tokens per answer
    sim_tool_repeatable: bool = True  # sim episodes: an abort kills a tool call (run again); false: waits
    sim_episodes: str = ""  # sim episodes: a JSONL file of recorded ones instead (docs/bench.md)
    resume_kv: ResumeKV = ResumeKV.RECOMPUTE  # cached prefixes at a weight update: recompute (flush) | reuse
    vllm_kv_cache_gib: float = 1.0  # vllm on CPU: KV cache GiB; 0 = vLLM's default (most of host memory)
    vllm_gpu_memory_utilization: float = 0.0  # vllm on CUDA: GPU memory share (weights, KV); 0 = vLLM's own
    vllm_dtype: str = ""  # vllm engine: empty = float32 on CPU, vLLM's "auto" on CUDA; or bfloat16, ...
    vllm_enforce_eager: bool = False  # vllm on CUDA: no CUDA graphs or torch.compile (always so on CPU)

    def __post_init__(self) -> None:
        _endpoint("worker.broker", self.broker)
        _device("worker.device", self.device)
        _positive(
            self, "worker", "slots", "reward_timeout_s", "torch_threads", "usage_report_s", "gpus_per_engine"
        )
        _check(
            0 < self.gpu_memory_fraction <= 1,
            "worker.gpu_memory_fraction",
            self.gpu_memory_fraction,
            "must be in (0, 1]",
        )
        _check(
            0 <= self.result_hold_ms <= MAX_RESULT_HOLD_MS,
            "worker.result_hold_ms",
            self.result_hold_ms,
            f"must be in [0, {MAX_RESULT_HOLD_MS:g}] (0 = send at once)",
        )
        _check(self.sim_time_scale >= 0, "worker.sim_time_scale", self.sim_time_scale, "must be >= 0")
        _check(
            0 <= self.sim_prompt_corr < 1, "worker.sim_prompt_corr", self.sim_prompt_corr, "must be in [0, 1)"
        )
        for name in ("sim_decode_ms", "sim_decode_ms_per_seq", "sim_prefill_ms_per_token"):
            _check(getattr(self, name) >= 0, f"worker.{name}", getattr(self, name), "must be >= 0")
        _check(
            self.sim_prefix_cache_tokens >= 0,
            "worker.sim_prefix_cache_tokens",
            self.sim_prefix_cache_tokens,
            "must be >= 0 (0 = no prefix cache)",
        )
        _check(
            self.vllm_kv_cache_gib >= 0, "worker.vllm_kv_cache_gib", self.vllm_kv_cache_gib, "must be >= 0"
        )
        _check(
            0 <= self.vllm_gpu_memory_utilization <= 1,
            "worker.vllm_gpu_memory_utilization",
            self.vllm_gpu_memory_utilization,
            "must be in [0, 1] (0 = vLLM's default)",
        )
        _check(
            self.vllm_dtype in VLLM_DTYPES,
            "worker.vllm_dtype",
            self.vllm_dtype,
            "one of " + ", ".join(repr(d) for d in VLLM_DTYPES),
        )
        _check(
            self.max_seq_len >= 0,
            "worker.max_seq_len",
            self.max_seq_len,
            "must be >= 0 (0 = the model's context)",
        )
        for name in ("sglang_launch", "sglang_args"):
            value = getattr(self, name)
            _check(_splits(value), f"worker.{name}", value, "a command line (shlex: quotes closed)")
        _check(1 <= self.sglang_port <= 65535, "worker.sglang_port", self.sglang_port, "a port in [1, 65535]")
        _positive(self, "worker", "sglang_start_timeout_s")

    @property
    def sim_cost(self) -> EngineCost:
        """The sim engine's step cost, from the three sim_* fields."""
        return EngineCost(
            self.sim_decode_ms,
            self.sim_decode_ms_per_seq,
            self.sim_prefill_ms_per_token,
            self.sim_prefix_cache_tokens,
        )


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    broker: str = "tcp://127.0.0.1:5556"  # the broker's learner port
    model: str = ""  # Hugging Face model directory to train; its weights are version 0
    lr: float = 1e-6  # AdamW learning rate
    checkpoint_every: int = 10  # train steps between checkpoints
    backend: str = "deepspeed"  # deepspeed | torch (plain torch AdamW, one process) | sim (no model)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    micro_batches: int = 1  # micro-batches per optimizer step, per rank: the fixed count, or the least
    max_tokens_per_micro_batch: int = 16384  # token budget of a micro-batch (0: exactly micro_batches)
    logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS  # response tokens per log-prob chunk (0: full)
    pack_sequences: bool = False  # one padding-free row per micro-batch (needs packed-sequence support)
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward (less memory)
    device: str = "auto"  # auto (cuda if torch sees a GPU, else cpu) | cpu | cuda | cuda:N
    gpus: int = 0  # april up: the learner's GPUs, one rank each (0: half the node); on CPU, its CPU ranks
    adam_impl: AdamImpl = AdamImpl.TORCH  # CUDA: torch (fused AdamW, no build) | deepspeed (FusedAdam, nvcc)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # max global gradient norm; <= 0 disables clipping
    warmup_steps: int = 0  # linear learning-rate warm-up, in optimizer steps
    eps_low: float = -1.0  # PPO clip below 1 - eps_low; < 0: the algorithm's default (0.2; gspo 3e-4)
    eps_high: float = -1.0  # clip above 1 + eps_high; < 0: the algorithm's default (dapo 0.28)
    kl_coef: float = 0.0  # weight of the KL to the initial model (0: no reference model is kept)
    kl_estimator: KLEstimator = KLEstimator.K3  # per-token KL estimate: k1, k2 or k3 (docs/learner.md)
    kl_clamp: float = 10.0  # k3's value capped at kl_clamp where log pi < log pi_ref (k1, k2: never); 0 = off
    entropy_coef: float = 0.0  # weight of the entropy bonus in the loss (0: off)
    log_ratio_clamp: float = 20.0  # log(pi / pi_ref) clamped to [-c, c] before exp (ratios, weights); 0 = off
    clip_ratio_c: float = 3.0  # dual-clip: a negative-advantage token's loss is at most c x |A|; > 1, 0 = off
    torch_threads: int = 1  # intra-op threads of the learner process
    keep_weights: int = 3  # published versions kept on disk (>= 2)
    keep_checkpoints: int = 2  # checkpoints kept on disk (>= 1)
    updates_per_batch: int = 1  # optimizer steps per batch (each on 1/updates_per_batch of the groups)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.999  # AdamW second-moment decay
    adam_eps: float = 1e-8  # AdamW epsilon
    tensorboard: bool = True  # also write TensorBoard events to <run>/tensorboard when it is installed
    wandb_project: str = ""  # also log every metrics line to this wandb project (empty: off)
    wandb_entity: str = ""  # wandb team or user (empty: your wandb default)
    wandb_run_name: str = ""  # wandb display name (empty: the run directory's name)
    wandb_group: str = ""  # wandb group, to compare related runs together (empty: none)
    wandb_tags: str = ""  # comma-separated wandb tags (empty: none)
    sim_step_s: float = 20.0  # backend sim: simulated seconds per step (fixed part), x worker.sim_time_scale
    sim_step_s_per_token: float = 0.0  # backend sim: simulated seconds added per trained response token

    def __post_init__(self) -> None:
        _endpoint("learner.broker", self.broker)
        _device("learner.device", self.device)
        _positive(self, "learner", "lr", "micro_batches", "torch_threads", "updates_per_batch", "adam_eps")
        _check(self.keep_checkpoints >= 1, "learner.keep_checkpoints", self.keep_checkpoints, "must be >= 1")
        _check(self.gpus >= 0, "learner.gpus", self.gpus, "must be >= 0 (0 = april up decides)")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            _check(0 <= v < 1, f"learner.{name}", v, "must be in [0, 1)")
        _check(
            self.backend in ("deepspeed", "torch", "sim"),
            "learner.backend",
            self.backend,
            "deepspeed, torch or sim",
        )
        _check(
            self.adam_impl != AdamImpl.DEEPSPEED or self.backend != "torch",
            "learner.adam_impl",
            self.adam_impl,
            "'deepspeed' needs learner.backend = 'deepspeed' (the torch backend steps torch.optim.AdamW)",
        )
        _check(self.sim_step_s >= 0, "learner.sim_step_s", self.sim_step_s, "must be >= 0")
        _check(
            self.sim_step_s_per_token >= 0,
            "learner.sim_step_s_per_token",
            self.sim_step_s_per_token,
            "must be >= 0",
        )
        _check(self.zero_stage in (0, 1, 2, 3), "learner.zero_stage", self.zero_stage, "0, 1, 2 or 3")
        _check(self.keep_weights >= 2, "learner.keep_weights", self.keep_weights, "must be >= 2")
        _check(self.checkpoint_every >= 0, "learner.checkpoint_every", self.checkpoint_every, "must be >= 0")
        _check(self.kl_clamp >= 0, "learner.kl_clamp", self.kl_clamp, "must be >= 0 (0 = off)")
        _check(
            self.log_ratio_clamp >= 0,
            "learner.log_ratio_clamp",
            self.log_ratio_clamp,
            "must be >= 0 (0 = off)",
        )
        _check(
            self.clip_ratio_c == 0 or self.clip_ratio_c > 1,
            "learner.clip_ratio_c",
            self.clip_ratio_c,
            "must be > 1 (0 = off)",
        )
        for name in ("max_tokens_per_micro_batch", "logprob_chunk_tokens"):
            _check(getattr(self, name) >= 0, f"learner.{name}", getattr(self, name), "must be >= 0 (0: off)")


@dataclass(frozen=True, slots=True)
class WeightsConfig:
    transport: WeightsTransport = WeightsTransport.AUTO  # auto | file | network | broadcast
    bind_host: str = "127.0.0.1"  # learner: address its weight service binds; non-loopback needs CurveZMQ
    port: int = 5558  # learner: weight service port (ZeroMQ); the broadcast rendezvous uses port + 1
    advertise_host: str = ""  # learner: address workers reach the service at; empty: its route to the broker
    chunk_bytes: int = 4194304  # network: bytes per chunk (4 MiB)
    window: int = 8  # network: chunks in flight per fetch (memory bound: window x chunk_bytes)
    bucket_bytes: int = 67108864  # broadcast: bytes per collective call (64 MiB buckets)
    timeout_s: float = 30.0  # a chunk or a collective waits at most this long before it is retried or dropped
    cache_dir: str = ""  # worker: where fetched versions are kept; empty: a directory under the system temp
    keep: int = 2  # worker: versions kept in the cache (>= 1)

    def __post_init__(self) -> None:
        _positive(self, "weights", "chunk_bytes", "window", "bucket_bytes", "timeout_s", "keep")
        _check(0 < self.port < 65535, "weights.port", self.port, "must be in 1..65534 (port + 1 is used too)")


@dataclass(frozen=True, slots=True)
class EnvConfig:
    name: str = ""  # environment: a built-in, module:Class, verifiers:MODULE, openenv:URL, sim; "": one turn
    args: str = ""  # verifiers:MODULE: JSON of load_environment's arguments; openenv:URL: JSON of settings
    max_turns: int = 16  # model turns an episode may take at most
    max_turn_tokens: int = 4096  # tokens one model turn may generate at most (within algo.max_new_tokens)
    tool_processes: int = 4  # per worker: child processes running resets and tool steps, one at a time each
    step_timeout_s: float = 10.0  # a reset or a step's own code, on top of its tools' own time-outs
    gateway: str = ""  # openenv:URL: the session gateway (tcp://HOST:PORT); empty: `april up` starts one
    server_command: str = ""  # openenv:URL: a command `april up` runs to serve URL; empty: it runs already
    server_start_s: float = 120.0  # openenv:URL: the server answers URL/health within this after its start
    session_idle_s: float = 600.0  # openenv:URL: the gateway closes a session unused this long

    def __post_init__(self) -> None:
        _positive(
            self,
            "env",
            "max_turns",
            "max_turn_tokens",
            "tool_processes",
            "step_timeout_s",
            "server_start_s",
            "session_idle_s",
        )


@dataclass(frozen=True, slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def run_path(self) -> Path:
        """The run directory: run.run_dir, or runs/<run.name> when that is empty."""
        return Path(self.run.run_dir) if self.run.run_dir else Path("runs") / self.run.name


_SECTIONS: dict[str, type[Any]] = {f.name: f.type for f in fields(Config)}  # type: ignore[misc]
_ALIAS = ("run", "partial_rollout")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")

# One layer of settings: (section, key) -> (typed value, where it came from).
_Layer = dict[tuple[str, str], tuple[object, str]]


def _field_type(section: str, key: str, where: str) -> type[Any]:
    """The type of section.key, or a ConfigError naming the section/key and the known names."""
    if section not in _SECTIONS:
        raise ConfigError(f"{where}unknown section [{section}] (known: {', '.join(_SECTIONS)})")
    types: dict[str, type[Any]] = {f.name: f.type for f in fields(_SECTIONS[section])}  # type: ignore[misc]
    if section == _ALIAS[0]:
        types[_ALIAS[1]] = bool
    if key not in types:
        raise ConfigError(f'{where}unknown key "{key}" in section [{section}] (known: {", ".join(types)})')
    return types[key]


def _expected(typ: type[Any]) -> str:
    if issubclass(typ, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in typ)
    return {bool: "a bool", int: "an int", float: "a float", str: "a string"}[typ]


def _type_error(where: str, name: str, value: object, typ: type[Any]) -> ConfigError:
    return ConfigError(f"{where}{name} = {value!r} ({type(value).__name__}): expected {_expected(typ)}")


def _coerce(value: object, typ: type[Any], name: str, where: str) -> object:
    """Check an already-typed value (TOML, typed override): int is fine for float, bool is not an int."""
    if issubclass(typ, enum.Enum):
        if isinstance(value, str) and value in {m.value for m in typ}:
            return typ(value)
    elif typ is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, typ):
        return value
    raise _type_error(where, name, value, typ)


def _parse(text: str, typ: type[Any], name: str, where: str) -> object:
    """Parse a string (environment variable, --set value) per the field's type."""
    word = text.strip().lower()
    try:
        if issubclass(typ, enum.Enum):
            return typ(word)
        if typ is bool:
            if word in _TRUE or word in _FALSE:
                return word in _TRUE
            raise ValueError(text)
        if typ is int or typ is float:
            return typ(text.strip())
    except ValueError:
        raise _type_error(where, name, text, typ) from None
    return text


def _toml_layer(path: Path) -> _Layer:
    import tomllib

    where = f"{path}: "
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}invalid TOML: {e}") from None
    layer: _Layer = {}
    for section, table in data.items():
        if section not in _SECTIONS:
            raise ConfigError(f"{where}unknown section [{section}] (known: {', '.join(_SECTIONS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}{section} = {table!r}: expected a [{section}] table")
        for key, value in table.items():
            typ = _field_type(section, key, where)
            layer[(section, key)] = (_coerce(value, typ, f"{section}.{key}", where), where)
    return layer


def _env_layer(env: Mapping[str, str]) -> _Layer:
    layer: _Layer = {}
    for var in sorted(env):
        parts = var.lower().split("_", 2)
        if len(parts) < 3 or parts[0] != "april" or parts[1] not in _SECTIONS:
            continue  # not ours: other tools use APRIL_ too
        section, key = parts[1], parts[2]
        where = f"environment variable {var}: "
        typ = _field_type(section, key, where)
        layer[(section, key)] = (_parse(env[var], typ, f"{section}.{key}", where), where)
    return layer


def _override_layer(overrides: Mapping[str, object]) -> _Layer:
    layer: _Layer = {}
    for name, value in overrides.items():
        where = f"override {name}: "
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f'{where}expected "section.key" (sections: {", ".join(_SECTIONS)})')
        typ = _field_type(section, key, where)
        parsed = (
            _parse(value, typ, name, where) if isinstance(value, str) else _coerce(value, typ, name, where)
        )
        layer[(section, key)] = (parsed, where)
    return layer


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Resolve a Config: dataclass defaults < TOML file < APRIL_* environment < overrides."""
    layers = [
        _toml_layer(Path(path)) if path is not None else {},
        _env_layer(os.environ if env is None else env),
        _override_layer(overrides or {}),
    ]
    merged: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    partial_from = ""  # where run.partial_rollout = true was set, if anywhere yet
    for layer in layers:
        alias = layer.pop(_ALIAS, None)
        if alias is not None and alias[0] is True:
            partial_from = alias[1]
        mode = layer.get(("run", "mode"))
        if partial_from and mode is not None and mode[0] != Mode.APRIL:
            raise ConfigError(
                f"{mode[1]}run.mode = {_fmt(mode[0])}: conflicts with run.partial_rollout = true "
                f"(set by {partial_from[:-2]}), which means mode 'april'"
            )
        for (section, key), (value, _) in layer.items():
            merged[section][key] = value
        if partial_from:
            merged["run"]["mode"] = Mode.APRIL
    return Config(**{s: cls(**merged[s]) for s, cls in _SECTIONS.items()})


def replace_fields(config: Config, overrides: Mapping[str, object]) -> Config:
    """`config` with "section.key" fields replaced, parsed and checked as `--set` values are (ConfigError
    names the field). For settings built in code (april bench's run variants), not a file."""
    by_section: dict[str, dict[str, Any]] = {}
    for (section, key), (value, _) in _override_layer(overrides).items():
        if section == "run" and key == "partial_rollout":
            raise ConfigError("override run.partial_rollout: set run.mode instead")
        by_section.setdefault(section, {})[key] = value
    return dataclasses.replace(
        config,
        **{s: dataclasses.replace(getattr(config, s), **fields_) for s, fields_ in by_section.items()},
    )


def parse_override(text: str) -> tuple[str, str]:
    """Split a CLI ``--set section.key=value`` string into ("section.key", "value")."""
    name, eq, value = text.partition("=")
    name = name.strip()
    if not eq:
        raise ConfigError(f"--set {text!r}: expected section.key=value (no '=')")
    if "." not in name:
        raise ConfigError(f"--set {text!r}: expected section.key=value (no '.' in {name!r})")
    return name, value


def config_to_dict(config: Config) -> dict[str, dict[str, object]]:
    """The resolved config as plain JSON-able values (enums as their string value)."""
    out: dict[str, dict[str, object]] = {}
    for s in _SECTIONS:
        section = getattr(config, s)
        out[s] = {}
        for f in fields(section):
            v = getattr(section, f.name)
            out[s][f.name] = v.value if isinstance(v, enum.Enum) else v
    return out


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # round-trips; inf/nan are valid TOML too
    if isinstance(value, str):
        chars = (_ESCAPES.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in value)
        return '"' + "".join(chars) + '"'
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def write_config(config: Config, path: Path) -> None:
    """Write the fully resolved config as TOML, atomically (temp file in the same folder + os.replace)."""
    lines = ["# Resolved april config (april.config.write_config); load_config() reads it back."]
    for section, values in config_to_dict(config).items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    write_text_atomic(path, "\n".join(lines) + "\n")
