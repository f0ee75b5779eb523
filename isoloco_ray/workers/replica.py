"""One DiLoCo replica: its inner AdamW, LR schedule and data stream, and its H inner steps.

Replicas hosted by one worker share the worker's single model module: each round every replica
starts from the same global parameters, so the module is simply reloaded with them before a
replica runs. What makes replicas differ, and so what a checkpoint must hold per replica, is
declared at the top of `Replica`.
"""

from __future__ import annotations

import math
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from isoloco_ray.config import InnerConfig
from isoloco_ray.data.stream import ReplicaStream, StreamPosition
from isoloco_ray.workers.checkpoint import CheckpointError
from isoloco_ray.workers.layout import ReplicaShard
from isoloco_ray.workers.model import Runtime


def warmup_cosine(step: int, total_steps: int, warmup_fraction: float) -> float:
    """LR multiplier (docs/strategies.md): linear warmup from 0.1x, then cosine down to 0.1x
    at the end."""
    warmup_steps = int(warmup_fraction * total_steps)
    if step < warmup_steps:
        return 0.1 + 0.9 * step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_inner_optimizer(model: nn.Module, inner: InnerConfig, total_steps: int,
                         fused: bool = False
                         ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `model`'s parameters with the warmup-cosine schedule over `total_steps`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=inner.betas,
                                  weight_decay=inner.weight_decay, fused=fused or None)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, total_steps, inner.warmup))
    return optimizer, schedule


def accumulate_gradients(runtime: Runtime, batch: torch.Tensor, micro_batch_size: int
                         ) -> torch.Tensor:
    """Forward/backward `batch` in micro-batches, adding the gradients of the batch's mean loss
    to `.grad`; returns that mean loss as a device tensor (no host sync in the inner loop).

    Every micro-batch has the same number of tokens, so the mean of micro-batch means is the
    batch mean.
    """
    micro_batches = runtime.to_device(batch).split(micro_batch_size)
    total = torch.zeros((), device=runtime.device)
    for micro in micro_batches:
        with runtime.autocast():
            loss = runtime.forward(input_ids=micro, labels=micro).loss / len(micro_batches)
        loss.backward()
        total += loss.detach().float()
    return total


def inner_step(runtime: Runtime, optimizer: torch.optim.Optimizer,
               schedule: torch.optim.lr_scheduler.LRScheduler, batches: Sequence[torch.Tensor],
               micro_batch_size: int, clip: float | None,
               average_gradients: Callable[[], None] | None = None) -> torch.Tensor:
    """One inner AdamW step, as every training path takes it: the gradients of each batch's
    mean loss add up in `.grad`, `average_gradients` (if any) averages them with the other
    workers that share the step, then clipping, the optimizer and the LR schedule. Returns the
    batches' summed mean losses as a device tensor (no host sync)."""
    optimizer.zero_grad(set_to_none=True)
    loss = torch.zeros((), device=runtime.device)
    for batch in batches:
        loss += accumulate_gradients(runtime, batch, micro_batch_size)
    if average_gradients is not None:
        average_gradients()
    if clip is not None:
        nn.utils.clip_grad_norm_(runtime.forward.parameters(), clip)
    optimizer.step()
    schedule.step()
    return loss


class Replica:
    """A replica's private state; everything here goes into a checkpoint."""

    index: int
    optimizer: torch.optim.AdamW
    schedule: torch.optim.lr_scheduler.LambdaLR
    stream: ReplicaStream
    # outer.error_feedback: what the outer sync's transport lost of this replica's
    # pseudo-gradients so far, sent with the next one (outer_sync.py); empty when off.
    feedback: dict[str, torch.Tensor]

    def __init__(self, index: int, model: nn.Module, inner: InnerConfig, total_steps: int,
                 stream: ReplicaStream, fused: bool = False) -> None:
        self.index = index
        self.optimizer, self.schedule = make_inner_optimizer(model, inner, total_steps, fused)
        self.stream = stream
        self.feedback = {}
        self._inner = inner

    def run_inner_steps(self, model: nn.Module, runtime: Runtime,
                        global_params: Mapping[str, torch.Tensor], steps: int,
                        micro_batch_size: int, shard: ReplicaShard | None = None
                        ) -> tuple[dict[str, torch.Tensor], float]:
        """Start from the global parameters, take `steps` AdamW steps, return (Δ_r, mean loss).

        Δ_r = θ_global − θ_r (the pseudo-gradient of docs/strategies.md), in float32. With a
        `shard`, this worker computes the gradients of its rows of each batch and averages them
        with the replica's other workers, so every one of them takes the same steps.
        """
        load_parameters(model, global_params)
        model.train()
        average = None if shard is None else lambda: shard.average_gradients(model)
        losses = []
        for _ in range(steps):
            batch = self.stream.next_batch()
            losses.append(inner_step(runtime, self.optimizer, self.schedule,
                                     [batch if shard is None else shard.rows(batch)],
                                     micro_batch_size, self._inner.clip, average))
        with torch.no_grad():
            delta = {name: global_params[name] - p.detach().float()
                     for name, p in model.named_parameters()}
        loss = torch.stack(losses).mean().item()
        return delta, loss if shard is None else shard.mean(loss, runtime.device)

    def state_dict(self) -> dict[str, Any]:
        """AdamW state, LR schedule, stream position and error-feedback residual (if any):
        tensors and plain values only. The
        position is the count of sequences read this epoch and, to check it on resume, the
        shard file (its name) and row it stands at."""
        shard, row = self.stream.where()
        state = {"optimizer": self.optimizer.state_dict(),
                 "schedule": self.schedule.state_dict(),
                 "stream": {"epoch": self.stream.position.epoch,
                            "sequences": self.stream.position.sequences,
                            "shard": Path(shard).name, "row": row}}
        if self.feedback:
            state["feedback"] = dict(self.feedback)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`; the stream continues with its next unseen batch, read from
        the shard and row it stood at (CheckpointError if the data's shards now put that
        position elsewhere: they changed since the checkpoint)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        device = next(iter(self.optimizer.param_groups[0]["params"])).device
        self.feedback = {name: t.to(device) for name, t in state.get("feedback", {}).items()}
        saved = state["stream"]
        self.stream.seek(StreamPosition(saved["epoch"], saved["sequences"]))
        shard, row = self.stream.where()
        if "shard" in saved and (saved["shard"], saved["row"]) != (Path(shard).name, row):
            raise CheckpointError(
                f"replica {self.index}'s checkpoint stands at row {saved['row']} of train "
                f"shard {saved['shard']}, but the data's shards now put its position "
                f"({saved['sequences']} sequences into epoch {saved['epoch']}) at row {row} of "
                f"{Path(shard).name or 'the end'}: the data changed since the run began; resume "
                "with the data it was trained on")

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments (after a diverged round left them NaN); the LR schedule and
        the stream go on."""
        self.optimizer.state.clear()


@torch.no_grad()
def load_parameters(model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy `params` (by name) into the model's parameters in place."""
    for name, p in model.named_parameters():
        p.copy_(params[name])


@torch.no_grad()
def snapshot_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """A float32 copy of the model's parameters, by name."""
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}
