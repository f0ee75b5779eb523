"""Which rank of the outer group merges which tensor (`outer.placement`), the buckets the
tensors travel in, and, for a replica spread over G workers, which of its workers takes part in
each tensor's outer step (`position_shares`).

Built once per run from the parameter shapes, identically on every rank (no communication):
the same names, shapes and settings give the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from isoloco_ray.strategies import MERGES, PLACEMENTS
from isoloco_ray.workers.parallel.collectives import BUCKET_BYTES, buckets


def merge_cost(shape: torch.Size, merge: str, replicas: int, orthogonalize_update: bool = False
               ) -> float:
    """Estimated flops of one tensor's merge and outer update (only their ratios matter).

    A spectral merge of an m×n matrix costs about min(m, n)·m·n per input matrix it factors
    (Gram matrix or QDWH iterations): one for ISO-C of the mean, R for TSV and ISO-CTS. Every
    other step (sums, pruning, momentum) is elementwise.
    """
    numel = shape.numel()
    cost = float(replicas * numel)
    is_matrix = len(shape) == 2
    spec = MERGES[merge]
    if is_matrix and spec.spectral:
        cost += (1 if spec.factored_inputs == "mean" else replicas) * min(shape) * numel
    if is_matrix and orthogonalize_update:
        cost += min(shape) * numel
    return cost


def assign_owners(costs: Mapping[str, float], ranks: int, placement: str) -> dict[str, int]:
    """Owner rank of every tensor.

    sharded: longest-processing-time-first greedy on the estimated costs (each tensor, dearest
    first, to the least-loaded rank; ties to the lower rank, then model order), so the slowest
    rank carries at most 4/3 of the best possible maximum. rank0 and replicated: rank 0 (for
    replicated that only says who saves the momentum: every rank computes everything).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}; got {placement!r}")
    if placement != "sharded" or ranks == 1:
        return dict.fromkeys(costs, 0)
    load = [0.0] * ranks
    owners: dict[str, int] = {}
    for name in sorted(costs, key=lambda n: -costs[n]):  # stable: ties keep model order
        rank = min(range(ranks), key=lambda k: (load[k], k))
        owners[name] = rank
        load[rank] += costs[name]
    return {name: owners[name] for name in costs}


@dataclass(frozen=True)
class OuterPlan:
    """Owners and transfer buckets of one run's outer sync."""

    owners: dict[str, int]  # tensor name -> owner rank in the outer group
    ranks: int
    # owned[k]: rank k's tensors in model order
    owned: tuple[tuple[str, ...], ...]

    @classmethod
    def build(cls, shapes: Mapping[str, torch.Size], merge: str, replicas: int, ranks: int,
              placement: str, orthogonalize_update: bool = False) -> OuterPlan:
        """The plan for tensors of `shapes` (model order) merged by `merge` over `replicas`."""
        costs = {name: merge_cost(shape, merge, replicas, orthogonalize_update)
                 for name, shape in shapes.items()}
        owners = assign_owners(costs, ranks, placement)
        owned = tuple(tuple(n for n in shapes if owners[n] == k) for k in range(ranks))
        return cls(owners, ranks, owned)

    def transfer_steps(self, nbytes: Mapping[str, int], copies: int = 1,
                       bucket_bytes: int = BUCKET_BYTES) -> list[list[tuple[str, ...]]]:
        """steps[s][k]: the tensors of owner k moved in step s, each owner's tensors cut into
        buckets of at most `bucket_bytes` (counting `copies` of each tensor of `nbytes` bytes
        on the wire); owners with fewer buckets move nothing in the last steps."""
        per_owner = []
        for names in self.owned:
            sizes = [copies * nbytes[n] for n in names]
            per_owner.append([tuple(names[i] for i in index) for index in buckets(sizes,
                                                                                 bucket_bytes)])
        count = max((len(b) for b in per_owner), default=0)
        return [[b[s] if s < len(b) else () for b in per_owner] for s in range(count)]

    def loads(self, costs: Mapping[str, float]) -> list[float]:
        """Total cost per rank."""
        return [sum(costs[n] for n in names) for names in self.owned]



def position_shares(shapes: Mapping[str, torch.Size], merge: str, replicas: int, positions: int,
                    orthogonalize_update: bool = False) -> tuple[tuple[str, ...], ...]:
    """shares[p]: the tensors of `shapes` (model order) whose outer step the workers at
    position p of every replica take, when a replica is spread over `positions` workers.

    The G workers of a replica hold the same Δ_r (they are data parallel), so each tensor
    needs its outer step in one outer group only: split by estimated cost as owners are
    (`assign_owners`, sharded), each group steps 1/G of the work and bytes, and a broadcast
    within each replica gives every worker the rest (layout.ReplicaShard.share).
    """
    return OuterPlan.build(shapes, merge, replicas, positions, "sharded",
                           orthogonalize_update).owned
