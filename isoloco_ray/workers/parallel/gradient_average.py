"""Averaging one step's gradients over the workers that share it, overlapped with backward.

A replica spread over G workers (layout.ReplicaShard) and adamw_ddp's data-parallel step sum
their gradients over a group every inner step, then divide. Instead of one all-reduce after
backward, each bucket of gradients starts its all-reduce (asynchronously) as soon as the last
micro-batch's backward has produced all of it, so the transfer runs while backward computes
the rest; `finish` waits for them, then divides.

The buckets are those of collectives.all_reduce_sum (the parameters in model order, cut at
BUCKET_BYTES), each flattened and summed the same way, so the averaged gradients are the ones
a plain all-reduce after backward gives, bit for bit. Buckets start in a fixed order (the last
parameters', which backward produces first, before the earlier ones'), the same on every rank
whatever order the hooks fire in, as collectives of one group require. torch's DDP would do
the transfer alike, but buckets its own way (so other sums for more than two workers), divides
before summing and wraps the module the replicas share; FSDP shards parameters a model this
size does not need sharded (gpu_memory.py counts what fits).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from isoloco_ray.workers.parallel.collectives import (
    BUCKET_BYTES,
    Group,
    TrafficCounter,
    buckets,
    flatten,
    group_size,
    start_all_reduce,
    unflatten,
)


class GradientAverage:
    """Averages the gradients of `params` over `group`'s ranks (sum, then / `divisor`), the
    all-reduces started during the last backward of a step (`arm` before it, `finish`
    after).

    `zero_missing`: a parameter without a gradient joins the sum with zeros (every rank must
    join it even when it read no batch: adamw_ddp); otherwise it stays without one (the
    replica's workers run the same graph, so it has none on any of them)."""

    def __init__(self, params: Sequence[nn.Parameter], group: Group, divisor: int,
                 traffic: TrafficCounter | None = None, zero_missing: bool = False,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group, self.divisor, self.zero_missing = group, divisor, zero_missing
        self.ranks = group_size(group)
        self.traffic = traffic if traffic is not None else TrafficCounter()
        self.buckets = list(buckets([p.numel() * p.element_size() for p in self.params],
                                    bucket_bytes))
        self._bucket_of = {id(self.params[i]): k for k, index in enumerate(self.buckets)
                           for i in index}
        self._waiting: list[int] = []  # per bucket: its parameters backward has yet to finish
        self._next = len(self.buckets) - 1  # the bucket to start next (last to first)
        self._started: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        self._hooks: list[RemovableHandle] = []
        self.started_in_backward = 0  # buckets the last step started before `finish`
        self.finish_seconds = 0.0  # summed over steps: what training waited in `finish`

    def arm(self) -> None:
        """Start each bucket's all-reduce as soon as the coming backward has finished its
        gradients (call it before the step's last backward)."""
        if self.ranks == 1:
            return
        self._waiting = [len(index) for index in self.buckets]
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_done)
                       for p in self.params]

    def finish(self) -> None:
        """Start what backward did not (no backward ran, or parameters got no gradient),
        wait for every all-reduce, and leave each gradient the group's mean."""
        began = time.perf_counter()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.started_in_backward = len(self._started)
        if self.ranks == 1:  # nothing to sum: the mean is the gradient over `divisor`
            for grad in self._gradients(range(len(self.params))):
                grad /= self.divisor
            self.finish_seconds += time.perf_counter() - began
            return
        while self._next >= 0:
            self._start(self._next)
            self._next -= 1
        for work, flat, grads in self._started:
            work.wait()
            for grad, summed in zip(grads, unflatten(flat, [g.shape for g in grads])):
                grad.copy_(summed)
                grad /= self.divisor
        self._started = []
        self._next = len(self.buckets) - 1
        self.finish_seconds += time.perf_counter() - began

    def _gradient_done(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        self._waiting[bucket] -= 1
        while self._next >= 0 and self._waiting[self._next] == 0:
            self._start(self._next)
            self._next -= 1

    def _gradients(self, index: Sequence[int]) -> list[torch.Tensor]:
        grads = []
        for i in index:
            param = self.params[i]
            if param.grad is None and self.zero_missing:
                param.grad = torch.zeros_like(param)
            if param.grad is not None:
                grads.append(param.grad)
        return grads

    def _start(self, bucket: int) -> None:
        grads = self._gradients(self.buckets[bucket])
        if not grads:
            return
        flat = flatten(grads, grads[0].dtype, grads[0].device)
        self._started.append((start_all_reduce(flat, self.traffic, self.group), flat, grads))
