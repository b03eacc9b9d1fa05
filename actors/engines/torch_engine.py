"""The built-in `torch` engine: continuous batching over any Hugging Face causal LM, CPU or CUDA.

Owns one model, the request table and the batch (which request is in which row of the KV cache of
`actors.engines.slot_cache`), prefill, the decode step and weights loads; token ids only. A request joins
between decode steps, its input but the last token prefilled into the rows after the active ones; a finished
row leaves by moving the last row into its place, so rows [0, B) are the active ones, in the order in which
they draw from the one seeded generator. The cache is sized once at start on CUDA (`slots` rows of a
full-length sequence, checked against a memory budget by `actors.engines.kv_budget`) or when given a row
length; on the CPU it grows as rows need. The decode step has fixed shapes (rounded up to buckets on CUDA)
and addresses and no host sync but the read of its tokens, so on CUDA every shape is captured as a CUDA
graph at start (`actors.engines.cuda_graphs`) and serving only replays. Sampling and log-probs:
`actors.engines.token_sampling`. A stop token ends a request with STOP and is part of it; a budget is
clipped to the row's length (LENGTH). A weights load validates the whole state, copies it in place and
re-prefills every active row. How and why: docs/engines.md. Does not implement sliding-window or
linear-attention layers, beam search or speculation.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from actors.engine import (
    EngineError,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
    admit,
    check_engine_args,
)
from actors.engines.cuda_graphs import StepGraphs
from actors.engines.kv_budget import CachePlan, DeviceMemory, plan_cache
from actors.engines.slot_cache import SlotCache, use_slot_attention
from actors.engines.token_sampling import sample
from actors.weights_check import TensorSpec, check_tensors
from april.config import GPU_MEMORY_FRACTION
from april.hf import load_model, model_context_length
from april.records import FinishReason

log = logging.getLogger(__name__)

PREFILL_TOKENS = 8192  # most (rows x padded length) positions in one prefill forward
MIN_COLUMNS = 64  # the smallest cache-column bucket of a bucketed decode step


@dataclass(slots=True)
class _Row:
    """One request in the engine. The last sampled token is not yet in the KV cache."""

    request_id: int
    input_ids: list[int]
    budget: int  # tokens it may generate (clipped to the context)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    added_s: float = 0.0
    greedy: bool = False  # argmax instead of sampling (an evaluation request)

    def fed(self) -> list[int]:
        """Tokens whose keys/values belong in the cache: everything but the last known token."""
        return (self.input_ids + self.token_ids)[:-1]

    def cached(self) -> int:
        """How many of its tokens are in the cache: the column its next token is written to."""
        return len(self.input_ids) + len(self.token_ids) - 1

    def next_input(self) -> int:
        return self.token_ids[-1] if self.token_ids else self.input_ids[-1]

    def output(self, reason: FinishReason) -> GenerationOutput:
        return GenerationOutput.of(
            self.request_id,
            self.token_ids,
            self.logprobs,
            self.versions,
            reason,
            {"engine_s": time.perf_counter() - self.added_s},
        )


class TorchEngine:
    """Continuous batching with a KV cache over a local HF causal LM (see the module docstring).

    `cuda_graphs` (CUDA only) captures and replays the decode step; `bucketed` rounds the decode step's rows
    and cache columns up to buckets (None: on CUDA, where graphs need fixed shapes; graphs need it).
    `max_seq_len` is the tokens a row holds, prompt and response (None: the model's context); given, or on
    CUDA, the cache is sized once at start. `memory_fraction` is the share of the GPU's memory that the
    weights and the cache may take (CUDA only).
    """

    name = "torch"
    can_reuse_kv = False  # no prefix cache: an aborted row's KV is freed, and a load re-prefills live rows

    def __init__(
        self,
        model_dir: Path | str,
        slots: int,
        sampling: SamplingParams,
        device: str = "cpu",
        dtype: str | torch.dtype = "auto",
        greedy: bool = False,
        version: int = 0,
        prefill_tokens: int = PREFILL_TOKENS,
        cuda_graphs: bool = True,
        bucketed: bool | None = None,
        max_seq_len: int | None = None,
        memory_fraction: float = GPU_MEMORY_FRACTION,
    ) -> None:
        check_engine_args("torch", slots, sampling)
        self.slots = slots
        self.sampling = sampling
        self.greedy = greedy
        self.version = version
        self.device = torch.device(device)
        self.prefill_tokens = prefill_tokens
        self.model = load_model(model_dir, device, dtype)
        self.context = model_context_length(self.model)
        self.vocab_size = int(self.model.config.get_text_config(decoder=True).vocab_size)
        self._check_full_attention()
        use_slot_attention(self.model)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self._stop = set(sampling.stop_token_ids)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(sampling.seed)
        self._pending: list[_Row] = []
        self._done: list[GenerationOutput] = []
        self._rows: list[_Row] = []  # active rows, in batch order: row i of the cache
        self._bucketed = self.device.type == "cuda" if bucketed is None else bucketed
        self._kv = SlotCache(self._num_layers(), slots, self.device)
        self._graphs = StepGraphs(self.device, cuda_graphs and self._bucketed)
        fixed = self.device.type == "cuda" or self._graphs.enabled or max_seq_len is not None
        self.row_tokens = min(self.context, max_seq_len or self.context)  # a row's prompt + response, at most
        self.cache_plan: CachePlan | None = self._size_cache(memory_fraction) if fixed else None
        # the decode step's other buffers, one entry per slot (rows past the active ones are inert)
        self._next = torch.zeros(slots, dtype=torch.long, device=self.device)  # the token fed next
        self._live = torch.zeros(slots, dtype=torch.long, device=self.device)  # 1: the position advances
        self._greedy_rows = torch.zeros(slots, dtype=torch.bool, device=self.device)
        width = self._logits_width()  # V
        self._noise = (  # exponential noise of a draw `[slots, V]`; a greedy engine draws none
            None if greedy else torch.ones(slots, width, dtype=torch.float32, device=self.device)
        )
        self._out = torch.zeros(slots, 2, dtype=torch.float64, device=self.device)  # token, log-prob
        with torch.inference_mode():  # as `step` runs them
            self._graphs.capture_all(self._step_shapes(), self._step_of)

    # ---- Engine interface -------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._pending) + len(self._rows) + len(self._done)

    @property
    def placement(self) -> str:
        """Where and how it runs: "cpu", "cuda:0, cuda graphs", "cuda:0, eager (cuda graphs off)" or
        "cuda:0, eager (graph capture failed: <why>)"."""
        where = self._where()
        how = self._graphs.describe()
        return f"{where}, {how}" if how else where

    @property
    def captured_graphs(self) -> int:
        """CUDA graphs of the decode step in use: one per step shape, all captured at start (0 when eager)."""
        return self._graphs.count

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        known = {r.request_id for r in (*self._pending, *self._rows)} | {o.request_id for o in self._done}
        inputs = admit("torch engine", self.active, self.slots, requests, known, self.vocab_size)
        now = time.perf_counter()
        for req, ids in zip(requests, inputs, strict=True):
            budget = min(req.max_new_tokens, self.row_tokens - len(ids))
            row = _Row(req.request_id, ids, budget, added_s=now, greedy=req.greedy)
            if row.budget <= 0:
                self._done.append(row.output(FinishReason.LENGTH))
            else:
                self._pending.append(row)

    @torch.inference_mode()
    def step(self) -> list[GenerationOutput]:
        if self._pending:
            self._admit(self._pending)
            self._pending = []
        if self._rows:
            self._decode()
        done, self._done = self._done, []
        return done

    def abort(self) -> list[GenerationOutput]:
        out = self._done + [r.output(FinishReason.ABORT) for r in (*self._rows, *self._pending)]
        self._done, self._rows, self._pending = [], [], []
        self._free_rows(0, self.slots)
        return out

    def load_weights(self, path: Path, version: int) -> None:
        self._load_state(_read_state(Path(path)), version, repr(str(path)))

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """`actors.engine.TensorLoading`: a version received by the collective broadcast."""
        self._load_state(tensors, version, f"broadcast v{version}")

    @torch.inference_mode()
    def _load_state(self, state: Mapping[str, torch.Tensor], version: int, source: str) -> None:
        """Check the whole state before copying anything (a bad one leaves the old weights serving).
        The copy is in place: captured graphs read the same parameters."""
        params = self.model.state_dict()
        _check_state(state, params, source)
        for name, tensor in state.items():
            params[name].copy_(tensor)
        self.version = version
        if self._rows:  # recompute every active row's cache with the new weights
            rows, self._rows = self._rows, []
            self._free_rows(0, self.slots)
            self._admit(rows)

    def probe(self) -> None:
        """In-process: it serves as long as this process runs."""

    def close(self) -> None:
        self.abort()
        self._graphs.clear()
        self._kv.release()
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- batch management -------------------------------------------------------------------------

    def _admit(self, rows: list[_Row]) -> None:
        """Prefill `rows` into free batch rows, in chunks of at most `prefill_tokens` padded positions."""
        rows = sorted(rows, key=lambda r: len(r.input_ids) + len(r.token_ids))
        chunk: list[_Row] = []
        for row in rows:
            longest = len(row.fed())
            if chunk and (len(chunk) + 1) * longest > self.prefill_tokens:
                self._prefill(chunk)
                chunk = []
            chunk.append(row)
        if chunk:
            self._prefill(chunk)

    def _prefill(self, rows: list[_Row]) -> None:
        """Write the cache of `rows` (all tokens but the last known one) into rows [B, B + b), left-aligned.

        Right padding needs no padding mask: under the causal mask no real token sees a later pad.
        """
        fed = [r.fed() for r in rows]
        length = max(len(f) for f in fed)  # L: padded prefill length
        b0, b1 = len(self._rows), len(self._rows) + len(rows)
        self._reserve(self._columns(length + 1))
        if length > 0:
            ids = torch.zeros(len(rows), length, dtype=torch.long)
            for i, f in enumerate(fed):
                ids[i, : len(f)] = torch.tensor(f, dtype=torch.long)
            self._kv.prefill(b0, b1)
            self.model(
                input_ids=ids.to(self.device),
                position_ids=torch.arange(length, device=self.device)[None],
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: self._kv.cache},
            )
        self._kv.pos[b0:b1] = torch.tensor([len(f) for f in fed], device=self.device)
        self._next[b0:b1] = torch.tensor([r.next_input() for r in rows], device=self.device)
        self._live[b0:b1] = 1
        self._greedy_rows[b0:b1] = torch.tensor([r.greedy for r in rows], device=self.device)
        self._rows.extend(rows)

    def _decode(self) -> None:
        """One decode step for every active row: feed its last token, sample the next, retire finished."""
        b = len(self._rows)
        rows = min(1 << (b - 1).bit_length(), self.slots) if self._bucketed else b
        lengths = [len(r.input_ids) + len(r.token_ids) for r in self._rows]  # position + 1
        cols = self._columns(max(lengths))
        masked = self._bucketed or min(lengths) < cols  # exact shapes, every row at the last column: no mask
        self._reserve(cols)
        if self._noise is not None and not all(r.greedy for r in self._rows):
            self._noise[:b].exponential_(generator=self._gen)  # only live rows draw: as many draws as rows
        self._graphs.run((rows, cols), lambda: self._decode_step(rows, cols, masked))
        values = self._out[:b].cpu().tolist()  # the step's one host sync
        finished: list[int] = []
        for i, (row, (tok, lp)) in enumerate(zip(self._rows, values, strict=True)):
            token = int(tok)
            row.token_ids.append(token)
            row.logprobs.append(lp)
            row.versions.append(self.version)
            if token in self._stop:
                self._done.append(row.output(FinishReason.STOP))
                finished.append(i)
            elif len(row.token_ids) >= row.budget:
                self._done.append(row.output(FinishReason.LENGTH))
                finished.append(i)
        if finished:
            self._retire(finished)

    def _decode_step(self, rows: int, cols: int, masked: bool) -> None:
        """Rows [0, rows) over cache columns [0, cols): buffers in, buffers out, no host sync (a CUDA graph
        of it replays the same kernels on the same addresses)."""
        mask = self._kv.decode(rows, cols, masked)
        positions = self._kv.pos[:rows]
        out = self.model(
            input_ids=self._next[:rows, None],
            attention_mask=mask,
            position_ids=positions[:, None],
            use_cache=True,
            **{self._cache_arg: self._kv.cache},
        )
        noise = None if self._noise is None else self._noise[:rows]
        s = self.sampling
        tokens, logprobs = sample(
            out.logits[:, -1, :], s.temperature, s.top_k, s.top_p, noise, self._greedy_rows[:rows]
        )
        self._out[:rows, 0] = tokens
        self._out[:rows, 1] = logprobs
        self._next[:rows] = tokens
        positions += self._live[:rows]

    def _retire(self, finished: list[int]) -> None:
        """Remove finished rows: the last row moves into each hole (its cache, position and inputs)."""
        for i in sorted(finished, reverse=True):
            last = len(self._rows) - 1
            if i != last:
                self._kv.move(last, i, self._rows[last].cached())
                for buf in (self._next, self._greedy_rows):
                    buf[i] = buf[last]
                self._rows[i] = self._rows[last]
            self._rows.pop()
            self._free_rows(last, last + 1)

    def _free_rows(self, row0: int, row1: int) -> None:
        """Rows [row0, row1) hold nobody: position 0, never advancing (a bucketed step computes them)."""
        self._kv.pos[row0:row1] = 0
        self._live[row0:row1] = 0

    def _columns(self, width: int) -> int:
        """Cache columns a step over sequences of up to `width` tokens attends over (a bucket on CUDA)."""
        if not self._bucketed:
            return width
        return min(max(1 << (width - 1).bit_length(), MIN_COLUMNS), max(self.row_tokens, width))

    def _reserve(self, cols: int) -> None:
        """Room for `cols` columns: a no-op for a cache sized at start (graphs exist only with one)."""
        self._kv.reserve(cols)

    def _step_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, columns) a bucketed decode step can take: what is captured at start."""
        rows = sorted({min(1 << k, self.slots) for k in range(self.slots.bit_length() + 1)})
        widths = (min(1 << k, self.row_tokens) for k in range(self.row_tokens.bit_length() + 1))
        cols = sorted({self._columns(w) for w in widths})
        return [(r, c) for r in rows for c in cols]

    def _step_of(self, key: Hashable) -> Callable[[], None]:
        rows, cols = cast(tuple[int, int], key)
        return lambda: self._decode_step(rows, cols, True)

    # ---- set-up helpers ---------------------------------------------------------------------------

    def _size_cache(self, fraction: float) -> CachePlan:
        """Allocate the whole cache now: `slots` rows of `row_tokens`, within the memory budget on CUDA.
        A model that states no context needs a row length given (EngineError otherwise)."""
        if self.row_tokens >= 2**31:
            raise EngineError(
                "torch engine: the model's config states no max_position_embeddings, so a row's length is "
                "unknown; expected a model config that states its context"
            )
        heads, dim, dtype = self._token_shape()
        token_bytes = self._num_layers() * 2 * heads * dim * dtype.itemsize
        memory = device_memory(self.device)
        plan = plan_cache(self.slots, self.row_tokens, token_bytes, fraction, memory, self._where())
        try:
            self._kv.allocate(plan.columns, heads, dim, dtype)
        except torch.OutOfMemoryError as exc:
            raise EngineError(
                f"torch engine on {self._where()}: allocating its KV cache ({plan.describe()}) ran out of "
                f"memory ({_first_line(exc)}); expected fewer worker.slots or more free GPU memory"
            ) from None
        log.info("torch engine on %s: KV cache %s", self._where(), plan.describe())
        return plan

    def _token_shape(self) -> tuple[int, int, torch.dtype]:
        """(H, D, dtype) of one token's keys in a layer, from a one-token forward through a plain cache."""
        probe = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                use_cache=True,
                **{self._cache_arg: probe},
            )
        keys = getattr(probe.layers[0], "keys", None)  # a DynamicLayer's (`_check_full_attention`)
        assert isinstance(keys, torch.Tensor)
        return int(keys.shape[1]), int(keys.shape[3]), keys.dtype

    def _where(self) -> str:
        if self.device.type == "cuda" and self.device.index is None:
            return f"cuda:{torch.cuda.current_device()}"
        return str(self.device)

    def _logits_width(self) -> int:
        """V: the output head's rows (a padded head may have more than the vocabulary)."""
        head = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]
        return int(head.weight.shape[0]) if head is not None else self.vocab_size

    def _num_layers(self) -> int:
        return int(self.model.config.get_text_config(decoder=True).num_hidden_layers)

    def _check_full_attention(self) -> None:
        probe = DynamicCache(config=self.model.config)
        kinds = {type(layer).__name__ for layer in probe.layers if type(layer) is not DynamicLayer}
        if kinds:
            raise EngineError(
                f"torch engine: model uses {', '.join(sorted(kinds))} cache layers; only full attention "
                "(DynamicLayer) is supported"
            )


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, or of every *.safetensors file in an HF directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"load_weights: directory {str(path)!r} has no *.safetensors file")
    elif path.is_file():
        files = [path]
    else:
        raise WeightLoadError(f"load_weights: {str(path)!r} does not exist")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightLoadError(f"load_weights: cannot read {str(file)!r}: {exc}") from exc
    return state


def _check_state(state: Mapping[str, torch.Tensor], params: dict[str, torch.Tensor], source: str) -> None:
    """`actors.weights_check.check_tensors`, the model's tied tensors found by their shared storage."""
    groups: dict[int | str, list[str]] = {}
    for name, tensor in params.items():  # empty tensors share data_ptr 0 without being tied
        groups.setdefault(tensor.data_ptr() if tensor.numel() else name, []).append(name)
    check_tensors(_specs(state), _specs(params), groups.values(), source)


def _specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(tuple(t.shape), str(t.dtype), t.is_floating_point()) for n, t in tensors.items()}


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The GPU's total and free memory (all processes) and what this process's allocator holds; None off
    CUDA (no budget: host memory is not shared out)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=int(total), free=int(free), held=int(torch.cuda.memory_reserved(device)))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
