"""One DiLoCo replica: its inner optimizer (AdamW, or Muon and AdamW: inner_optimizer.py), LR
schedule and data stream, and its H inner steps.

Replicas hosted by one worker share the worker's single model module: each round every replica
starts from the same global parameters, so the module is simply reloaded with them before a
replica runs. What makes replicas differ, and so what a checkpoint must hold per replica, is
declared at the top of `Replica`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from isoloco_ray.config import InnerConfig
from isoloco_ray.data.stream import ReplicaStream, StreamPosition
from isoloco_ray.workers.inner_optimizer import make_inner_optimizer, schedule_at
from isoloco_ray.workers.model import Runtime
from isoloco_ray.workers.parallel.gradient_average import GradientAverage
from isoloco_ray.workers.parallel.layout import ReplicaShard
from isoloco_ray.workers.state.checkpoint import CheckpointError


def accumulate_gradients(runtime: Runtime, batch: torch.Tensor, micro_batch_size: int,
                         before_last_backward: Callable[[], None] | None = None
                         ) -> torch.Tensor:
    """Forward/backward `batch` in micro-batches, adding the gradients of the batch's mean loss
    to `.grad`; returns that mean loss as a device tensor (no host sync in the inner loop).
    `before_last_backward` is called right before the last micro-batch's backward.

    Every micro-batch has the same number of tokens, so the mean of micro-batch means is the
    batch mean.
    """
    micro_batches = runtime.to_device(batch).split(micro_batch_size)
    total = torch.zeros((), device=runtime.device)
    for index, micro in enumerate(micro_batches):
        with runtime.autocast():
            loss = runtime.forward(input_ids=micro, labels=micro).loss / len(micro_batches)
        if before_last_backward is not None and index == len(micro_batches) - 1:
            before_last_backward()
        loss.backward()
        total += loss.detach().float()
    return total


def inner_step(runtime: Runtime, optimizer: torch.optim.Optimizer,
               schedule: torch.optim.lr_scheduler.LRScheduler, batches: Sequence[torch.Tensor],
               micro_batch_size: int, clip: float | None,
               average: GradientAverage | None = None) -> torch.Tensor:
    """One inner optimizer step, as every training path takes it: the gradients of each batch's
    mean loss add up in `.grad`, `average` (if any) averages them with the other workers that
    share the step (its all-reduces start during the last backward), then clipping, the
    optimizer and the LR schedule. Returns the batches' summed mean losses as a device tensor
    (no host sync)."""
    optimizer.zero_grad(set_to_none=True)
    loss = torch.zeros((), device=runtime.device)
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        loss += accumulate_gradients(runtime, batch, micro_batch_size,
                                     average.arm if average is not None and last else None)
    if average is not None:
        average.finish()
    if clip is not None:
        nn.utils.clip_grad_norm_(runtime.forward.parameters(), clip)
    optimizer.step()
    schedule.step()
    return loss


class Replica:
    """A replica's private state; everything here goes into a checkpoint."""

    index: int
    # θ_r, the replica's own parameters (float32). They equal the global parameters after
    # every sync unless outer.fragments, delay or mix are set (OuterConfig.streaming): only
    # then does a checkpoint hold them. A worker hosting one replica keeps them in the model.
    params: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer  # AdamW, or MuonAdamW (inner.optimizer)
    schedule: torch.optim.lr_scheduler.LambdaLR
    stream: ReplicaStream
    # outer.error_feedback: what the outer sync's transport lost of this replica's
    # pseudo-gradients so far, sent with the next one (outer/payload.py); empty when off.
    feedback: dict[str, torch.Tensor]
    # Whether every inner loss since the last sync started was finite (else the replica is
    # left out of the next merge).
    losses_finite: bool

    def __init__(self, index: int, model: nn.Module, inner: InnerConfig, total_steps: int,
                 stream: ReplicaStream, fused: bool = False, in_model: bool = False,
                 keeps_params: bool = False) -> None:
        """`in_model`: the replica has the model to itself (its worker hosts no other), so its
        parameters are the model's. `keeps_params`: they outlive a sync (OuterConfig.streaming)
        and are checkpointed."""
        self.index = index
        self.in_model = in_model
        self.keeps_params = keeps_params
        self.params = (dict(model.named_parameters()) if in_model
                       else snapshot_parameters(model))
        self.optimizer, self.schedule = make_inner_optimizer(model, inner, total_steps, fused)
        self.stream = stream
        self.feedback = {}
        self.losses_finite = True
        self._inner = inner

    def run_inner_steps(self, model: nn.Module, runtime: Runtime, steps: int,
                        micro_batch_size: int, shard: ReplicaShard | None = None,
                        after_step: Callable[[], bool] | None = None) -> list[torch.Tensor]:
        """Take `steps` AdamW steps from the replica's parameters; returns each step's mean
        loss (device tensors; `losses_finite` notes whether they were all finite).
        `after_step` is called after each step; True stops the steps there (a straggler's
        deadline: straggler_deadline.py), after the first at the earliest.

        With a `shard`, this worker computes the gradients of its rows of each batch and
        averages them with the replica's other workers, so every one of them takes the same
        steps.
        """
        if not self.in_model:
            load_parameters(model, self.params)
        model.train()
        average = None if shard is None else shard.gradient_average(model)
        losses = []
        for _ in range(steps):
            batch = self.stream.next_batch()
            losses.append(inner_step(runtime, self.optimizer, self.schedule,
                                     [batch if shard is None else shard.rows(batch)],
                                     micro_batch_size, self._inner.clip, average))
            if after_step is not None and after_step():
                break
        if not self.in_model:
            load_parameters_into(self.params, model)
        if losses:
            finite = bool(torch.isfinite(torch.stack(losses)).all())
            if shard is not None:  # the replica's workers must agree: the outer groups do
                finite = shard.mean(float(finite), runtime.device) == 1.0
            self.losses_finite = self.losses_finite and finite
        return losses

    @torch.no_grad()
    def pseudo_gradient(self, global_params: Mapping[str, torch.Tensor], names: Sequence[str],
                        in_place: bool = False) -> dict[str, torch.Tensor]:
        """Δ_r = θ_global − θ_r of the tensors `names` (docs/strategies.md), float32.

        `in_place`: written over θ_r's own storage, for a caller that replaces those tensors
        with the global ones next (`take_global` with mix 0) and needs no copy meanwhile."""
        return {name: torch.sub(global_params[name], self.params[name],
                                out=self.params[name] if in_place else None)
                for name in names}

    @torch.no_grad()
    def take_global(self, global_params: Mapping[str, torch.Tensor], names: Sequence[str],
                    mix: float = 0.0) -> None:
        """θ_r ← mix·θ_r + (1 − mix)·θ_global for the tensors `names` (a copy when mix is 0)."""
        for name in names:
            if mix == 0.0:
                self.params[name].copy_(global_params[name])
            else:
                self.params[name].copy_(mix * self.params[name] + (1 - mix) * global_params[name])

    def reset(self, global_params: Mapping[str, torch.Tensor]) -> None:
        """Start again from the global parameters with the optimizer's moments forgotten (after a
        diverged replica was left out of a merge: its parameters and moments may be NaN); the
        LR schedule and the stream go on."""
        self.take_global(global_params, list(self.params))
        self.optimizer.state.clear()
        self.losses_finite = True

    def rejoin(self, steps_done: int, global_params: Mapping[str, torch.Tensor]) -> None:
        """Go on as a replica that took no part in the syncs so far but is due to start inner
        step `steps_done` + 1 now (its worker was lost, or replaced): θ_r ← θ, the optimizer's
        moments forgotten, the LR schedule at step `steps_done`, and the stream where
        `steps_done` batches from the start leave it (a function of the count: ReplicaStream.
        position_after), so it reads what it would have read; nothing else of the past is
        kept (error-feedback residual)."""
        self.reset(global_params)
        schedule_at(self.optimizer, self.schedule, steps_done)
        self.stream.seek(self.stream.position_after(steps_done))
        self.feedback = {}

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, LR schedule, stream position, error-feedback residual (if
        any) and, with `keeps_params`, the parameters and `losses_finite`: tensors and plain
        values only.
        The position is the count of sequences read this epoch and, to check it on resume, the
        shard file (its name) and row it stands at."""
        shard, row = self.stream.where()
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "stream": {"epoch": self.stream.position.epoch,
                       "sequences": self.stream.position.sequences,
                       "shard": Path(shard).name, "row": row}}
        if self.feedback:
            state["feedback"] = dict(self.feedback)
        if self.keeps_params:
            state["params"] = {name: p.detach() for name, p in self.params.items()}
            state["losses_finite"] = self.losses_finite
        return state

    def load_state_dict(self, state: Mapping[str, Any],
                        global_params: Mapping[str, torch.Tensor]) -> None:
        """Restore `state_dict()`; parameters not in it are the (restored) global ones. The
        stream continues with its next unseen batch, read from the shard and row it stood at
        (CheckpointError if the data's shards now put that position elsewhere: they changed
        since the checkpoint, or if the checkpoint lacks the parameters a streaming run
        keeps)."""
        if self.keeps_params and set(state.get("params", ())) != set(self.params):
            raise CheckpointError(
                f"replica {self.index}'s checkpoint does not hold the model's parameters of "
                "its own, which outer.fragments, delay or mix keep: it was written with other "
                "settings")
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        device = next(iter(self.optimizer.param_groups[0]["params"])).device
        self.feedback = {name: t.to(device) for name, t in state.get("feedback", {}).items()}
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state["params"][name] if self.keeps_params else global_params[name])
        self.losses_finite = bool(state.get("losses_finite", True))
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


@torch.no_grad()
def load_parameters(model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy `params` (by name) into the model's parameters in place."""
    for name, p in model.named_parameters():
        p.copy_(params[name])


@torch.no_grad()
def load_parameters_into(params: Mapping[str, torch.Tensor], model: nn.Module) -> None:
    """Copy the model's parameters into `params` (by name) in place."""
    for name, p in model.named_parameters():
        params[name].copy_(p)


@torch.no_grad()
def snapshot_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """A float32 copy of the model's parameters, by name."""
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def parameters_finite(params: Mapping[str, torch.Tensor]) -> bool:
    """Whether every parameter value is finite (one host sync for all tensors)."""
    bad = torch.stack([torch.isfinite(t).logical_not().sum() for t in params.values()]).sum()
    return int(bad) == 0
