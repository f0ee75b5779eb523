"""What one GPU worker holds, in bytes, from the config and the model's shapes: checked before
training starts (`train.start_ray`), so a layout that cannot fit is refused with the figures
and the fix instead of failing out of memory in every worker, run.max_failures times.

The training state is counted exactly (everything is float32, laid out by workers/): the scratch
model, its gradients, the global parameters θ, each hosted replica's own parameters (when a
worker hosts several), the inner optimizer's moments (AdamW's two; Muon's one of each hidden
matrix) and error-feedback residual, and the outer momentum of the tensors the worker owns. A
run whose state alone exceeds the smallest GPU is refused. What a step
and a sync hold on top of it is an estimate (activations and logits of one micro-batch, the
pseudo-gradients a merge gathers and its float64 work): a run estimated above 90% of the GPU
gets a warning naming the settings that lower it. `benchmarks/gpu_check.sh` records the peak
memory a GPU measured, against which the estimate is calibrated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from isoloco_ray.config import ConfigError, TrainConfig
from isoloco_ray.strategies import MERGES, STRATEGIES, OuterMerge, Route

FLOAT32 = 4
FLOAT64 = 8
GIB = 2**30
# What the CUDA context, cuBLAS workspaces and the caching allocator's slack take besides the
# tensors (typical of an H100 process with torch 2.x).
RUNTIME_BYTES = 1 * GIB
# Above this fraction of the GPU, the estimated peak gets a warning.
WARN_FRACTION = 0.9


@dataclass(frozen=True)
class GpuMemory:
    """One GPU worker's bytes, by part: the training `state`, exact; what a training `step`
    and an outer `sync` hold on top of it, estimated. `replicas_per_worker`: the replicas it
    hosts (at the fewest workers the run may use), which the fix names."""

    state: dict[str, int]
    step: dict[str, int]
    sync: dict[str, int]
    replicas_per_worker: int

    @property
    def state_bytes(self) -> int:
        return sum(self.state.values())

    @property
    def peak_bytes(self) -> int:
        """The estimated peak: state, runtime, and the larger of a step's and a sync's extra."""
        return (self.state_bytes + RUNTIME_BYTES
                + max(sum(self.step.values()), sum(self.sync.values())))

    def describe(self, parts: Mapping[str, int]) -> str:
        """The largest parts first, in GiB: 'AdamW moments 45.6, parameters 5.7, ...'."""
        return ", ".join(f"{name} {size / GIB:.1f}" for name, size in
                         sorted(parts.items(), key=lambda item: -item[1]) if size)

    def summary(self, gpu_bytes: int) -> str:
        """One line for the run's start: state and estimated peak against the GPU's memory."""
        return (f"GPU memory per worker: state {self.state_bytes / GIB:.1f} GiB, estimated "
                f"peak {self.peak_bytes / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} GiB")

    def check(self, gpu_bytes: int) -> str | None:
        """ConfigError when the state alone exceeds `gpu_bytes` (the smallest GPU of the
        cluster); a warning line when the estimated peak exceeds WARN_FRACTION of it; else
        None."""
        gpu = f"{gpu_bytes / GIB:.1f} GiB"
        if self.state_bytes > gpu_bytes:
            fix = ("lower scaling.replicas_per_worker (more workers, each hosting fewer "
                   "replicas; with scaling.min_workers, raise it too) or choose a smaller model"
                   if self.replicas_per_worker > 1 else
                   "choose a smaller model (model.preset) or GPUs with more memory")
            field = ("scaling.replicas_per_worker" if self.replicas_per_worker > 1
                     else "model.preset")
            raise ConfigError(
                f"{field}: one GPU worker would hold {self.state_bytes / GIB:.1f} GiB of "
                f"training state ({self.describe(self.state)}), more than its GPU's {gpu}; "
                f"{fix}")
        if self.peak_bytes > WARN_FRACTION * gpu_bytes:
            extra = self.step if sum(self.step.values()) >= sum(self.sync.values()) else self.sync
            return (f"warning: one GPU worker is estimated to peak at "
                    f"{self.peak_bytes / GIB:.1f} GiB of its GPU's {gpu} (state "
                    f"{self.state_bytes / GIB:.1f}; {self.describe(extra)}): it may run out of "
                    "memory; set model.activation_checkpointing=true, lower "
                    "data.micro_batch_size or scaling.replicas_per_worker")
        return None


def estimate(cfg: TrainConfig, shapes: Mapping[str, Sequence[int]], vocab_size: int
             ) -> GpuMemory:
    """The bytes of one GPU worker of the run `cfg` whose model has parameters of `shapes`
    and `vocab_size` tokens, at the fewest workers it may run on (the most replicas each)."""
    sizes = [math.prod(shape) for shape in shapes.values()]
    params, largest = sum(sizes), max(sizes)
    scaling, outer = cfg.scaling, cfg.outer
    workers = min(scaling.worker_counts)
    hosted = scaling.replicas_per_worker_at(workers)
    spec = STRATEGIES[outer.strategy]
    model = FLOAT32 * params
    # AdamW keeps two moments of every parameter; Muon one of each matrix it takes.
    moments, moments_name = 2 * params, "AdamW moments"
    if cfg.inner.optimizer == "muon":
        from isoloco_ray.workers.inner_optimizer import muon_takes

        moments -= sum(math.prod(shape) for name, shape in shapes.items()
                       if muon_takes(name, shape))
        moments_name = "Muon and AdamW moments"
    state = {
        "parameters": model,
        "gradients": model,
        "global parameters": model,
        # A worker hosting one replica trains it in the model itself.
        "replicas' own parameters": model * hosted if hosted > 1 else 0,
        moments_name: FLOAT32 * moments * (1 if not spec.has_outer_step else hosted),
        "error-feedback residuals": model * hosted if outer.error_feedback else 0,
    }
    sync: dict[str, int] = {}
    if spec.has_outer_step:
        merge = OuterMerge.of(outer)
        owned = _most_owned(cfg, merge, shapes, workers // scaling.workers_per_replica,
                            scaling.workers_per_replica)
        state["outer momentum"] = FLOAT32 * owned if outer.momentum else 0
        if merge.of_mean:
            sync["summed pseudo-gradients"] = 2 * FLOAT32 * owned
        else:
            sync["gathered pseudo-gradients"] = FLOAT32 * scaling.replicas * owned
        if MERGES[merge.merge].spectral:  # float64 stacks and factorisations of one tensor
            sync["merge work"] = 3 * FLOAT64 * scaling.replicas * largest
        if outer.delay or outer.mix:  # Δ_r taken beside θ_r, not over it
            sync["pseudo-gradients in flight"] = model * hosted // outer.fragments
    return GpuMemory(state, _step_bytes(cfg, vocab_size), sync, hosted)


def _most_owned(cfg: TrainConfig, merge: OuterMerge, shapes: Mapping[str, Sequence[int]],
                outer_ranks: int, positions: int) -> int:
    """Entries of the tensors whose outer step (and momentum) the busiest worker holds, in G =
    `positions` outer groups of `outer_ranks`: its position's share (plan.position_shares),
    all of it when every worker merges (Route), else its owner's part under the plan the
    workers build (OuterSync.plan), fragment by fragment."""
    import torch

    from isoloco_ray.workers.outer.plan import OuterPlan, position_shares
    from isoloco_ray.workers.rounds.fragments import split_fragments

    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    torch_shapes = {name: torch.Size(shape) for name, shape in shapes.items()}
    everyone = Route.choose(cfg.outer, merge).everyone_merges
    held = [[0] * outer_ranks for _ in range(positions)]
    for names in split_fragments(torch_shapes, cfg.outer.fragments):
        shares = position_shares({name: torch_shapes[name] for name in names}, merge.merge,
                                 cfg.scaling.replicas, positions, merge.orthogonalize_update)
        for position, share in enumerate(shares):
            plan = OuterPlan.build({name: torch_shapes[name] for name in share}, merge.merge,
                                   cfg.scaling.replicas, outer_ranks,
                                   "replicated" if everyone else cfg.outer.placement,
                                   merge.orthogonalize_update)
            for rank, owned in enumerate(plan.owned):
                # Replicated: rank 0 "owns" all (it saves them); every rank holds them.
                held[position][rank] += sum(sizes[name] for name in owned)
    return max(max(row) for row in held)


def _step_bytes(cfg: TrainConfig, vocab_size: int) -> dict[str, int]:
    """What one micro-batch's forward keeps for its backward (Llama blocks: a float32 residual
    stream and norms, projections in the autocast dtype), and its logits and their gradient."""
    shape, data = cfg.model.shape, cfg.data
    tokens = cfg.resolved.micro_batch_size * data.seq_len
    low = 2 if cfg.run.autocast == "bf16" or (cfg.run.autocast == "auto"
                                               and cfg.scaling.use_gpu) else FLOAT32
    hidden, inner = shape.hidden_size, shape.intermediate_size
    kv = hidden * shape.num_kv_heads // shape.num_heads
    block = FLOAT32 * 4 * hidden + low * (5 * hidden + 2 * kv + 4 * inner)  # per token
    if cfg.model.activation_checkpointing:  # the blocks' inputs, and one block recomputed
        activations = tokens * (FLOAT32 * hidden * shape.num_layers + block)
    else:
        activations = tokens * block * shape.num_layers
    return {"activations": activations,
            "logits": tokens * vocab_size * (low + 2 * FLOAT32)}  # logits, float32 copy, grad
