"""The simulation engine: no model, a cost model of a GPU inference engine for planning and benchmarks.

Owns: when each simulated request finishes and what it generates. Each decode step takes the time
`april.sim.engine_cost.EngineCost` gives (the one cost model, which `april simulate` also uses): a fixed
part, a part per active request, and the prefill of every input token newly admitted in that step.
Response lengths are drawn per sample from a `LengthSpec` (actors/lengths.py), reproducibly from
(seed, sample identity); an episode's turns (`plans`, env.name = "sim") take their lengths from the
sample's episode plan (`april.sim.episode_plans`, the one `april simulate --episodes` draws), the
identify hook saying where in its episode the sample stands.

It obeys the same abort / resume / weights semantics as the real engines: `abort` returns partials at
once; a resumed sample (input = prompt + partial, budget reduced) keeps its drawn total length and
continues the very same token sequence; tokens generated after `load_weights` carry the new version.

Sample identity (what makes a resume keep its length). A `GenerationRequest` carries only the lease id
(new on every resume) and the input ids (prompt + partial, inseparable without the prompt length), so:
  - `identify` hook (the way a worker runs it): a callable the worker builds from its lease table,
    returning `SampleIdentity(key, prompt_len)`, with `key` stable for a sample (e.g. from group id and
    index). Resumes keep their length on any worker, in any process.
  - no hook: a fresh request is identified by (lease id, input), and every aborted request is remembered
    under the digest of `input + partial`, so resuming it *on this engine* is recognised. Resuming on
    another process draws a new length: use the hook for resume hand-off across workers.

Prefix cache (`april.sim.prefix_cache`, `cost.prefix_cache_tokens` of capacity): an aborted request leaves
its prefix behind, and a resume of the same sample on this engine prefills only what the cache no longer
holds. `keep_kv_across_updates` (worker.resume_kv = "reuse") keeps the cache across `load_weights`;
otherwise a load empties it, as SGLang and vLLM do. `reprefill_tokens` / `reprefill_s` count what resumes
re-prefilled (tokens, model seconds), `elapsed_s` all the model time, for the re-prefill share;
`stale_kv_tokens` the tokens drawn while attending to KV of older weights than the loaded ones.

Time: `elapsed_s` accumulates model time (seconds a real GPU would spend). With `sleep=True` steps keep
to a wall-clock schedule of `model time x time_scale` (sleeping what is left of each step; the caller's
work between steps is absorbed, as a GPU's host overhead), so a worker driving it behaves like a real
engine (`time_scale=1e-3` runs a 16k-token tail in seconds); `sleep=False` is for virtual-time simulation.

Tokens are deterministic pseudo-random ids in [3, vocab_size) (0..2 are reserved: pad, bos, eos); a
response that reaches its drawn length ends with `stop_token_id`. Log-probs are in [-1, -0.5]. Sampling
settings do not apply, nor does a request's `greedy` flag: a sample's tokens depend on its identity only,
which is already what greedy decoding gives (the same response every time).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from actors.engine import EngineError, GenerationOutput, GenerationRequest, WeightLoadError, admit
from actors.lengths import LengthSpec
from april.records import FinishReason
from april.sim.engine_cost import EngineCost
from april.sim.episode_plans import EpisodePlans
from april.sim.prefix_cache import PrefixCache
from april.sim.sample_draw import LengthDraw, sample_key
from april.sim.sample_draw import mix as _mix
from april.sim.sample_draw import splitmix64 as _splitmix64

MAX_LAG_S = 0.05  # wall seconds a sleeping engine may fall behind its schedule and still catch up
_MEMO_LIMIT = 65536  # aborted requests remembered for same-engine resume (no identify hook)


@dataclass(frozen=True, slots=True)
class SampleIdentity:
    """What the sim engine needs to know about the sample behind a request."""

    key: int  # stable across resumes of one sample (any int; hashed with the seed)
    prompt_len: int  # input_ids[:prompt_len] is the prompt, the rest is the response so far
    prompt: int = 0  # the prompt's identity (april.sim.sample_draw.prompt_key; 0: unknown)
    model_tokens: int = 0  # an episode's: the response's tokens the model generated (observations not)
    calls: int = 0  # an episode's: the tool calls answered so far (its turn is the next one)
    unseen: int = 0  # an episode's: input tokens at its end no engine computed (an answer appended since)

    @staticmethod
    def of_sample(group_id: int, index: int, prompt_len: int, prompt: int = 0) -> SampleIdentity:
        """The identity of sample (group_id, index) of a prompt of `prompt_len` tokens whose identity is
        `prompt` (april.sim.sample_draw.prompt_key): what a worker's `identify` hook returns."""
        return SampleIdentity(sample_key(group_id, index), prompt_len, prompt)


