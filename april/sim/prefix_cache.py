"""One engine's prefix cache as the cost model sees it: which interrupted samples' KV it still holds.

Owns the rule both simulated engines follow (the sim engine a worker runs, `actors.engines.sim_engine`,
and the simulator's, `broker.sim.engines`), so that they charge a resume the same prefill:
  - capacity in tokens (`EngineCost.prefix_cache_tokens`): the KV pool a real engine keeps for sequences
    that are no longer running (SGLang's radix cache, vLLM's prefix cache);
  - a sample that leaves the engine interrupted leaves its prefix (prompt + response so far) behind, as
    the most recently used entry; entries are evicted least recently used first until the total fits;
  - a resumed sample that finds its prefix on the engine it is leased to re-prefills only the rest; the
    entry leaves the cache (its KV is the running sequence's again);
  - a weight update: `ResumeKV.RECOMPUTE` (what SGLang and vLLM do: SGLang's
    `WeightUpdater.flush_cache_after_weight_update`, vLLM's `reset_prefix_cache`) drops every entry, and
    a prefix whose KV was computed under older weights is never stored; `ResumeKV.REUSE` keeps them, so a
    resume after the update attends to KV of the old weights.

Keys are whatever identifies a sample across its resumes (the sim engine's `SampleIdentity.key`, the
simulator's (group id, index)). Not modelled: prompt sharing between the samples of a group (a radix
tree would serve the common prompt to all of them), finished sequences occupying the pool, and the KV of
running sequences competing with the cache for memory (the capacity is what is left beside them).

Does not own time: the engines turn the uncached tokens into prefill milliseconds (`EngineCost`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """What a cache hit gives back: `tokens` of KV, the oldest of them computed under `kv_version`."""

    tokens: int
    kv_version: int


MISS = CachedPrefix(0, 0)


class PrefixCache:
    """An LRU of interrupted samples' prefixes, `capacity` tokens in all (see the module docstring)."""

    def __init__(self, capacity: int, keep_across_updates: bool, version: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"prefix cache: capacity = {capacity}, expected tokens >= 0")
        self.capacity = capacity
        self.keep_across_updates = keep_across_updates
        self.version = version  # weights loaded on the engine now
        self.tokens = 0  # held, all entries
        self._entries: OrderedDict[Hashable, CachedPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def store(self, key: Hashable, tokens: int, kv_version: int) -> None:
        """A sample left the engine holding `tokens` of KV, the oldest computed under `kv_version`. Under
        recompute, KV older than the loaded weights is dropped (a resume must not attend to it)."""
        self.discard(key)
        if tokens <= 0 or tokens > self.capacity:
            return
        if kv_version < self.version and not self.keep_across_updates:
            return
        self._entries[key] = CachedPrefix(tokens, kv_version)
        self.tokens += tokens
        while self.tokens > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= evicted.tokens

    def take(self, key: Hashable, input_tokens: int) -> CachedPrefix:
        """A resume of `key` with `input_tokens` of input starts here: the cached part of its input (never
        more than the input), which leaves the cache; MISS when none."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return MISS
        self.tokens -= entry.tokens
        return CachedPrefix(min(entry.tokens, input_tokens), entry.kv_version)

    def discard(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.tokens -= entry.tokens

    def update(self, version: int) -> None:
        """Weights `version` were loaded: flush unless the cache is kept across updates."""
        if version <= self.version:
            return
        self.version = version
        if not self.keep_across_updates:
            self._entries.clear()
            self.tokens = 0
