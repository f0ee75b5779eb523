"""The exchange: what of its hosted replicas' Δ_r a rank sends in an outer step, how it
travels, and how the merged updates come back. Chosen once per run from its route
(strategies.Route), so the outer step (step.py) reads the same whatever the wire:

- `EveryoneMerges`: every rank gets every payload (a float32 all-reduce of the sums, or an
  all-gather of every Δ_r in `outer.comm_dtype`) and merges every tensor itself: nothing comes
  back.
- `OwnersMerge`: each tensor's payloads go to its owner rank (plan.py), which merges them and
  broadcasts the update (on a chunked wire packed too, the owner keeping what it loses).

Behind it sit the payload (payload.py: sums or each Δ_r, pruned where hosted, error feedback),
the codec (codec.py) and the collectives (transport.py). The quorum's outer step
(scaling.fault_tolerance: replica) sends the same payload as one flat tensor through its seat:
`to_quorum_wire` / `from_quorum_wire`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence

import torch

from isoloco_ray.config import OuterConfig
from isoloco_ray.strategies import WIRE_FORMATS, OuterMerge, Route
from isoloco_ray.workers.outer.codec import Codec, wire_bytes
from isoloco_ray.workers.outer.payload import Payloads
from isoloco_ray.workers.outer.plan import OuterPlan
from isoloco_ray.workers.outer.transport import Contributions, Payload, Transport
from isoloco_ray.workers.parallel.collectives import Group


class Exchange(ABC):
    """One run's outer-step traffic; `choose` picks the kind its route takes."""

    def __init__(self, outer: OuterConfig, merge: OuterMerge, route: Route, seed: int,
                 group: Group = None) -> None:
        self.outer, self.route = outer, route
        self.transport = Transport(outer.comm_dtype, group, outer.topk)
        self.payloads = Payloads(outer, merge, route, self.transport.codec, seed)

    @staticmethod
    def choose(outer: OuterConfig, merge: OuterMerge, route: Route, seed: int,
               group: Group = None) -> Exchange:
        """The exchange of `route`: every rank merges, or each tensor's owner."""
        kind = EveryoneMerges if route.everyone_merges else OwnersMerge
        return kind(outer, merge, route, seed, group)

    @property
    def codec(self) -> Codec:
        """How payloads travel (outer.comm_dtype, outer.topk)."""
        return self.transport.codec

    def pack(self, hosted: Mapping[int, Mapping[str, torch.Tensor]], good: Sequence[int],
             round_index: int, feedback: Mapping[int, dict[str, torch.Tensor]] | None = None,
             trained: Mapping[int, float] | None = None) -> Payload:
        """What this rank sends of its hosted replicas' Δ_r (payload.Payloads.make)."""
        return self.payloads.make(hosted, good, round_index, feedback, trained)

    @abstractmethod
    def send(self, payload: Payload, plan: OuterPlan) -> Contributions:
        """Every rank's payload of the tensors this rank merges: name -> source -> tensors."""

    def settle(self, feedback: Mapping[int, dict[str, torch.Tensor]] | None, payload: Payload,
               arrived: Contributions, hosted: Iterable[int], good: Sequence[int]) -> None:
        """After `send`: the hosted replicas' error-feedback residuals of the `payload` sent
        (payload.Payloads.settle), from this rank's own copies as the wire decoded them."""
        self.payloads.settle(feedback, payload, lambda: self.own_decoded(payload, arrived),
                             hosted, good)

    def own_decoded(self, payload: Payload, arrived: Contributions
                    ) -> Mapping[str, Sequence[torch.Tensor]]:
        """This rank's `payload` as a receiver decodes it (the codec's round trip; an exchange
        that decoded it already while sending gives those)."""
        return {name: [self.codec.roundtrip(x) for x in copies]
                for name, copies in payload.items()}

    @abstractmethod
    def bring_back(self, updates: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor],
                   plan: OuterPlan) -> dict[str, torch.Tensor]:
        """Every tensor's update on every rank, from the `updates` this rank merged."""

    def take_bytes(self) -> int:
        """Bytes this rank received since the last call."""
        return self.transport.take_bytes()

    @property
    def keeps_residuals(self) -> bool:
        """Whether it keeps state between rounds (`residuals`), which a checkpoint holds."""
        return False

    def residuals(self) -> dict[str, torch.Tensor]:
        """What it keeps between rounds, by tensor name (see OwnersMerge)."""
        return {}

    def load_residuals(self, residuals: Mapping[str, torch.Tensor]) -> None:
        """Restore `residuals` (those of the tensors this rank merges now)."""

    def to_quorum_wire(self, payload: Payload, names: Sequence[str]) -> torch.Tensor:
        """`payload` as one flat float32 tensor for the quorum's all-gather, each copy (the
        sum, or each hosted Δ_r) in turn, its tensors in the order of `names`: the values on a
        lossless wire, else the codec's bytes padded to whole words and viewed as float32 (the
        all-gather copies them bit for bit; nothing adds them)."""
        copies = len(payload[names[0]])
        tensors = [payload[name][copy] for copy in range(copies) for name in names]
        if not self.outer.lossy_wire:
            return torch.cat([t.reshape(-1) for t in tensors])
        raw = self.codec.encode(tensors, tensors[0].device).reshape(-1).view(torch.uint8)
        padding = -raw.numel() % 4
        if padding:
            raw = torch.cat([raw, raw.new_zeros(padding)])
        return raw.view(torch.float32)

    def settle_from_quorum_wire(self, feedback: Mapping[int, dict[str, torch.Tensor]] | None,
                                payload: Payload, flat: torch.Tensor, names: Sequence[str],
                                hosted: Iterable[int], good: Sequence[int]) -> None:
        """`settle` for a payload sent as `to_quorum_wire`'s `flat`: its own bytes decoded
        (encoded once)."""
        def decoded() -> dict[str, list[torch.Tensor]]:
            copies = len(payload[names[0]])
            shapes = [payload[name][0].shape for name in names]
            tensors = self.from_quorum_wire(flat, shapes * copies)
            return {name: [tensors[copy * len(names) + i] for copy in range(copies)]
                    for i, name in enumerate(names)}

        self.payloads.settle(feedback, payload, decoded, hosted, good)

    def from_quorum_wire(self, flat: torch.Tensor, shapes: Sequence[torch.Size]
                         ) -> list[torch.Tensor]:
        """The tensors of `shapes` a peer's `to_quorum_wire` sent (decoded, float32)."""
        if not self.outer.lossy_wire:
            return [part.view(shape) for part, shape in
                    zip(flat.split([shape.numel() for shape in shapes]), shapes)]
        raw = flat.view(torch.uint8)[:wire_bytes(self.codec, shapes)]
        return [t.float() for t in self.codec.decode(raw.view(self.codec.wire_dtype),
                                                     list(shapes))]