Identify = Callable[[GenerationRequest], SampleIdentity]


def _digest(ids: npt.NDArray[np.int32]) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=16).digest()


@dataclass(slots=True)
class _Running:
    request_id: int
    identity: SampleIdentity
    drawn_len: int  # total response length drawn for this sample
    input_ids: npt.NDArray[np.int32]
    token_ids: npt.NDArray[np.int32]  # everything this request will generate, precomputed
    logprobs: npt.NDArray[np.float32]
    finish: FinishReason  # reason once all of token_ids are out
    started_s: float
    prefill_tokens: int  # input tokens still to prefill (paid in the first step)
    reprefill: int  # of those, what an engine had computed before (the resume hand-off cost)
    cached: int  # input tokens whose KV the prefix cache gave back
    kv_version: int  # weights version of the oldest KV this request attends to
    keeps_kv: bool = False  # an episode's turn whose step follows: its context's KV stays when it ends
    prefilled: bool = False  # the first step ran: the KV of the whole input exists
    produced: int = 0
    marks: list[tuple[int, int]] = field(default_factory=list)  # (produced, version) at each change

    def output(self, reason: FinishReason, now_s: float) -> GenerationOutput:
        n = self.produced
        versions = np.empty(n, dtype=np.int32)
        bounds = [*self.marks[1:], (n, -1)]
        for (start, version), (end, _) in zip(self.marks, bounds, strict=True):
            versions[start:end] = version
        return GenerationOutput(
            request_id=self.request_id,
            token_ids=self.token_ids[:n].copy(),
            logprobs=self.logprobs[:n].copy(),
            versions=versions,
            finish_reason=reason,
            stats={"drawn_len": float(self.drawn_len), "sim_time_s": now_s - self.started_s},
        )


