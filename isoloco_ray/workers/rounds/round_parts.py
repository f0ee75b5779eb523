"""What a round runner (rounds/diloco.py, rounds/data_parallel.py) works on: `RoundParts`,
the parts of a worker's training state that the Trainer (loop.py) owns, saves and passes in.
A runner reads them and updates them in place, and knows nothing else of the Trainer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from isoloco_ray.config import TrainConfig
from isoloco_ray.workers.model import Runtime
from isoloco_ray.workers.outer.step import OuterSync
from isoloco_ray.workers.parallel.layout import WorkerLayout
from isoloco_ray.workers.replica import Replica
from isoloco_ray.workers.worker_env import WorkerEnv


@dataclass(frozen=True)
class RoundParts:
    """The Trainer's parts a round runs on. The same objects as the Trainer's: `global_params`
    is updated in place (entries replaced or copied into, the dict itself never rebound)."""

    cfg: TrainConfig
    env: WorkerEnv
    layout: WorkerLayout  # hosted replicas, process groups, the replica's share of rows
    model: LlamaForCausalLM  # scratch model the hosted replicas take turns in
    runtime: Runtime  # how the model runs (autocast, compile)
    global_params: dict[str, torch.Tensor]  # θ_t, identical on every worker
    replicas: list[Replica]  # the replicas this worker hosts
    outer: OuterSync  # the outer step
    fragments: list[tuple[str, ...]]  # the tensors synced together
