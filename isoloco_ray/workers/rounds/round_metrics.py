"""One round's line of metrics.jsonl, from every rank's figures (the world's loss sum and each
rank's outer-sync load)."""

from __future__ import annotations

import math
from typing import Any

import torch

from isoloco_ray.config import TrainConfig
from isoloco_ray.metrics import RoundMetrics
from isoloco_ray.workers.outer.step import OuterStepStats
from isoloco_ray.workers.parallel.collectives import all_gather_scalars, all_reduce_scalars

# A report as Ray Train takes it: RoundMetrics.as_dict(), or a run summary.
Metrics = dict[str, Any]


def round_metrics(cfg: TrainConfig, round_index: int, loss_sum: float, seconds: float,
                  inner_seconds: float, stats: OuterStepStats, device: torch.device
                  ) -> RoundMetrics:
    """The metrics of round `round_index` (1-based), on every rank alike: `loss_sum` is this
    rank's sum of its finite replicas' mean losses (summed over ranks, divided by the good
    replicas), `stats` this rank's outer syncs of the round."""
    good = cfg.scaling.replicas - len(stats.dropped)
    (loss_sum,) = all_reduce_scalars([loss_sum], device)
    # Per rank: the outer sync's load differs between ranks (owners, rank0).
    by_rank = all_gather_scalars(
        [stats.bytes_received, stats.comm_seconds, stats.merge_seconds, stats.wait_seconds],
        device)
    bytes_by_rank = [int(values[0]) for values in by_rank]
    return RoundMetrics(
        round=round_index,
        tokens=round_index * cfg.tokens_per_round,
        loss=loss_sum / good if good else math.nan,
        tokens_per_s=cfg.tokens_per_round / seconds,
        round_seconds=seconds,
        inner_seconds=inner_seconds,
        # The slowest / busiest rank's figures: the round waits for it.
        outer_comm_seconds=max(values[1] for values in by_rank),
        outer_merge_seconds=max(values[2] for values in by_rank),
        # The training thread's time blocked on outer syncs (outer.delay hides the rest).
        outer_wait_seconds=max(values[3] for values in by_rank),
        outer_bytes_received=max(bytes_by_rank),
        outer_bytes_by_rank=bytes_by_rank,
        dropped_replicas=stats.dropped,
    )