class SimEngine:
    """A cost-model engine (see the module docstring). Implements actors.engine.Engine."""

    name = "sim"
    can_reuse_kv = True  # a prefix cache kept across load_weights is a setting (keep_kv_across_updates)

    def __init__(
        self,
        lengths: LengthSpec | str,
        *,
        slots: int = 8,
        seed: int = 0,
        cost: EngineCost | None = None,
        time_scale: float = 1.0,
        sleep: bool = True,
        vocab_size: int = 32000,
        stop_token_id: int = 2,
        version: int = 0,
        identify: Identify | None = None,
        prompt_corr: float = 0.0,
        keep_kv_across_updates: bool = False,
        plans: EpisodePlans | None = None,
    ) -> None:
        if slots < 1:
            raise EngineError(f"sim engine: slots = {slots}, expected >= 1")
        if vocab_size < 8 or not 0 <= stop_token_id < vocab_size:
            raise EngineError(
                f"sim engine: vocab_size {vocab_size} / stop_token_id {stop_token_id} out of range"
            )
        if time_scale < 0:
            raise EngineError(f"sim engine: time_scale = {time_scale}, expected >= 0")
        self.lengths = LengthSpec.parse(lengths) if isinstance(lengths, str) else lengths
        if not 0.0 <= prompt_corr < 1.0:
            raise EngineError(f"sim engine: prompt_corr = {prompt_corr}, expected a number in [0, 1)")
        self._draw = LengthDraw(self.lengths, seed, prompt_corr)
        self.plans = plans  # episodes: each turn's length from the sample's plan (identify hook needed)
        self.slots = slots
        self.version = version
        self.seed = seed
        self.cost = cost or EngineCost()
        self.time_scale = time_scale
        self.sleep = sleep
        self.vocab_size = vocab_size
        self.stop_token_id = stop_token_id
        self.identify = identify
        self.elapsed_s = 0.0  # model time
        self.steps = 0
        self._running: dict[int, _Running] = {}
        self._ready: list[GenerationOutput] = []
        self._memo: OrderedDict[bytes, SampleIdentity] = OrderedDict()
        self._wall_due = 0.0
        self.cache = PrefixCache(self.cost.prefix_cache_tokens, keep_kv_across_updates, version)
        self.reprefill_tokens = 0  # input tokens re-prefilled by resumed requests (what the cache missed)
        self.reprefill_s = 0.0  # their share of elapsed_s (model time)
        self.stale_kv_tokens = 0  # tokens generated attending to KV of older weights than the loaded ones

    @property
    def placement(self) -> str:
        return "sim"  # a cost model: no device

    @property
    def active(self) -> int:
        return len(self._running) + len(self._ready)

    def drawn_length(self, key: int, prompt: int = 0) -> int:
        """The total response length of the sample with identity `key` (of prompt `prompt`) under this
        engine's seed."""
        return self._draw(key, prompt)

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        admit(
            "sim engine",
            self.active,
            self.slots,
            requests,
            set(self._running) | {o.request_id for o in self._ready},
        )
        if not self.active:  # busy again after idling: the wall-clock schedule starts now
            self._wall_due = time.monotonic()
        for req in requests:
            if req.max_new_tokens < 0:
                raise EngineError(
                    f"sim engine: request {req.request_id} max_new_tokens {req.max_new_tokens} < 0"
                )
            self._start(req)

    def _identity(self, req: GenerationRequest, ids: npt.NDArray[np.int32]) -> SampleIdentity:
        if self.identify is not None:
            ident = self.identify(req)
            if not 0 < ident.prompt_len <= len(ids):
                raise EngineError(
                    f"sim engine: request {req.request_id} prompt_len {ident.prompt_len}, "
                    f"expected 1..{len(ids)} (input length)"
                )
            return ident
        digest = _digest(ids)
        known = self._memo.pop(digest, None)
        if known is not None:
            return known
        return SampleIdentity(_mix(req.request_id, int.from_bytes(digest[:8], "little")), len(ids))

    def _start(self, req: GenerationRequest) -> None:
        ids = np.asarray(req.input_ids, dtype=np.int32)
        ident = self._identity(req, ids)
        done = len(ids) - ident.prompt_len  # response tokens before this request (observations too)
        plan = self.plans.of_key(ident.key) if self.plans is not None else None
        if plan is not None:  # the tokens its current turn has left in the sample's episode
            _, left = plan.turn_of(ident.model_tokens, ident.calls)
            drawn = done + left
        else:
            drawn = self.drawn_length(ident.key, ident.prompt)
            left = drawn - done
        n = max(0, min(left, req.max_new_tokens))
        finish = FinishReason.STOP if left <= req.max_new_tokens else FinishReason.LENGTH
        tokens, logprobs = self._tokens(ident.key, done, n, stops=finish == FinishReason.STOP)
        hit = self.cache.take(ident.key, len(ids)) if n else None  # only a request that runs takes it
        cached = hit.tokens if hit else 0
        seen = len(ids) - ident.unseen if done else 0  # what an engine had computed of this input
        run = _Running(
            request_id=req.request_id,
            identity=ident,
            drawn_len=drawn,
            input_ids=ids,
            token_ids=tokens,
            logprobs=logprobs,
            finish=finish,
            started_s=self.elapsed_s,
            prefill_tokens=len(ids) - cached,
            reprefill=max(0, seen - cached),
            cached=cached,
            kv_version=min(hit.kv_version, self.version) if hit and cached else self.version,
            keeps_kv=plan is not None and not plan.ends_after(ident.calls),
            marks=[(0, self.version)],
        )
        if req.max_new_tokens == 0:
            self._ready.append(run.output(FinishReason.LENGTH, self.elapsed_s))
        elif n == 0:  # already at (or past) its drawn length: nothing more to say
            self._ready.append(run.output(FinishReason.STOP, self.elapsed_s))
        else:
            self._running[req.request_id] = run

    def _tokens(
        self, key: int, start: int, n: int, stops: bool
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        """Response tokens at positions start..start+n-1 of sample `key`: a function of position only,
        so a resumed sample continues exactly where it stopped."""
        pos = np.arange(start, start + n, dtype=np.uint64)
        h = _splitmix64(pos ^ np.uint64(_mix(self.seed, key)))
        tokens = (np.uint64(3) + h % np.uint64(self.vocab_size - 3)).astype(np.int32)
        tokens[tokens == self.stop_token_id] = 3 if self.stop_token_id != 3 else 4
        if stops and n:
            tokens[-1] = self.stop_token_id
        u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return tokens, (-0.5 - 0.5 * u).astype(np.float32)

    def step(self) -> list[GenerationOutput]:
        out, self._ready = self._ready, []
        if not self._running:
            return out
        prefill = reprefill = 0
        for run in self._running.values():
            prefill += run.prefill_tokens
            reprefill += run.reprefill
            run.prefill_tokens = run.reprefill = 0
            run.prefilled = True
            self.stale_kv_tokens += run.kv_version < self.version
        self.reprefill_tokens += reprefill
        self.reprefill_s += self.cost.prefill_s(reprefill)
        self._advance(self.cost.step_s(len(self._running), prefill))
        self.steps += 1
        finished = []
        for run in self._running.values():
            run.produced += 1
            if run.produced == len(run.token_ids):
                finished.append(run)
        for run in finished:
            del self._running[run.request_id]
            out.append(run.output(run.finish, self.elapsed_s))
            if run.keeps_kv and run.finish == FinishReason.STOP:  # its step follows: the context stays
                self.cache.store(run.identity.key, len(run.input_ids) + run.produced, run.kv_version)
        return out

    def _advance(self, model_s: float) -> None:
        """Account `model_s` of model time; with sleep, keep wall time at model time x time_scale."""
        self.elapsed_s += model_s
        if not self.sleep or self.time_scale == 0:
            return
        now = time.monotonic()
        # a schedule, not a sleep per step: the caller's own time between steps (reading messages,
        # scoring) is absorbed as a GPU's host overhead is, and sleep overshoot is paid back next step;
        # a caller starved of CPU catches up by at most MAX_LAG_S (no burst of a backlog)
        self._wall_due = max(self._wall_due, now - MAX_LAG_S) + model_s * self.time_scale
        if self._wall_due - now > 2e-4:  # sub-0.2 ms sleeps are mostly overhead: let the debt accrue
            time.sleep(self._wall_due - now)

    def abort(self) -> list[GenerationOutput]:
        out, self._ready = self._ready, []
        for run in self._running.values():
            out.append(run.output(FinishReason.ABORT, self.elapsed_s))
            # its KV stays on the engine: all of it once prefilled, else only what the cache gave back
            kv = len(run.input_ids) + run.produced if run.prefilled else run.cached
            self.cache.store(run.identity.key, kv, run.kv_version)
            if self.identify is None:
                resumed_input = np.concatenate([run.input_ids, run.token_ids[: run.produced]])
                self._memo[_digest(resumed_input)] = run.identity
                while len(self._memo) > _MEMO_LIMIT:
                    self._memo.popitem(last=False)
        self._running.clear()
        return out

    def load_weights(self, path: Path | str, version: int) -> None:
        """Record `version`, in no model time (as the simulator's engines: the cost model has no load
        term). `path` may be "", "sim://..." (no file) or an existing path; anything else raises
        WeightLoadError, as does a version older than the one loaded."""
        text = str(path)
        if not (text in ("", ".") or text.startswith("sim:") or Path(text).exists()):
            raise WeightLoadError(
                f"sim engine: weights path {text} does not exist (use '' or sim:// for none)"
            )
        if version < self.version:
            raise WeightLoadError(f"sim engine: weights version {version} older than loaded {self.version}")
        if version == self.version:
            return
        self.version = version
        self.cache.update(version)
        for run in self._running.values():
            if run.marks[-1][0] == run.produced:
                run.marks[-1] = (run.produced, version)
            else:
                run.marks.append((run.produced, version))

    def probe(self) -> None:
        """In-process: it serves as long as this process runs."""

    def close(self) -> None:
        self._running.clear()
        self._ready.clear()
        self._memo.clear()
