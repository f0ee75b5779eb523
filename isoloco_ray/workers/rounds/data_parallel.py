"""One round of the adamw_ddp baseline: H data-parallel AdamW steps on the global model, the
gradients averaged over all R replicas' batches every step (the replicas only supply batches;
a replica spread over G workers gives each its rows of the replica's batch)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from isoloco_ray.data.format import DataError
from isoloco_ray.workers.agreement import stop_if_any_rank_failed
from isoloco_ray.workers.outer.step import OuterStepStats
from isoloco_ray.workers.parallel.collectives import TrafficCounter
from isoloco_ray.workers.parallel.gradient_average import GradientAverage
from isoloco_ray.workers.quorum.seat import CommittedSync
from isoloco_ray.workers.inner_optimizer import make_inner_optimizer
from isoloco_ray.workers.replica import (
    inner_step,
    load_parameters,
    parameters_finite,
    snapshot_parameters,
)
from isoloco_ray.workers.rounds.round_parts import RoundParts


class DataParallelRounds:
    """Runs a worker's adamw_ddp rounds on the Trainer's parts (round_parts.py); its one inner
    optimizer (inner.optimizer) and LR schedule over the global model are alike on every rank
    and saved by rank 0 (checkpoint.DATA_PARALLEL_FILE)."""

    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    committed: CommittedSync | None = None  # never: it runs over no quorum (refused below)

    def __init__(self, parts: RoundParts) -> None:
        if parts.env.seat is not None:
            raise ValueError("outer.strategy adamw_ddp all-reduces gradients at every step "
                             "over every worker: it cannot run over a quorum")
        self.parts = parts
        cfg = parts.cfg
        self.optimizer, self.schedule = make_inner_optimizer(
            parts.model, cfg.inner, cfg.resolved.rounds * cfg.inner.steps,
            parts.env.device.type == "cuda")

    def state_dict(self) -> dict[str, Any]:
        """The optimizer and schedule (checkpoint.DATA_PARALLEL_FILE)."""
        return {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a `state_dict`."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])

    def run_round(self, round_index: int) -> tuple[float, float, OuterStepStats]:
        """Round `round_index` + 1 (`round_index` rounds are done). Returns (this rank's share
        of the replicas' summed mean loss, inner seconds, the gradient all-reduce's figures as
        the round's outer stats)."""
        parts = self.parts
        cfg = parts.cfg
        stats, traffic = OuterStepStats(), TrafficCounter()
        params = list(parts.model.parameters())
        shard = parts.layout.shard
        shares = cfg.scaling.replicas * cfg.scaling.workers_per_replica
        load_parameters(parts.model, parts.global_params)

        # Every rank joins each step's sum, with zeros after a data error (no batch read).
        average = GradientAverage(params, None, shares, traffic, zero_missing=True)
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=parts.env.device)
        data_error = None
        for _ in range(cfg.inner.steps):
            batches = []  # the hosted replicas' batches: their gradients add up in .grad
            try:
                if data_error is None:
                    batches = [replica.stream.next_batch() for replica in parts.replicas]
            except DataError as exc:
                # Keep joining the steps' all-reduce so the other ranks reach the end of the
                # round, where every rank stops.
                data_error = str(exc)
            loss_sum += inner_step(
                parts.runtime, self.optimizer, self.schedule,
                [batch if shard is None else shard.rows(batch) for batch in batches],
                cfg.resolved.micro_batch_size, cfg.inner.clip, average)
        stats.comm_seconds = average.finish_seconds
        inner_seconds = time.perf_counter() - started - stats.comm_seconds
        stop_if_any_rank_failed(data_error, round_index)
        stats.bytes_received = traffic.take()
        stepped = snapshot_parameters(parts.model)
        if parameters_finite(stepped):  # alike on every rank: the same averaged gradients
            parts.global_params.update(stepped)
        else:
            # The DiLoCo strategies' guard, for the one data-parallel "replica": the round is
            # skipped (parameters as they were before it) and AdamW's moments are reset.
            self.optimizer.state.clear()
            stats.dropped, stats.skipped = list(range(cfg.scaling.replicas)), True
        # Every worker's loss is over its share: the world's sum, / G, is the replicas' sum.
        return (loss_sum.item() / cfg.inner.steps / cfg.scaling.workers_per_replica,
                inner_seconds, stats)

    def quorum_metrics(self) -> dict[str, Any]:
        """Nothing: it never runs over a quorum (refused at start)."""
        return {}

    def close(self) -> None:
        """Nothing runs in the background here."""
