"""Run the worker loop without Ray: in this process, or in W local processes joined by gloo.

The same `Trainer` Ray Train runs, fed by pyarrow instead of Ray Data. Tests use it to check the
math (layouts, outer steps, exact resume) in seconds; benchmarks use it as the Ray-free
reference.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from isoloco_ray.config import TrainConfig
from isoloco_ray.data.stream import read_with_pyarrow
from isoloco_ray.workers.loop import Metrics, Trainer, WorkerEnv


class StopAfterRound(Exception):
    """Raised by a local run's report after `stop_after` rounds: a simulated interruption."""


def local_env(rank: int = 0, world: int = 1,
              reports: list[Metrics] | None = None, checkpoints: Path | None = None,
              restore_from: Path | None = None, stop_after: int | None = None,
              device: torch.device | str = "cpu") -> WorkerEnv:
    """A WorkerEnv reading local shards with pyarrow.

    Reports are appended to `reports`; checkpoints are copied to `checkpoints/round_NNNNNN`
    (every rank's files into one directory, as Ray Train does); `stop_after` interrupts the
    run right after that round's report. `device`: where the model runs (one worker).
    """

    def report(metrics: Metrics, checkpoint_dir: Path | None) -> None:
        if reports is not None:
            reports.append(metrics)
        if checkpoint_dir is not None and checkpoints is not None:
            shutil.copytree(checkpoint_dir, checkpoints / f"round_{metrics['round']:06d}",
                            dirs_exist_ok=True)
        if stop_after is not None and metrics["round"] == stop_after:
            raise StopAfterRound(stop_after)

    return WorkerEnv(
        rank=rank, world=world, device=torch.device(device),
        read_rows=read_with_pyarrow,
        report=report, restore_from=restore_from,
    )


def _run_in_group(rank: int, world: int, scratch: str, threads: int, fn: Callable[..., Any],
                  args: tuple) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank,
                            world_size=world)
    try:
        torch.save(fn(rank, world, *args), f"{scratch}/result_{rank}.pt")
    finally:
        dist.destroy_process_group()


def in_gloo_group(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1
                  ) -> list[Any]:
    """fn(rank, world, *args) on `world` spawned processes joined in one gloo group, each with
    `threads` intra-op threads; every rank's return value (tensors and plain values), in rank
    order. `fn` must be a module-level function (spawn pickles it by name)."""
    with tempfile.TemporaryDirectory() as scratch:
        mp.start_processes(_run_in_group, nprocs=world, start_method="spawn", join=True,
                           args=(world, scratch, threads, fn, args))
        # Written just now by our own processes into a private temporary directory.
        return [torch.load(Path(scratch, f"result_{rank}.pt"), weights_only=False)
                for rank in range(world)]


def _train_rank(rank: int, world: int, config: dict[str, Any], data_dir: str,
                restore_from: str | None) -> tuple[Metrics, dict[str, torch.Tensor]] | None:
    """One gloo rank of `run_local`: rank 0's summary and final global parameters."""
    cfg = TrainConfig.model_validate(config)
    trainer = Trainer(cfg, Path(data_dir), local_env(
        rank, world, restore_from=None if restore_from is None else Path(restore_from)))
    summary = trainer.run()
    return (summary, trainer.global_params) if rank == 0 else None


def run_local(cfg: TrainConfig, data_dir: Path, threads_per_worker: int = 1,
              workers: int | None = None, **env_options: Any
              ) -> tuple[Metrics, dict[str, torch.Tensor]]:
    """Train `cfg` on `workers` (default cfg.scaling.num_workers) local processes (gloo); rank
    0's summary and final global parameters. With one worker everything runs in this process
    and `env_options` go to `local_env` (checkpoints, restore_from, stop_after, reports); with
    several, only restore_from. Each worker uses `threads_per_worker` intra-op threads (float
    sums depend on the thread count)."""
    world = workers or cfg.scaling.num_workers
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_worker)
        try:
            trainer = Trainer(cfg, data_dir, local_env(**env_options))
            return trainer.run(), trainer.global_params
        finally:
            torch.set_num_threads(threads)
    restore_from = env_options.pop("restore_from", None)
    if env_options:
        raise ValueError(f"{sorted(env_options)} are supported with one worker only")
    results = in_gloo_group(_train_rank, world, cfg.model_dump(mode="json"), str(data_dir),
                            None if restore_from is None else str(restore_from),
                            threads=threads_per_worker)
    return results[0]
