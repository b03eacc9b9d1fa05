"""The built-in `torch` engine: continuous batching over any Hugging Face causal LM, CPU or CUDA.

Owns one model, one batched KV cache and the request table. Token ids only: tokenization, leases and
sockets are the worker's business. Implements `actors.engine.Engine`.

How the batch works (shapes: B active rows, H kv heads, W cache columns in use, D head dim):
- The KV cache is one preallocated buffer per layer, `[slots, H, cap, D]`; rows `[0, B)` are active and
  every row is right-aligned, so the next token of every row is written to the same column `W`. Shorter
  rows are left-padded; a boolean mask `[slots, cap]` marks real tokens, and each row carries its own
  position ids (so RoPE positions ignore the padding). The buffers are handed to the model through a
  `transformers` `Cache` whose layers write in place instead of concatenating.
- A request joins between decode steps: its input minus the last token is prefilled (batched with the
  other newcomers, left-padded) straight into free rows; its last input token is fed by the next decode
  step, which samples its first new token. A finished row leaves by moving the last row into its place.
  When every row has padding in the leading columns, they are cut off.
- Every decode step samples one token for every active row from `logits / temperature`, truncated by
  top-k and top-p, with one seeded `torch.Generator`; so runs are reproducible for the same seed and the
  same sequence of `add`/`step` calls. The reported log-prob is that of the sampled token under the full
  temperature-scaled distribution (`log_softmax(logits / temperature)` in float32, before truncation),
  which is what the learner recomputes. With `greedy=True` (the whole engine) or for a request marked
  `greedy` the token is the argmax and its log-prob is still taken under the configured temperature.
- The sampled stop token is part of the output (as SGLang does) and ends the request with STOP.
  A request whose input plus budget would pass the model's context length (`max_position_embeddings`) has
  its budget clipped to what fits and ends with LENGTH; one whose input already fills the context ends at
  once with LENGTH and no tokens.
- `load_weights` validates the whole state dict before copying anything, then re-prefills the cache of
  every active row with the new weights, so every token generated after the load is exactly the new
  policy's (and carries the new version). `load_tensors` (`actors.engine.TensorLoading`) does the same
  from named tensors in memory: a version received by the collective broadcast.

Does not implement sliding-window or linear-attention layers, beam search or speculative decoding.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from actors.engine import (
    EngineError,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
    admit,
    check_engine_args,
)
from april.hf import load_model, model_context_length
from april.records import FinishReason

PREFILL_TOKENS = 8192  # most (rows x padded length) positions in one prefill forward
MIN_TRIM = 32  # cut leading padding columns only when at least this many are free


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


class _SlotLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # (transformers' __init_subclass__)
    """One layer's KV buffer `[slots, H, cap, D]`; `update` writes in place at the window the engine set.

    Prefill mode (`past == 0`): the new keys go to rows `[row0, row1)` at columns `[col0, col0 + n)` and
    only they are attended to. Decode mode: they go to column `col0 == past` and the layer returns the
    rows' columns `[0, past + 1)`.
    """

    def __init__(self, slots: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.slots = slots
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.row0, self.row1, self.col0, self.past = 0, 0, 0, 0
        self.cap = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def reserve(self, cap: int, like: torch.Tensor | None = None) -> None:
        """Make room for `cap` columns, keeping the contents (the layer allocates on first write)."""
        self.cap = max(self.cap, cap)
        if self.kbuf is not None and self.vbuf is not None and self.kbuf.shape[2] < self.cap:
            shape = (self.slots, self.kbuf.shape[1], self.cap, self.kbuf.shape[3])
            kbuf = self.kbuf.new_zeros(shape)
            vbuf = self.kbuf.new_zeros(shape)
            old = self.kbuf.shape[2]
            kbuf[:, :, :old] = self.kbuf
            vbuf[:, :, :old] = self.vbuf
            self.kbuf, self.vbuf = kbuf, vbuf

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kbuf is None:
            _, heads, _, dim = key_states.shape
            shape = (self.slots, heads, self.cap, dim)
            self.kbuf = key_states.new_zeros(shape)
            self.vbuf = value_states.new_zeros(shape)
        assert self.vbuf is not None
        n = key_states.shape[2]
        rows = slice(self.row0, self.row1)
        self.kbuf[rows, :, self.col0 : self.col0 + n] = key_states
        self.vbuf[rows, :, self.col0 : self.col0 + n] = value_states
        if self.past == 0:
            return key_states, value_states
        return self.kbuf[rows, :, : self.past + n], self.vbuf[rows, :, : self.past + n]

    def get_seq_length(self) -> int:
        return self.past

    def move(self, src: torch.Tensor | slice, dst: torch.Tensor | slice, cols: slice, to: slice) -> None:
        """Copy rows `src`, columns `cols` to rows `dst`, columns `to` (via a copy: ranges may overlap)."""
        for buf in (self.kbuf, self.vbuf):
            if buf is not None:
                buf[dst, :, to] = buf[src, :, cols].clone()

    def scale_rows(self, rows: slice, cols: slice, mask: torch.Tensor) -> None:
        """Zero the padded positions of `rows` (mask `[rows, cols]`): no NaN from fully masked queries."""
        keep = mask[:, None, :, None]
        for buf in (self.kbuf, self.vbuf):
            if buf is not None:
                buf[rows, :, cols] = torch.where(keep, buf[rows, :, cols], 0.0)


class TorchEngine:
    """Continuous batching with a KV cache over a local HF causal LM (see the module docstring)."""

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
        self._stop = set(sampling.stop_token_ids)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(sampling.seed)
        self._pending: list[_Row] = []
        self._done: list[GenerationOutput] = []
        self._rows: list[_Row] = []  # active rows, in batch order
        self._layers = [_SlotLayer(slots) for _ in range(self._num_layers())]
        self._mask = torch.zeros(slots, 0, dtype=torch.bool, device=self.device)  # [slots, cap]
        self._pos = torch.zeros(slots, dtype=torch.long, device=self.device)  # next position per row
        self._width = 0  # W: cache columns in use

    # ---- Engine interface -------------------------------------------------------------------------

    @property
    def placement(self) -> str:
        return str(self.device)

    @property
    def active(self) -> int:
        return len(self._pending) + len(self._rows) + len(self._done)

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        known = {r.request_id for r in (*self._pending, *self._rows)} | {o.request_id for o in self._done}
        inputs = admit("torch engine", self.active, self.slots, requests, known, self.vocab_size)
        now = time.perf_counter()
        for req, ids in zip(requests, inputs, strict=True):
            budget = min(req.max_new_tokens, self.context - len(ids))
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
        self._width = 0
        return out

    def load_weights(self, path: Path, version: int) -> None:
        self._load_state(_read_state(Path(path)), version, repr(str(path)))

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """`actors.engine.TensorLoading`: a version received by the collective broadcast."""
        self._load_state(tensors, version, f"broadcast v{version}")

    @torch.inference_mode()
    def _load_state(self, state: Mapping[str, torch.Tensor], version: int, source: str) -> None:
        """Check the whole state before copying anything (a bad one leaves the old weights serving)."""
        params = self.model.state_dict()
        _check_state(state, params, source)
        for name, tensor in state.items():
            params[name].copy_(tensor)
        self.version = version
        if self._rows:  # recompute every active row's cache with the new weights
            rows, self._rows, self._width = self._rows, [], 0
            self._admit(rows)

    def probe(self) -> None:
        """In-process: it serves as long as this process runs."""

    def close(self) -> None:
        self.abort()
        self._layers = []
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
        """Write the cache of `rows` (all tokens but the last known one) into rows [B, B + b)."""
        fed = [r.fed() for r in rows]
        length = max(len(f) for f in fed)  # L: padded prefill length
        b0, b1 = len(self._rows), len(self._rows) + len(rows)
        if length > self._width:  # shift the running rows right so that everything stays right-aligned
            self._reserve(length + 1)
            shift = length - self._width
            if b0:
                cols, to = slice(0, self._width), slice(shift, length)
                for layer in self._layers:
                    layer.move(slice(0, b0), slice(0, b0), cols, to)
                self._mask[:b0, to] = self._mask[:b0, cols].clone()
                self._mask[:b0, :shift] = False
            self._width = length
        col0 = self._width - length
        self._mask[b0:b1] = False
        self._pos[b0:b1] = torch.tensor([len(f) for f in fed], device=self.device)
        if length > 0:
            ids = torch.zeros(len(rows), length, dtype=torch.long)
            mask = torch.zeros(len(rows), length, dtype=torch.bool)
            for i, f in enumerate(fed):
                if f:
                    ids[i, length - len(f) :] = torch.tensor(f)
                    mask[i, length - len(f) :] = True
            ids, mask = ids.to(self.device), mask.to(self.device)
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            for layer in self._layers:
                layer.row0, layer.row1, layer.col0, layer.past = b0, b1, col0, 0
            self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=Cache(layers=list(self._layers)),
                use_cache=True,
                logits_to_keep=1,
            )
            cols = slice(col0, self._width)
            for layer in self._layers:
                layer.scale_rows(slice(b0, b1), cols, mask)
            self._mask[b0:b1, cols] = mask
        self._rows.extend(rows)

    def _decode(self) -> None:
        """One decode step for every active row: feed its last token, sample the next, retire finished."""
        b, w = len(self._rows), self._width
        self._reserve(w + 1)
        self._mask[:b, w] = True
        for layer in self._layers:
            layer.row0, layer.row1, layer.col0, layer.past = 0, b, w, w
        ids = torch.tensor([r.next_input() for r in self._rows], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=ids[:, None],
            attention_mask=self._mask[:b, : w + 1],
            position_ids=self._pos[:b, None],
            past_key_values=Cache(layers=list(self._layers)),
            use_cache=True,
        )
        self._width = w + 1
        self._pos[:b] += 1
        tokens, logprobs = self._sample(out.logits[:, -1, :])
        finished: list[int] = []
        for i, (row, tok, lp) in enumerate(zip(self._rows, tokens.tolist(), logprobs.tolist(), strict=True)):
            row.token_ids.append(tok)
            row.logprobs.append(lp)
            row.versions.append(self.version)
            if tok in self._stop:
                self._done.append(row.output(FinishReason.STOP))
                finished.append(i)
            elif len(row.token_ids) >= row.budget:
                self._done.append(row.output(FinishReason.LENGTH))
                finished.append(i)
        if finished:
            self._retire(finished)

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `[B]` and their log-probs `[B]` (float32) under log_softmax(logits / temperature)."""
        scaled = logits.float() / self.sampling.temperature  # [B, V]
        logp = torch.log_softmax(scaled, dim=-1)
        greedy = [self.greedy or row.greedy for row in self._rows]  # [B]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(_truncate(scaled, self.sampling.top_k, self.sampling.top_p), dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self._gen).squeeze(1)
            if any(greedy):
                mask = torch.tensor(greedy, device=tokens.device)
                tokens = torch.where(mask, logits.argmax(dim=-1), tokens)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)

    def _retire(self, finished: list[int]) -> None:
        """Remove finished rows (move the last row into each hole) and cut shared leading padding."""
        w = self._width
        for i in sorted(finished, reverse=True):
            last = len(self._rows) - 1
            if i != last:
                for layer in self._layers:
                    layer.move(slice(last, last + 1), slice(i, i + 1), slice(0, w), slice(0, w))
                self._mask[i, :w] = self._mask[last, :w]
                self._pos[i] = self._pos[last]
                self._rows[i] = self._rows[last]
            self._rows.pop()
        b = len(self._rows)
        if b == 0:
            self._width = 0
            return
        used = self._mask[:b, :w].any(dim=0).nonzero()
        lead = int(used[0, 0]) if used.numel() else w
        if lead >= MIN_TRIM and lead * 4 >= w:
            keep, to = slice(lead, w), slice(0, w - lead)
            for layer in self._layers:
                layer.move(slice(0, b), slice(0, b), keep, to)
            self._mask[:b, to] = self._mask[:b, keep].clone()
            self._width = w - lead

    def _reserve(self, cap: int) -> None:
        """Room for `cap` cache columns (grows by doubling, so a long run reallocates rarely)."""
        have = self._mask.shape[1]
        if cap <= have:
            return
        new_cap = max(cap, 2 * have, 64)
        mask = torch.zeros(self.slots, new_cap, dtype=torch.bool, device=self.device)
        mask[:, :have] = self._mask
        self._mask = mask
        for layer in self._layers:
            layer.reserve(new_cap)

    # ---- set-up helpers ---------------------------------------------------------------------------

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


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf the logits outside the top-k and outside the smallest top-p nucleus. `[B, V]`."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, index = scaled.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each token
        ordered = ordered.masked_fill(before > top_p, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, index, ordered)
    return scaled


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
    """Raise WeightLoadError unless `state` covers the model's parameters with the right shapes.

    A parameter tied to another (same storage, e.g. lm_head and the embedding) may be missing as long as
    one of its group is present, as `save_pretrained` writes it.
    """
    unexpected = sorted(set(state) - set(params))
    if unexpected:
        raise WeightLoadError(
            f"load_weights: {source} has {len(unexpected)} unexpected tensors, e.g. {unexpected[0]!r}"
        )
    groups: dict[int | str, list[str]] = {}
    for name, tensor in params.items():  # empty tensors share data_ptr 0 without being tied
        groups.setdefault(tensor.data_ptr() if tensor.numel() else name, []).append(name)
    for names in groups.values():
        if not any(n in state for n in names):
            raise WeightLoadError(f"load_weights: {source} lacks tensor {names[0]!r}")
    for name, tensor in state.items():
        want = params[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise WeightLoadError(
                f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want.shape)}"
            )
        if not tensor.is_floating_point() and want.is_floating_point():
            raise WeightLoadError(f"load_weights: {name!r} has dtype {tensor.dtype}, expected floating point")