class EveryoneMerges(Exchange):
    """Every rank gets every payload and merges every tensor: the all-reduce of sums, or the
    all-gather of every Δ_r."""

    def send(self, payload: Payload, plan: OuterPlan) -> Contributions:
        return self.transport.everything(payload, summed=self.route.sums)

    def own_decoded(self, payload: Payload, arrived: Contributions
                    ) -> Mapping[str, Sequence[torch.Tensor]]:
        # The all-gather decoded every rank's bytes, this rank's own among them.
        return {name: arrived[name][self.transport.rank] for name in payload}

    def bring_back(self, updates: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor],
                   plan: OuterPlan) -> dict[str, torch.Tensor]:
        return updates  # every rank merged every tensor alike


class OwnersMerge(Exchange):
    """Each tensor's payloads go to its owner, which sends its update back.

    On a chunked wire (int2, int4: a top-k share of each chunk) the update travels packed as
    well, and its owner keeps what the wire lost of it, `update_residuals`, adding it to the
    tensor's next update before that is packed (error feedback, kept whole): the rest of
    every update arrives in later rounds instead of being lost."""

    update_residuals: dict[str, torch.Tensor]  # owned tensor -> what its updates lost so far

    def __init__(self, outer: OuterConfig, merge: OuterMerge, route: Route, seed: int,
                 group: Group = None) -> None:
        super().__init__(outer, merge, route, seed, group)
        self.packs_updates = WIRE_FORMATS[outer.comm_dtype].chunked
        self.update_residuals = {}

    def send(self, payload: Payload, plan: OuterPlan) -> Contributions:
        return self.transport.to_owners(payload, plan)

    @property
    def keeps_residuals(self) -> bool:
        return self.packs_updates

    def residuals(self) -> dict[str, torch.Tensor]:
        return dict(self.update_residuals)

    def load_residuals(self, residuals: Mapping[str, torch.Tensor]) -> None:
        self.update_residuals = {name: value.clone() for name, value in residuals.items()}

    def bring_back(self, updates: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor],
                   plan: OuterPlan) -> dict[str, torch.Tensor]:
        if not self.packs_updates:
            return self.transport.from_owners(updates, params, plan)
        corrected = {name: u + self.update_residuals[name].to(u.device)
                     if name in self.update_residuals else u for name, u in updates.items()}
        arrived = self.transport.from_owners(corrected, params, plan)
        for name, value in corrected.items():  # the owner decoded its own bytes as all did
            self.update_residuals[name] = value - arrived[name]
        return arrived
