"""Where a worker sits among R replicas (docs/design.md, "Layout"): which replicas it hosts,
and the process groups it talks in.

With V replicas per worker, worker w hosts replicas w·V … w·V+V-1 one after another. With a
replica spread over G workers (`scaling.workers_per_replica`), ranks g·G … g·G+G-1 hold
replica g together, each taking 1/G of every batch and averaging gradients every inner step
(data parallel, in the replica group); the outer sync runs among the workers at the same
position of every replica (the outer group). The G outer groups each step 1/G of the tensors
(outer/plan.position_shares), then every replica's workers share their new values
(`ReplicaShard.share`). Groups are built once, at start.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from isoloco_ray.config import ScalingConfig
from isoloco_ray.workers.outer.plan import OuterPlan
from isoloco_ray.workers.outer.transport import Transport
from isoloco_ray.workers.parallel.collectives import (
    Group,
    all_reduce_scalars,
)
from isoloco_ray.workers.parallel.gradient_average import GradientAverage


@dataclass(frozen=True)
class ReplicaShard:
    """This worker's part of a replica spread over `workers` workers."""

    position: int  # 0 … workers-1 within the replica
    workers: int
    group: Group  # the replica's workers

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This worker's contiguous 1/workers of a replica batch."""
        per_worker = len(batch) // self.workers
        return batch[self.position * per_worker:(self.position + 1) * per_worker]

    def gradient_average(self, model: nn.Module) -> GradientAverage:
        """What makes each step's gradients their mean over the replica's workers: the
        gradient of the whole batch's mean loss (every worker's rows have the same number of
        tokens), summed while backward runs."""
        return GradientAverage(list(model.parameters()), self.group, self.workers)

    @torch.no_grad()
    def share(self, shares: Sequence[Sequence[str]], tensors: MutableMapping[str, torch.Tensor],
              like: Mapping[str, torch.Tensor]) -> int:
        """Give every worker of the replica the values of `tensors` its worker at position p
        holds for the names shares[p], for every p (each stepped its share of the outer step):
        each position broadcasts its share as an owner broadcasts its updates
        (Transport.from_owners), in float32, so nothing is rounded. A name `tensors` lacks on
        a worker that receives it is added, shaped as in `like`. Returns the bytes this
        worker received."""
        owners = {name: position for position, names in enumerate(shares) for name in names}
        plan = OuterPlan(owners, self.workers, tuple(tuple(names) for names in shares))
        transport = Transport("float32", self.group)
        mine = shares[self.position]
        values = transport.from_owners({name: tensors[name] for name in mine},
                                       {name: like[name] for name in owners}, plan)
        for name, value in values.items():
            if name in mine:
                continue
            if name in tensors:
                tensors[name].copy_(value)
            else:
                tensors[name] = value.clone()
        return transport.take_bytes()

    def mean(self, value: float, device: torch.device) -> float:
        """The mean of a per-worker scalar over the replica's workers."""
        return all_reduce_scalars([value], device, self.group)[0] / self.workers


@dataclass(frozen=True)
class WorkerLayout:
    """One worker's place in the run."""

    rank: int
    world: int
    replicas_per_worker: int  # V
    workers_per_replica: int  # G
    shard: ReplicaShard | None  # None when a replica has a worker to itself (G = 1)
    outer_group: Group  # None: the default group (G = 1)
    # The same ranks as outer_group in a group of their own, for an outer sync that runs in
    # the background (outer.delay > 0) while the training thread uses outer_group.
    sync_group: Group

    @classmethod
    def create(cls, scaling: ScalingConfig, rank: int, world: int,
               background_sync: bool = False) -> WorkerLayout:
        """The layout of worker `rank`; with G > 1 or `background_sync` this builds process
        groups, so every rank must call it, in the same order relative to other
        collectives."""
        if world not in scaling.worker_counts:
            raise ValueError(f"the run has {world} workers but the scaling section allows "
                             f"{scaling.worker_counts} (R·G/V, or from scaling.min_workers)")
        per_replica = scaling.workers_per_replica
        # The workers at the same position of every replica: the outer groups.
        same_position = [list(range(p, world, per_replica)) for p in range(per_replica)]
        shard, outer_group = None, None
        if per_replica > 1:
            slots = world // per_replica
            replica_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(s * per_replica, (s + 1) * per_replica)) for s in range(slots)])
            outer_group, _ = dist.new_subgroups_by_enumeration(same_position)
            shard = ReplicaShard(rank % per_replica, per_replica, replica_group)
        sync_group = outer_group
        if background_sync and dist.is_available() and dist.is_initialized():
            sync_group, _ = dist.new_subgroups_by_enumeration(same_position)
        return cls(rank, world, scaling.replicas_per_worker_at(world), per_replica, shard,
                   outer_group, sync_group)

    @property
    def position(self) -> int:
        """This worker's position within its replica (0 when G = 1)."""
        return self.rank % self.workers_per_replica

    @property
    def hosted(self) -> range:
        """The replicas this worker runs (all of each, or its share of one)."""
        slot = self.rank // self.workers_per_replica
        return range(slot * self.replicas_per_worker, (slot + 1) * self.replicas_per_worker)

    @property
    def saves_replicas(self) -> bool:
        """The replica's workers hold identical state: the first one checkpoints it."""
        return self.position == 0


def replicas_split_across_nodes(node_of_rank: list[str], workers_per_replica: int) -> list[int]:
    """The replica slots (ranks g·G … g·G+G-1) whose workers are not all on one node."""
    return [slot for slot in range(len(node_of_rank) // workers_per_replica)
            if len(set(node_of_rank[slot * workers_per_replica:
                                    (slot + 1) * workers_per_replica])) > 1]


def placement_warning(node_of_rank: list[str], workers_per_replica: int) -> str | None:
    """A warning naming the replicas whose G workers sit on different nodes (each inner step
    then all-reduces gradients between nodes: correct, but slow), or None."""
    split = replicas_split_across_nodes(node_of_rank, workers_per_replica)
    if not split:
        return None
    return (f"warning: the workers of replica slot(s) {split} are on different nodes (ranks "
            f"g·{workers_per_replica} … g·{workers_per_replica}+{workers_per_replica - 1} "
            "all-reduce every inner step): Ray's PACK placement filled nodes unevenly; make "
            "each node hold a multiple of scaling.workers_per_replica workers (e.g. set "
            "scaling.cpus_per_worker to the node's CPUs / workers_per_replica)")
