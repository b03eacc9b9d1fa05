"""What several learner ranks share each step: the batch (rank 0 receives it, the others get a copy), the
step's statistics and each sample's figures (summed over ranks).

Only rank 0 talks to the broker. It sends every other rank the batch message in april's own wire
encoding (`april.protocol`: a msgpack header plus raw numpy frames), never pickle: the bytes came from
a peer, and the other ranks decode them with the same validating codec rank 0 used. A zero-length
broadcast means "stop": rank 0 got a stop signal or the broker went away.

With one process (no process group, or a group of one) every function here is a no-op.
Does not own the training step, the broker client or the process group set-up (`learner.engine`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from april import protocol

if TYPE_CHECKING:
    import torch

    from learner.losses import DeviceStats  # imports torch: the simulated learner's loop must not

MAX_FRAMES = 1024  # a Batch message has a header and one frame per SampleBatch column: far fewer


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _device() -> torch.device:
    """Where collectives run: the current CUDA device under NCCL, the CPU under gloo."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_batch(batch: protocol.Batch | None, max_bytes: int) -> protocol.Batch | None:
    """Rank 0 passes the batch it received (None: stop); every rank returns the same batch (or None)."""
    import torch
    import torch.distributed as dist

    rank, world = _world()
    if world == 1:
        return batch
    device = _device()
    sizes = torch.zeros(MAX_FRAMES + 1, dtype=torch.int64, device=device)  # [count, len_0, len_1, ...]
    payload = b""
    if rank == 0 and batch is not None:
        frames = [bytes(f) for f in protocol.encode(batch)]
        if len(frames) > MAX_FRAMES:
            raise ValueError(f"a batch message of {len(frames)} frames; at most {MAX_FRAMES} are shared")
        sizes[0] = len(frames)
        sizes[1 : len(frames) + 1] = torch.tensor([len(f) for f in frames], dtype=torch.int64)
        payload = b"".join(frames)
    dist.broadcast(sizes, src=0)
    count = int(sizes[0])
    if count == 0:
        return None
    lengths = sizes[1 : count + 1].tolist()
    buffer = torch.zeros(sum(lengths), dtype=torch.uint8, device=device)
    if rank == 0:
        buffer.copy_(torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()))
    dist.broadcast(buffer, src=0)
    if rank == 0:
        return batch
    data = buffer.cpu().numpy().tobytes()
    frames, offset = [], 0
    for n in lengths:
        frames.append(data[offset : offset + n])
        offset += n
    msg = protocol.decode(frames, max_bytes)
    if not isinstance(msg, protocol.Batch):
        raise ValueError(f"rank {rank}: rank 0 shared a {type(msg).__name__}, expected a Batch")
    return msg


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over all ranks (a copy on the collectives' device; `values` itself with one)."""
    import torch.distributed as dist

    _, world = _world()
    if world == 1:
        return values
    summed = values.to(_device(), copy=True)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed


def reduce_stats(stats: DeviceStats) -> DeviceStats:
    """The step's statistics over all ranks, on the device: sums add, `*_max` fields take the maximum."""
    import torch.distributed as dist

    from learner.losses import MAX_INDEX, SUM_INDEX, DeviceStats

    _, world = _world()
    if world == 1:
        return stats
    values = stats.values.to(_device())
    summed, peaked = values[SUM_INDEX], values[MAX_INDEX]
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(peaked, op=dist.ReduceOp.MAX)
    values[SUM_INDEX], values[MAX_INDEX] = summed, peaked
    return DeviceStats(values)
