"""Run the worker loop without Ray: in this process, or in W local processes joined by gloo.

The same `Trainer` Ray Train runs, fed by pyarrow instead of Ray Data. Tests use it to check the
math (layouts, outer steps) in seconds; benchmarks use it as the Ray-free reference.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from isoloco_ray.config import TrainConfig
from isoloco_ray.data.format import split_files
from isoloco_ray.data.stream import pyarrow_reader, replica_files
from isoloco_ray.workers.loop import Metrics, Trainer, WorkerEnv


def local_env(cfg: TrainConfig, data_dir: Path, rank: int = 0, world: int = 1,
              reports: list[Metrics] | None = None) -> WorkerEnv:
    """A WorkerEnv reading local shards with pyarrow; reports are appended to `reports`."""
    train_files = split_files(data_dir, "train")
    return WorkerEnv(
        rank=rank, world=world, device=torch.device("cpu"),
        read_epoch=lambda r: pyarrow_reader(replica_files(train_files, r, cfg.scaling.replicas)),
        report=(reports.append if reports is not None else lambda metrics: None),
    )


def _worker(rank: int, world: int, config: dict[str, Any], data_dir: str, scratch: str,
            threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank,
                            world_size=world)
    try:
        cfg = TrainConfig.model_validate(config)
        trainer = Trainer(cfg, Path(data_dir), local_env(cfg, Path(data_dir), rank, world))
        summary = trainer.run()
        if rank == 0:
            save_file(trainer.global_params, f"{scratch}/params.safetensors")
            Path(scratch, "summary.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


def run_local(cfg: TrainConfig, data_dir: Path, threads_per_worker: int = 1
              ) -> tuple[Metrics, dict[str, torch.Tensor]]:
    """Train `cfg` on cfg.scaling.num_workers local processes (gloo); rank 0's summary and
    final global parameters. With one worker everything runs in this process. Each worker
    uses `threads_per_worker` intra-op threads (float sums depend on the thread count)."""
    world = cfg.scaling.num_workers
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_worker)
        try:
            trainer = Trainer(cfg, data_dir, local_env(cfg, data_dir))
            return trainer.run(), trainer.global_params
        finally:
            torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as scratch:
        mp.start_processes(_worker, nprocs=world, start_method="spawn", join=True,
                           args=(world, cfg.model_dump(mode="json"), str(data_dir), scratch,
                                 threads_per_worker))
        summary = json.loads(Path(scratch, "summary.json").read_text())
        return summary, load_file(f"{scratch}/params.safetensors")
