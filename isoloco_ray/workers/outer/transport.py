"""How the outer sync's payloads move in the outer group: the transport, apart from the math.

Three patterns, each counted in the run's traffic (bytes this rank receives, under the standard
cost model of collectives.py) and each with its dtype:

- `everything`: every rank gets every rank's payload: one float32 all-reduce of the sums
  (reducing in bfloat16 would round every partial sum), or an all-gather in `comm_dtype`.
- `to_owners`: each tensor's payloads go to its owner rank (one all-to-all per bucket of the
  plan), in `comm_dtype`.
- `from_owners`: each owner broadcasts its tensors' updates, in `comm_dtype` (on a chunked
  wire packed like the payloads); the owner's own values go through the same rounding, so
  every rank applies the same update.

`comm_dtype` is a codec (codec.py): a cast (float32, bfloat16) or row-wise 8-bit quantisation
(int8, float8), which arrives dequantised to float32; with `outer.topk`, payloads travel as
each row's largest entries only (updates stay dense).

A payload maps each tensor's name to the tensors this rank sends for it (one sum, or one Δ_r
per hosted replica); what arrives is `Contributions`: name -> source rank -> its tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from isoloco_ray.strategies import WIRE_FORMATS
from isoloco_ray.workers.outer.codec import codec_for, wire_bytes
from isoloco_ray.workers.outer.plan import OuterPlan
from isoloco_ray.workers.parallel.collectives import (
    Group,
    TrafficCounter,
    all_gather_flat,
    all_reduce_sum,
    all_to_all_flat,
    broadcast_flat,
    buckets,
    group_rank,
    group_size,
)

Payload = Mapping[str, list[torch.Tensor]]
# name -> (source rank -> that rank's payload tensors of the name)
Contributions = dict[str, list[list[torch.Tensor]]]


class Transport:
    """The outer group's collectives for payloads and updates, with the bytes they move."""

    def __init__(self, comm_dtype: str, group: Group = None, topk: float | None = None
                 ) -> None:
        self.group = group
        self.ranks, self.rank = group_size(group), group_rank(group)
        self.codec = codec_for(comm_dtype, topk)  # payloads
        # Updates: dense whatever a row-wise topk says; on a chunked wire (int2, int4) packed
        # as the payloads are, the owner keeping what they lose (exchange.OwnersMerge).
        self.update_codec = self.codec if WIRE_FORMATS[comm_dtype].chunked \
            else codec_for(comm_dtype)
        self.traffic = TrafficCounter()

    def everything(self, payload: Payload, summed: bool) -> Contributions:
        """Every rank's payload of every tensor, on every rank; `summed`: each payload is one
        sum per tensor, and the result is their total (as the only source), reduced in
        float32."""
        names = list(payload)
        if summed:
            totals = [payload[name][0].clone() for name in names]
            all_reduce_sum(totals, self.traffic, self.group)
            return {name: [[total]] for name, total in zip(names, totals)}
        copies = len(next(iter(payload.values())))
        contributions: Contributions = {name: [[] for _ in range(self.ranks)] for name in names}
        sizes = [copies * self._bytes(payload[n][0].shape) for n in names]
        for index in buckets(sizes):
            chunk = [names[i] for i in index]
            local = self._pack(payload, chunk)
            for source, flat in enumerate(all_gather_flat(local, self.traffic, self.group)):
                self._unpack(flat, payload, chunk, contributions, source)
        return contributions

    def to_owners(self, payload: Payload, plan: OuterPlan) -> Contributions:
        """Every rank's payload of the tensors this rank owns (all-to-all, bucketed)."""
        copies = len(next(iter(payload.values())))
        elements = {name: self.codec.elements(tensors[0].shape)
                    for name, tensors in payload.items()}
        contributions: Contributions = {name: [[] for _ in range(self.ranks)]
                                        for name in plan.owned[self.rank]}
        nbytes = {name: n * self.codec.wire_dtype.itemsize for name, n in elements.items()}
        for step in plan.transfer_steps(nbytes, copies):
            outgoing = [self._pack(payload, names) for names in step]
            mine = step[self.rank]
            size = copies * sum(elements[name] for name in mine)
            incoming = all_to_all_flat(outgoing, [size] * self.ranks, self.traffic, self.group)
            for source, flat in enumerate(incoming):
                self._unpack(flat, payload, mine, contributions, source)
        return contributions

    def from_owners(self, owned: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor],
                    plan: OuterPlan) -> dict[str, torch.Tensor]:
        """Every tensor's update, from its owner, on every rank (float32 after the trip)."""
        elements = {name: self.update_codec.elements(p.shape) for name, p in params.items()}
        updates = {}
        device = next(iter(params.values())).device
        nbytes = {name: n * self.update_codec.wire_dtype.itemsize for name, n in elements.items()}
        for step in plan.transfer_steps(nbytes):
            for owner, names in enumerate(step):
                if not names:
                    continue
                if owner == self.rank:
                    flat = self.update_codec.encode([owned[name] for name in names], device)
                else:
                    flat = torch.empty(sum(elements[n] for n in names),
                                       dtype=self.update_codec.wire_dtype, device=device)
                broadcast_flat(flat, owner, self.traffic, self.group)
                decoded = self.update_codec.decode(flat, [params[n].shape for n in names])
                for name, value in zip(names, decoded):
                    updates[name] = value.float()
        return updates

    def take_bytes(self) -> int:
        """Bytes received since the last call."""
        return self.traffic.take()

    def _bytes(self, shape: torch.Size) -> int:
        return wire_bytes(self.codec, [shape])

    def _pack(self, payload: Payload, names: Sequence[str]) -> torch.Tensor:
        device = next(iter(payload.values()))[0].device
        return self.codec.encode([t for name in names for t in payload[name]], device)

    def _unpack(self, flat: torch.Tensor, payload: Payload, names: Sequence[str],
                into: Contributions, source: int) -> None:
        shapes = [t.shape for name in names for t in payload[name]]
        views = iter(self.codec.decode(flat, shapes))
        for name in names:
            into[name][source] = [next(views) for _ in payload[name]]
