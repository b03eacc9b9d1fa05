"""The simulated GPU inference engine's cost model: how long one decode step takes.

Owns `EngineCost`, the one record of the step cost and its defaults, and the step-time formula. Two
things simulate an engine and both read it, so `april up --engine sim` and `april simulate` model the
same machine:
  - the sim engine a worker runs (`actors.engines.sim_engine`, built from `worker.sim_decode_ms`,
    `worker.sim_decode_ms_per_seq` and `worker.sim_prefill_ms_per_token`, whose defaults are these);
  - the simulator's engines (`broker.sim.engines`), for `april simulate` and `april bench`'s prediction
    (their `--decode-ms`, `--decode-ms-per-seq`, `--prefill-ms-per-token` default to these too).

The formula, in milliseconds of model time (what a real GPU would spend; the sim engine scales it to
wall time by `worker.sim_time_scale`, the simulator keeps it virtual):

    step_ms = decode_ms + decode_ms_per_seq x active + prefill_ms_per_token x prefill_tokens

`active` is the number of sequences decoded in the step (each produces one token); `prefill_tokens` the
input tokens admitted since the previous step and prefilled in this one: a fresh sample's prompt, or the
part of a resumed partial's prompt + response so far that the engine's prefix cache no longer holds
(`april.sim.prefix_cache`, `prefix_cache_tokens` of capacity; under `worker.resume_kv = "recompute"`, what
real engines do, a weight update empties it, so a partial resumed in a later round re-prefills all of it).
Decode on a GPU is memory-bound, so `decode_ms` dominates and a step at 64 sequences costs about twice one
at 1.

Does not own: when a sequence finishes, what it generates, or any clock: the two engines do that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineCost:
    """One decode step's cost, in ms (see the module docstring for the formula).

    The defaults are of the order of a 4B model on one H100-class GPU (bf16, CUDA graphs): 6 ms a step
    at batch 1, about 12 ms at 64 sequences, prefill about 50k tokens/s. They are the setting every
    shipped `april bench --engine sim` run (docs/bench/) and the README's `april simulate` table used."""

    decode_ms: float = 6.0  # A: the fixed part of a decode step, ms
    decode_ms_per_seq: float = 0.1  # B: added per active sequence, ms
    prefill_ms_per_token: float = 0.02  # C: per input token prefilled (prompt, or prompt + partial), ms
    # KV tokens an engine keeps for interrupted samples (april.sim.prefix_cache). A 4B model's KV (Qwen3-4B:
    # 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes) is 144 KiB a token; an 80 GB H100 with ~8 GB of
    # weights and ~60 GB for the KV pool holds ~420k tokens, of which 400k is the round figure taken here
    prefix_cache_tokens: int = 400_000

    def __post_init__(self) -> None:
        for name in ("decode_ms", "decode_ms_per_seq", "prefill_ms_per_token"):
            value = getattr(self, name)
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"engine cost: {name} = {value!r}, expected a number of ms >= 0")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"engine cost: prefix_cache_tokens = {self.prefix_cache_tokens}, expected >= 0")

    def step_ms(self, active: int, prefill_tokens: int = 0) -> float:
        """Model time of one decode step over `active` sequences that also prefills `prefill_tokens`."""
        return self.decode_ms + self.decode_ms_per_seq * active + self.prefill_ms_per_token * prefill_tokens

    def step_s(self, active: int, prefill_tokens: int = 0) -> float:
        """`step_ms` in seconds."""
        return self.step_ms(active, prefill_tokens) / 1000.0

    def prefill_s(self, tokens: int) -> float:
        """The prefill part of a step's time for `tokens` input tokens, in seconds."""
        return self.prefill_ms_per_token * tokens / 1000.0


DEFAULT_COST = EngineCost()
