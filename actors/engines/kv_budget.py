"""The torch engine's KV cache size, decided once at start: `slots` rows of a full-length sequence each.

Owns the arithmetic and its one-line errors: the bytes one token's keys and values take over all layers,
the budget a memory share gives (on CUDA: `fraction` of the GPU's total memory, less what this process
holds once the weights are loaded, and never more than the GPU has free), and how many full-length rows
it holds. The cache takes only what its rows need, never the whole budget; a budget that holds fewer rows
than the engine has slots is refused, not served with fewer (docs/engines.md says why). Allocates nothing
(`slot_cache` does) and knows no model: the engine measures the token's shape and the device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine import EngineError

GIB = float(2**30)


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A device's memory as one process sees it, in bytes (`torch.cuda.mem_get_info` and the allocator)."""

    total: int
    free: int  # free on the device now, whoever else holds the rest
    held: int  # what this process's allocator holds: the weights, mostly


@dataclass(frozen=True, slots=True)
class CachePlan:
    rows: int  # the engine's slots
    columns: int  # tokens a row holds: a full-length sequence (prompt and response)
    token_bytes: int  # keys and values of one token, all layers
    budget: int  # bytes the memory share allows the cache (0: no budget, on the CPU)

    @property
    def bytes(self) -> int:
        return self.rows * self.columns * self.token_bytes

    def describe(self) -> str:
        size = f"{self.rows} rows x {self.columns:,} tokens, {self.bytes / GIB:.2f} GiB"
        return f"{size} of a {self.budget / GIB:.2f} GiB budget" if self.budget else size


def plan_cache(
    slots: int, columns: int, token_bytes: int, fraction: float, memory: DeviceMemory | None, where: str
) -> CachePlan:
    """`slots` rows of `columns` tokens, checked against `fraction` of `memory` (None: no budget).

    Raises EngineError (one line naming the setting to change) when the budget holds no full-length row,
    fewer rows than `slots`, or more than the device has free."""
    if memory is None:
        return CachePlan(slots, columns, token_bytes, 0)
    row = columns * token_bytes
    budget = int(fraction * memory.total) - memory.held
    share = (
        f"worker.gpu_memory_fraction = {fraction:g} gives it {max(budget, 0) / GIB:.2f} GiB ({fraction:g} of "
        f"{memory.total / GIB:.1f} GiB, less {memory.held / GIB:.2f} GiB this process holds: the weights)"
    )
    rows = f"rows of {columns:,} tokens x {token_bytes:,} B"
    if budget < row:
        raise EngineError(
            f"torch engine on {where}: one of its {rows} needs {row / GIB:.2f} GiB of KV cache and {share}; "
            "expected a larger worker.gpu_memory_fraction"
        )
    fit = budget // row
    if fit < slots:
        raise EngineError(
            f"torch engine on {where}: worker.slots = {slots} {rows} need {slots * row / GIB:.2f} GiB of KV "
            f"cache and {share}; expected worker.slots <= {fit}, or a larger worker.gpu_memory_fraction"
        )
    need = slots * row
    if need > memory.free:
        raise EngineError(
            f"torch engine on {where}: worker.slots = {slots} {rows} need {need / GIB:.2f} GiB of KV cache "
            f"and the GPU has {memory.free / GIB:.2f} GiB free (other processes hold the rest); expected "
            f"worker.slots <= {memory.free // row}, or less of the GPU taken by the others"
        )
    return CachePlan(slots, columns, token_bytes, budget)
