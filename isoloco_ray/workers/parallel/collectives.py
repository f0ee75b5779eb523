"""The torch.distributed collectives of the outer sync, on flat buffers, with their traffic counted.

Bytes are counted under the cost model of docs/design.md (S = a tensor's bytes as sent, W =
ranks in the group): all-reduce 2(W-1)/W·S received per rank, all-gather (W-1)·S (S = one
rank's part), broadcast S at every non-root, all-to-all the payloads that come from other
ranks. With one rank (or no process group) every collective is the identity and moves nothing.

`group` is a torch.distributed process group; None means the default (whole-world) group.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 1024 * 1024

Group = dist.ProcessGroup | None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group: Group = None) -> int:
    """Ranks in `group` (1 without a process group)."""
    return dist.get_world_size(group) if _distributed() else 1


def group_rank(group: Group = None) -> int:
    """This process's rank within `group` (0 without a process group)."""
    return dist.get_rank(group) if _distributed() else 0


def _global_rank(group: Group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def buckets(sizes: Sequence[int], bucket_bytes: int = BUCKET_BYTES) -> Iterator[list[int]]:
    """Indices of items of `sizes` bytes grouped into runs of at most `bucket_bytes` (a bigger
    item alone), in order.

    Few large collectives beat one per tensor: a Llama has many small norm weights.
    """
    current: list[int] = []
    total = 0
    for i, nbytes in enumerate(sizes):
        if current and total + nbytes > bucket_bytes:
            yield current
            current, total = [], 0
        current.append(i)
        total += nbytes
    if current:
        yield current


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device
            ) -> torch.Tensor:
    """The tensors' values, cast to `dtype`, one after another in a 1-D tensor."""
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of `flat` with the given shapes, one after another (the inverse of `flatten`)."""
    out, offset = [], 0
    for shape in shapes:
        count = shape.numel()
        out.append(flat[offset: offset + count].view(shape))
        offset += count
    return out


class TrafficCounter:
    """Bytes this rank received in collectives since the last `take()`."""

    def __init__(self) -> None:
        self.received = 0

    def take(self) -> int:
        """Return the count and reset it."""
        received, self.received = self.received, 0
        return received


def all_reduce_sum(tensors: Sequence[torch.Tensor], traffic: TrafficCounter,
                   group: Group = None, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum each tensor over the group's ranks, in place, in flattened buckets."""
    ranks = group_size(group)
    if ranks == 1 or not tensors:
        return
    for index in buckets([t.numel() * t.element_size() for t in tensors], bucket_bytes):
        chunk = [tensors[i] for i in index]
        flat = flatten(chunk, chunk[0].dtype, chunk[0].device)
        start_all_reduce(flat, traffic, group).wait()
        for t, summed in zip(chunk, unflatten(flat, [t.shape for t in chunk])):
            t.copy_(summed)


def start_all_reduce(flat: torch.Tensor, traffic: TrafficCounter, group: Group = None
                     ) -> dist.Work:
    """Start summing `flat` over the group's ranks, in place (more than one rank); the sum is
    there once the returned work's wait() returns."""
    ranks = group_size(group)
    work = dist.all_reduce(flat, group=group, async_op=True)
    traffic.received += int(2 * (ranks - 1) / ranks * flat.numel() * flat.element_size())
    return work


def all_gather_flat(local: torch.Tensor, traffic: TrafficCounter, group: Group = None
                    ) -> list[torch.Tensor]:
    """Every rank's 1-D `local` (the same size on every rank), in group-rank order."""
    ranks = group_size(group)
    if ranks == 1:
        return [local]
    parts = [torch.empty_like(local) for _ in range(ranks)]
    dist.all_gather(parts, local, group=group)
    traffic.received += (ranks - 1) * local.numel() * local.element_size()
    return parts


def all_to_all_flat(outgoing: Sequence[torch.Tensor], incoming_sizes: Sequence[int],
                    traffic: TrafficCounter, group: Group = None) -> list[torch.Tensor]:
    """Send outgoing[k] (1-D) to group rank k; return what each rank sent here, in rank order
    (incoming_sizes[k] elements from rank k). What a rank sends itself is not traffic."""
    ranks, me = group_size(group), group_rank(group)
    if ranks == 1:
        return [outgoing[0]]
    send = torch.cat(list(outgoing))
    receive = send.new_empty(sum(incoming_sizes))
    dist.all_to_all_single(receive, send, list(incoming_sizes),
                           [t.numel() for t in outgoing], group=group)
    traffic.received += (sum(incoming_sizes) - incoming_sizes[me]) * receive.element_size()
    return list(receive.split(list(incoming_sizes)))


def broadcast_flat(flat: torch.Tensor, root: int, traffic: TrafficCounter,
                   group: Group = None) -> None:
    """Overwrite `flat` on every rank with group rank `root`'s."""
    if group_size(group) == 1:
        return
    dist.broadcast(flat, src=_global_rank(group, root), group=group)
    if group_rank(group) != root:
        traffic.received += flat.numel() * flat.element_size()


def all_reduce_scalars(values: Sequence[float], device: torch.device, group: Group = None
                       ) -> list[float]:
    """Sum a few float64 scalars over the group (metrics; not counted as outer traffic)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    if group_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def all_gather_scalars(values: Sequence[float], device: torch.device) -> list[list[float]]:
    """Every rank's few float64 scalars, in rank order (metrics; not outer traffic)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    return [part.tolist() for part in all_gather_flat(tensor, TrafficCounter())]


def all_gather_strings(value: str) -> list[str]:
    """Every rank's `value`, in rank order (small control messages, not outer traffic)."""
    if group_size() == 1:
        return [value]
    values: list[str] = [""] * group_size()
    dist.all_gather_object(values, value)
    return values
