"""What the worker loop needs from whoever runs it (Ray Train, a test, a benchmark):
`WorkerEnv`. Its own module, so that the Trainer (loop.py) and its round runners read it
without knowing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from isoloco_ray.data.stream import RowReader
from isoloco_ray.workers.quorum.seat import QuorumSeat
from isoloco_ray.workers.rounds.round_metrics import Metrics


@dataclass
class WorkerEnv:
    """What the worker loop needs from whoever runs it (Ray Train, a test, a benchmark)."""

    rank: int
    world: int
    device: torch.device
    read_rows: RowReader  # reads row ranges of train shards (Ray Data, or pyarrow)
    # Called by every rank once per round with the metrics, on checkpoint rounds the
    # directory holding this rank's checkpoint files (valid only during the call), and whether
    # this rank is the one that records the run's progress (Trainer.writes_run_files).
    report: Callable[[Metrics, Path | None, bool], None]
    restore_from: Path | None = None  # a checkpoint directory to resume from
    # Given the bytes of a checkpoint (every rank's files), why it will not fit where it goes,
    # or None; asked on rank 0 before each checkpoint (storage.checkpoint_room).
    checkpoint_room: Callable[[int], str | None] | None = None
    # Test hook: called after each replica's inner steps with (round, replica).
    after_replica: Callable[[int, int], None] | None = None
    # Test hook: called after each inner step with (round, replica) (a slow worker).
    after_step: Callable[[int, int], None] | None = None
    # This worker's seat in each round's torchft quorum (quorum/seat.py): the outer sync runs over
    # the workers alive that round, and every other collective stays within this worker.
    seat: QuorumSeat | None = None
