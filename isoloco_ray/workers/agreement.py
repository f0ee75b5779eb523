"""Every worker of a run in step: the same global parameters after each round, and all stopping
together, since a rank that stopped alone would leave the others waiting in their next
collective."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from isoloco_ray.workers.parallel.collectives import all_gather_strings, all_reduce_scalars
from isoloco_ray.workers.state import checkpoint


class TrainingStopped(RuntimeError):
    """The run cannot go on (diverged replicas, workers disagreeing); the message says why."""


def check_workers_agree(global_params: dict[str, torch.Tensor], round_index: int,
                        full: bool) -> str:
    """The global parameters' fingerprint, after checking every worker holds the same: the
    on-device `parameters_checksum`, or with `full` (checkpoint rounds) the sha256."""
    digest = (checkpoint.parameters_sha256 if full
              else checkpoint.parameters_checksum)(global_params)
    hashes = all_gather_strings(digest)
    if len(set(hashes)) > 1:
        raise TrainingStopped(
            f"the workers' global parameters differ after round {round_index} "
            f"(hashes by rank: {hashes}); the outer sync is not deterministic here")
    return digest


def stop_if_any_rank_failed(error: str | None, round_index: int) -> None:
    """Every rank stops together when any rank's data failed in round `round_index` + 1."""
    errors = all_gather_strings(error or "")
    failed = [(rank, message) for rank, message in enumerate(errors) if message]
    if failed:
        rank, message = failed[0]
        raise TrainingStopped(f"worker {rank} in round {round_index + 1}: {message}")


def stop_unless_checkpoint_fits(directory: Path, round_index: int, rank: int,
                                device: torch.device,
                                room: Callable[[int], str | None] | None) -> None:
    """Every rank stops together, before writing anything, when this round's checkpoint
    (every rank's files in `directory`) will not fit where checkpoints go (`room`, asked on
    rank 0: why not, or None): half a checkpoint and an unreadable Ray Train record are what a
    disk that fills up during a checkpoint leaves, and restarts from the last checkpoint would
    only fill it again."""
    if room is None:
        return
    size = sum(path.stat().st_size for path in directory.iterdir())
    (needed,) = all_reduce_scalars([size], device)
    problem = room(int(needed)) if rank == 0 else None
    verdict = all_gather_strings(problem or "")[0]  # rank 0's, on every rank
    if verdict:
        raise TrainingStopped(f"the checkpoint of round {round_index} was not written: "
                              f"{verdict}")
