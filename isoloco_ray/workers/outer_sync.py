"""The outer step: R pseudo-gradients in, one update of the global parameters out.

Communication follows the strategy (DESIGN.md, "Outer sync"). Mean-only strategies need only
the replicas' sum: each worker sums the replicas it hosts, then one bucketed all-reduce. The
per-replica merges (tsv, isocts, ties) need every Δ_r of a tensor in one place; for now every
rank gathers all of them and merges (the same result everywhere, no broadcast needed).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from isoloco_ray import aggregators
from isoloco_ray.config import OuterConfig
from isoloco_ray.workers.collectives import (TrafficCounter, all_gather_stacked, all_reduce_scalars,
                                             all_reduce_sum)

MEAN_ONLY = ("diloco", "diloco_sgd", "isoc", "isoloco", "dare")
PER_REPLICA = ("tsv", "isocts", "ties")


@dataclass
class OuterStepStats:
    """Where one outer step's time went, what this rank received, and which replicas were left
    out (non-finite pseudo-gradient or inner loss)."""

    comm_seconds: float = 0.0
    merge_seconds: float = 0.0
    bytes_received: int = 0
    dropped: list[int] = field(default_factory=list)
    skipped: bool = False  # every replica was bad: no update this round


def merge_options(outer: OuterConfig) -> dict:
    """The keyword options `aggregators.merge` takes for the configured strategy."""
    keys = {
        "isocts": ("common_fraction",),
        "tsv": ("keep_fraction", "decorrelate"),
        "ties": ("sparsity", "prune", "prune_dim", "rescale", "disjoint"),
        "dare": ("sparsity", "prune", "prune_dim", "rescale", "disjoint"),
    }.get(outer.strategy, ())
    return {key: getattr(outer, key) for key in keys}


def pruning_generator(seed: int, round_index: int, replica: int, tensor: str
                      ) -> torch.Generator:
    """The random-pruning stream of one replica's tensor in one round.

    Keyed by all four, so the mask depends neither on the layout, nor on which rank merges
    the tensor, nor on the order tensors are visited in, and shares nothing with the other
    random streams (data order, init): switching strategies changes nothing else.
    """
    key = zlib.crc32(f"prune/{seed}/{round_index}/{replica}/{tensor}".encode())
    return torch.Generator().manual_seed(key)


class OuterSync:
    """Turns the hosted replicas' Δ_r into the global update; holds the outer optimizer state."""

    optimizer: aggregators.OuterOptimizer

    def __init__(self, outer: OuterConfig, replicas: int, seed: int) -> None:
        self.outer = outer
        self.replicas = replicas
        self.seed = seed
        isoloco_update = outer.strategy == "isoloco" and outer.orthogonalize == "update"
        self.optimizer = aggregators.OuterOptimizer(
            lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov,
            orthogonalize_update=isoloco_update)
        self.traffic = TrafficCounter()
        # DARE's plain mean needs only the sum; its TIES-style disjoint variant needs every Δ_r.
        self.mean_only = outer.strategy in MEAN_ONLY and not (
            outer.strategy == "dare" and outer.disjoint)

    def step(self, global_params: dict[str, torch.Tensor],
             hosted: Mapping[int, Mapping[str, torch.Tensor]], round_index: int,
             diverged: Collection[int] = ()) -> OuterStepStats:
        """Apply one outer step to `global_params` in place from the hosted replicas' Δ_r.

        Replicas in `diverged` (non-finite inner loss) or with a non-finite Δ_r are left out on
        every rank alike, and the merge uses the others (the mean divides by their number).
        With none left the round is skipped: parameters and momentum stay as they were.
        """
        stats = OuterStepStats()
        names = list(global_params)
        good = self._good_replicas(hosted, diverged)
        stats.dropped = [r for r in range(self.replicas) if r not in good]
        if not good:
            stats.skipped = True
            return stats
        if self.mean_only:
            directions = self._mean_only(names, hosted, good, round_index, stats)
        else:
            directions = self._per_replica(names, hosted, good, round_index, stats)
        self.optimizer.step(global_params, directions)
        stats.bytes_received = self.traffic.take()
        return stats

    def _good_replicas(self, hosted: Mapping[int, Mapping[str, torch.Tensor]],
                       diverged: Collection[int]) -> list[int]:
        """Indices of all replicas, on any rank, whose Δ_r and loss are finite."""
        flags = [0.0] * self.replicas
        for replica, delta in hosted.items():
            finite = replica not in diverged and all(
                bool(torch.isfinite(t).all()) for t in delta.values())
            flags[replica] = 1.0 if finite else 0.0
        device = next(iter(next(iter(hosted.values())).values())).device
        return [r for r, flag in enumerate(all_reduce_scalars(flags, device)) if flag > 0.5]

    def _mean_only(self, names: Sequence[str], hosted: Mapping[int, Mapping[str, torch.Tensor]],
                   good: Sequence[int], round_index: int, stats: OuterStepStats
                   ) -> dict[str, torch.Tensor]:
        strategy = self.outer.strategy
        started = time.perf_counter()
        total = {name: torch.zeros_like(next(iter(hosted.values()))[name]) for name in names}
        for replica, delta in hosted.items():
            if replica not in good:
                continue
            for name in names:
                if strategy == "dare" and delta[name].dim() == 2:
                    # The sum of sparsified Δ_r is all DARE's mean needs: prune before reducing.
                    total[name] += aggregators.sparsify(
                        delta[name], self.outer.sparsity, prune=self.outer.prune,
                        prune_dim=self.outer.prune_dim, rescale=self.outer.rescale,
                        generator=pruning_generator(self.seed, round_index, replica, name))
                else:
                    total[name] += delta[name]
        stats.merge_seconds += time.perf_counter() - started

        started = time.perf_counter()
        all_reduce_sum([total[name] for name in names], self.traffic)
        stats.comm_seconds += time.perf_counter() - started

        started = time.perf_counter()
        mean = {name: total[name] / len(good) for name in names}
        if strategy == "isoc" or (strategy == "isoloco" and self.outer.orthogonalize == "gradient"):
            mean = aggregators.merge_all("isoc", {name: [m] for name, m in mean.items()})
        stats.merge_seconds += time.perf_counter() - started
        return mean

    def _per_replica(self, names: Sequence[str],
                     hosted: Mapping[int, Mapping[str, torch.Tensor]], good: Sequence[int],
                     round_index: int, stats: OuterStepStats) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        order = sorted(hosted)
        # Replica r sits at position r of the gathered list: ranks host contiguous replicas.
        gathered = {}
        for name in names:
            every_replica = all_gather_stacked([hosted[r][name] for r in order], self.traffic)
            gathered[name] = [every_replica[r] for r in good]
        stats.comm_seconds += time.perf_counter() - started

        started = time.perf_counter()
        options = merge_options(self.outer)
        if options.get("prune") == "random":
            # One stream per tensor (see pruning_generator); replica -1: the merge's own draw.
            merged = {name: aggregators.merge(
                self.outer.strategy, gathered[name], **options,
                generator=pruning_generator(self.seed, round_index, -1, name))
                for name in names}
        else:
            merged = aggregators.merge_all(self.outer.strategy, gathered, **options)
        stats.merge_seconds += time.perf_counter() - started
        return merged
