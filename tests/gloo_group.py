"""Run a function on W local processes joined in a gloo process group; collect its results."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, world: int, scratch: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank,
                            world_size=world)
    try:
        torch.save(fn(rank, world, *args), f"{scratch}/result_{rank}.pt")
    finally:
        dist.destroy_process_group()


def in_gloo_group(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` spawned processes (one thread each) in one gloo group;
    every rank's return value (tensors and plain values), in rank order. `fn` must be a
    module-level function."""
    with tempfile.TemporaryDirectory() as scratch:
        mp.start_processes(_run, nprocs=world, start_method="spawn", join=True,
                           args=(world, scratch, fn, args))
        return [torch.load(Path(scratch, f"result_{rank}.pt"), weights_only=False)
                for rank in range(world)]
