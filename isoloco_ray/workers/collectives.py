"""The torch.distributed collectives of the outer sync, bucketed, with their traffic counted.

Bytes are counted under DESIGN.md's cost model (S = a tensor's bytes as sent, W = ranks):
all-reduce 2(W-1)/W·S received per rank, all-gather (W-1)·S (S = one rank's part). With one
rank (or no process group) every collective is the identity and moves nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 1024 * 1024


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES
            ) -> Iterator[list[int]]:
    """Indices of `tensors` grouped into runs of at most `bucket_bytes` (a bigger tensor alone).

    Few large collectives beat one per tensor: a Llama has many small norm weights.
    """
    current: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        yield current


class TrafficCounter:
    """Bytes this rank received in collectives since the last `take()`."""

    def __init__(self) -> None:
        self.received = 0

    def take(self) -> int:
        """Return the count and reset it."""
        received, self.received = self.received, 0
        return received


def all_reduce_sum(tensors: Sequence[torch.Tensor], traffic: TrafficCounter) -> None:
    """Sum each tensor over all ranks, in place, in flattened buckets."""
    ranks = world_size()
    if ranks == 1:
        return
    for index in buckets(tensors):
        group = [tensors[i] for i in index]
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        traffic.received += int(2 * (ranks - 1) / ranks * flat.numel() * flat.element_size())
        offset = 0
        for t in group:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def all_gather_stacked(local: Sequence[torch.Tensor], traffic: TrafficCounter
                       ) -> list[torch.Tensor]:
    """Every rank's `local` tensors (same count and shapes on every rank), in rank order."""
    ranks = world_size()
    if ranks == 1:
        return list(local)
    stacked = torch.stack(list(local))
    parts = [torch.empty_like(stacked) for _ in range(ranks)]
    dist.all_gather(parts, stacked)
    traffic.received += (ranks - 1) * stacked.numel() * stacked.element_size()
    return [t for part in parts for t in part.unbind(0)]


def all_reduce_scalars(values: Sequence[float], device: torch.device) -> list[float]:
    """Sum a few float64 scalars over all ranks (metrics; not counted as outer traffic)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    if world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_gather_strings(value: str) -> list[str]:
    """Every rank's `value`, in rank order (small control messages, not outer traffic)."""
    if world_size() == 1:
        return [value]
    values: list[str] = [""] * world_size()
    dist.all_gather_object(values, value)
    return values
