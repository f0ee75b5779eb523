"""`TrainConfig`, a whole run's settings: the sections, checked against each other and
resolved (presets and the strategy's paper values filled in)."""

from __future__ import annotations

from pydantic import model_validator

from isoloco_ray.config.resolved import Resolved, settled
from isoloco_ray.config.schema import (
    DataConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    RunConfig,
    ScalingConfig,
    Section,
)
from isoloco_ray.strategies import (
    OUTER_STEP_OPTIONS,
    STRATEGIES,
    WIRE_FORMATS,
    OuterMerge,
    Route,
    have_no_effect,
)


class TrainConfig(Section):
    """A whole training run."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    scaling: ScalingConfig = ScalingConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _resolve(self) -> TrainConfig:
        spec = STRATEGIES[self.outer.strategy]
        preset = spec.paper
        if not spec.has_outer_step:
            for option in OUTER_STEP_OPTIONS:
                value = getattr(self.outer, option)
                # The preset's own value is allowed, so a resolved config round-trips (adamw_ddp
                # fills lr/momentum/nesterov with inert values).
                if value is not None and value != preset[option]:
                    raise ValueError(
                        f"outer.{option} does not apply to outer.strategy "
                        f"'{self.outer.strategy}' (only to the strategies with an outer step); "
                        "remove it")
        self._check_streaming()
        if self.inner.lr is None:
            self.inner.lr = preset["inner_lr"]
        if self.inner.weight_decay is None:
            self.inner.weight_decay = spec.inner_weight_decay
        for key, value in preset.items():
            if key != "inner_lr" and getattr(self.outer, key) is None:
                setattr(self.outer, key, value)
        if self.outer.nesterov and not self.outer.momentum:
            raise ValueError("outer.nesterov needs outer.momentum > 0; set --outer.momentum "
                             "or --outer.nesterov=false")
        self._check_outer_effective()
        self._check_fault_tolerance()
        self.outer.settle_options(self.scaling.replicas)
        if self.run.token_budget is not None:
            rounds = self.run.token_budget // self.tokens_per_round
            # A resolved config carries both; only a disagreement is the user's error.
            if self.run.rounds is not None and self.run.rounds != rounds:
                raise ValueError("set run.rounds or run.token_budget, not both")
            self.run.rounds = rounds
            if rounds < 1:
                raise ValueError(
                    f"run.token_budget ({self.run.token_budget}) is less than one outer round "
                    f"({self.tokens_per_round} tokens = batch_size x seq_len x inner.steps x "
                    "replicas)")
        elif self.run.rounds is None:
            self.run.rounds = 12
        # A replica spread over G workers gives each batch_size / G rows of every batch.
        rows = self.data.batch_size // self.scaling.workers_per_replica
        if self.data.micro_batch_size > rows > 0:
            self.data.micro_batch_size = rows
        uneven = self.data.batch_size % self.scaling.workers_per_replica
        if uneven or rows % self.data.micro_batch_size:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must split evenly over "
                f"scaling.workers_per_replica ({self.scaling.workers_per_replica}) workers into "
                f"whole micro-batches of data.micro_batch_size ({self.data.micro_batch_size}); "
                "e.g. set --data.micro_batch_size=1")
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds the model's context "
                f"model.max_seq_len ({self.model.max_seq_len}); lower data.seq_len or raise "
                f"model.max_seq_len")
        return self

    def _check_outer_effective(self) -> None:
        """Refuse outer settings that would be accepted and change nothing under the others
        (checked on resolved values: a value equal to the harmless one, as a resolved config
        holds, passes)."""
        outer = self.outer
        if not outer.has_outer_step:
            inert = [f"outer.{name}={getattr(outer, name)}" for name, harmless in
                     (("comm_dtype", "float32"), ("topk", None), ("placement", "sharded"))
                     if getattr(outer, name) != harmless]
            if inert:
                raise ValueError(f"{have_no_effect(inert)} with adamw_ddp (it has no outer "
                                 "sync: its gradients are all-reduced in float32 every inner "
                                 f"step); remove {'it' if len(inert) == 1 else 'them'}")
            return
        if outer.lr == 0:
            raise ValueError("outer.lr = 0 never moves the global model; set outer.lr > 0, or "
                             "leave it unset for the strategy's value")
        wire = WIRE_FORMATS[outer.comm_dtype]
        route = Route.choose(outer, OuterMerge.of(outer))
        if not wire.lossless and route.sums and route.everyone_merges:  # all-reduced in float32
            raise ValueError(f"outer.comm_dtype={wire.name} has no effect with "
                             f"outer.placement=replicated and outer.strategy "
                             f"'{outer.strategy}': every worker merges the all-reduced float32 "
                             "sum of the pseudo-gradients, so nothing is cast; use placement "
                             f"sharded or rank0 to send {wire.name}, or comm_dtype float32")

    def _check_fault_tolerance(self) -> None:
        """What `scaling.fault_tolerance: replica` runs so far: every DiLoCo strategy's outer
        step over a quorum, on every wire, without streaming, on CPUs."""
        if self.scaling.fault_tolerance != "replica":
            return
        if self.run.max_failures == 0:
            raise ValueError(
                "scaling.fault_tolerance: replica replaces a lost worker as one Ray Train "
                "failure: set run.max_failures >= 1 (or -1, unlimited)")
        outer, unsupported = self.outer, []
        if outer.placement == "rank0":
            raise ValueError("outer.placement=rank0 has no effect with scaling.fault_tolerance: "
                             "replica (every worker merges the quorum's sum: rank 0 may be "
                             "gone); remove it")
        if not outer.has_outer_step:
            unsupported.append("outer.strategy adamw_ddp (it all-reduces every inner step)")
        if outer.streaming:
            unsupported.append("outer.fragments, outer.delay or outer.mix")
        if self.scaling.use_gpu:
            unsupported.append("scaling.use_gpu")
        if unsupported:
            raise ValueError(
                f"scaling.fault_tolerance: replica does not run {'; '.join(unsupported)} yet "
                "(it runs every outer strategy but adamw_ddp, on every wire, on CPUs: "
                "docs/fault_tolerance.md); set --scaling.fault_tolerance=restart")

    def _check_streaming(self) -> None:
        outer, steps = self.outer, self.inner.steps
        if outer.streaming and not outer.has_outer_step:
            raise ValueError("outer.fragments, outer.delay and outer.mix shape the outer sync, "
                             "and adamw_ddp has none: leave them at 1, 0 and 0")
        if steps % outer.fragments:
            raise ValueError(f"outer.fragments ({outer.fragments}) must divide inner.steps "
                             f"({steps}): fragment p syncs p·inner.steps/fragments steps after "
                             "fragment 0")
        if outer.delay >= steps // outer.fragments:
            raise ValueError(f"outer.delay ({outer.delay}) must be less than inner.steps / "
                             f"outer.fragments ({steps // outer.fragments}): a fragment's "
                             "update must land before the next fragment's sync starts")
        if outer.delay > 0 and self.scaling.use_gpu and self.scaling.workers_per_replica > 1:
            raise ValueError(
                f"outer.delay ({outer.delay}) > 0 with scaling.workers_per_replica "
                f"({self.scaling.workers_per_replica}) > 1 on GPUs: the replica's per-step "
                "gradient all-reduce and the background outer sync would drive two NCCL "
                "communicators from two threads at once, which NCCL does not order (a hang); "
                "set outer.delay=0 or scaling.workers_per_replica=1")
        if outer.fragments > self.model.num_layers:
            raise ValueError(f"outer.fragments ({outer.fragments}) exceeds model.num_layers "
                             f"({self.model.num_layers}): a fragment is whole layers")

    @property
    def resolved(self) -> Resolved:
        """The settings validation decided where they were left unset, typed as set."""
        return Resolved(
            rounds=settled(self.run.rounds, "run.rounds"),
            micro_batch_size=settled(self.data.micro_batch_size, "data.micro_batch_size"))

    @property
    def tokens_per_round(self) -> int:
        """Training tokens consumed by all replicas in one outer round."""
        return (self.data.batch_size * self.data.seq_len * self.inner.steps
                * self.scaling.replicas)
