"""The sections of a run's settings (model, data, scaling, inner, outer, W&B, run), each
validated on its own, and the model presets."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from isoloco_ray.config.resolved import ModelShape, settled
from isoloco_ray.strategies import (
    STRATEGIES,
    WIRE_FORMATS,
    OuterMerge,
    Placement,
    strategy_options,
)

ModelPreset = Literal["tiny", "demo", "178M", "512M"]

# Llama sizes. "178M" and "512M" are the paper's (docs/strategies.md); "demo" is the ~3M model that
# trains visibly on 2 CPU cores in minutes; "tiny" is for tests.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=176, max_seq_len=256),
    "demo": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
                 intermediate_size=352, max_seq_len=256),
    "178M": dict(hidden_size=1024, num_layers=9, num_heads=8, num_kv_heads=8,
                 intermediate_size=2688, max_seq_len=2048),
    "512M": dict(hidden_size=1536, num_layers=12, num_heads=12, num_kv_heads=12,
                 intermediate_size=5440, max_seq_len=2048),
}

# Run and grid names become directory names under run.storage_path (and Ray Train's run names,
# which Ray encodes as ASCII): one path component of a safe character set, bounded in length.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+-]*")
NAME_MAX_LEN = 128


def check_name(name: str, field: str) -> str:
    """`name` if it is a safe directory name for `field` (run.name, a grid's name), else
    ValueError saying what is allowed."""
    if len(name) > NAME_MAX_LEN:
        raise ValueError(f"{field} is {len(name)} characters long; use at most {NAME_MAX_LEN}")
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"{field} {name!r} must be one directory name: ASCII letters, digits and . _ = , + - "
            "starting with a letter or digit (no '/', '..', spaces or other characters)")
    return name


def path_text(value: Any) -> Any:
    """A path setting as text (a local path or a URI, which pathlib would mangle)."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class Section(BaseModel):
    # inf/nan in any float setting would train a NaN model: refused where it is read.
    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


class ModelConfig(Section):
    """The Llama to train: a preset, optionally with explicit sizes overriding it."""

    preset: ModelPreset = Field("demo", description="size preset: tiny, demo (~3M), 178M, 512M")
    hidden_size: int | None = Field(None, gt=0, description="hidden size (default: preset)")
    num_layers: int | None = Field(None, gt=0, description="transformer blocks (default: preset)")
    num_heads: int | None = Field(None, gt=0, description="attention heads (default: preset)")
    num_kv_heads: int | None = Field(
        None, gt=0, description="key/value heads, < num_heads for grouped-query attention "
        "(default: preset)")
    intermediate_size: int | None = Field(None, gt=0, description="MLP width (default: preset)")
    max_seq_len: int | None = Field(None, gt=0, description="context length (default: preset)")
    vocab_size: int | None = Field(
        None, gt=0, description="vocabulary size (default: the data's tokenizer, from meta.json)")
    activation_checkpointing: bool = Field(
        False, description="keep only each transformer block's input and recompute the rest "
        "in the backward pass: far less activation memory for about a third more compute, the "
        "same numbers (a resumed run may change it)")

    @model_validator(mode="after")
    def _fill_from_preset(self) -> ModelConfig:
        for key, value in MODEL_PRESETS[self.preset].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads "
                f"({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
                f"({self.num_kv_heads})")
        return self

    @property
    def shape(self) -> ModelShape:
        """The sizes validation settled (the preset's where unset)."""
        return ModelShape(
            **{name: settled(getattr(self, name), f"model.{name}")
               for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                            "num_kv_heads", "max_seq_len")},
            vocab_size=self.vocab_size)


class DataConfig(Section):
    """The token data: a prepared directory (meta.json + parquet shards) and batch shapes."""

    path: str | None = Field(
        None, min_length=1, description="prepared data directory (python -m "
        "isoloco_ray.data.prepare), a local path or a URI such as s3://bucket/prefix; default: "
        "the embedded demo corpus, prepared on first use")
    seq_len: int = Field(128, gt=1, description="tokens per training sequence")
    batch_size: int = Field(8, gt=0, description="sequences per inner step, per replica")
    micro_batch_size: int | None = Field(
        None, gt=0, description="sequences per forward/backward; < batch_size accumulates "
        "gradients (default: batch_size)")

    _path_text = field_validator("path", mode="before")(path_text)

    @model_validator(mode="after")
    def _check_micro_batch(self) -> DataConfig:
        if self.micro_batch_size is None:
            self.micro_batch_size = self.batch_size
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"data.batch_size ({self.batch_size}) must be a multiple of "
                f"data.micro_batch_size ({self.micro_batch_size})")
        return self


class ScalingConfig(Section):
    """How replicas map onto Ray Train workers (docs/design.md, "Layout")."""

    replicas: int = Field(4, gt=0, description="R, the number of DiLoCo replicas")
    replicas_per_worker: int = Field(
        2, gt=0, description="V, replicas simulated one after another on each worker")
    workers_per_replica: int = Field(
        1, gt=0, description="G, workers sharing one replica data-parallel (needs V = 1)")
    use_gpu: bool = Field(False, description="one GPU per worker, NCCL collectives")
    cpus_per_worker: float | None = Field(
        None, gt=0, description="logical CPUs Ray reserves per worker, and torch's intra-op "
        "threads in it (the whole part, at least 1). Unset: on a local cluster (no RAY_ADDRESS) "
        "the cores per worker (cores // workers, at least 1); on a cluster joined through "
        "RAY_ADDRESS, and in Tune grids, 1. A resumed run keeps the value it started with")
    min_workers: int | None = Field(
        None, gt=0, description="elastic: start (and go on after losing nodes) with as few as "
        "this many workers, growing to R·G/V when the cluster has room; only worker counts "
        "that keep whole replicas on each worker are used (scaling.worker_counts). Unset: "
        "exactly R·G/V workers")
    fault_tolerance: Literal["restart", "replica"] = Field(
        "restart", description="what a lost worker costs. restart: Ray Train restarts every "
        "worker from the latest checkpoint. replica: the others go on without it (each worker "
        "is a torchft replica group; one quorum per outer round over the workers alive) and "
        "Ray Train replaces it alone; needs torchft (pip install -e '.[ft]')")
    straggler_deadline: float | None = Field(
        1.5, allow_inf_nan=False, description="fault_tolerance replica only: a "
        "worker's inner steps of a round end by this many times what the fastest worker of "
        "recent rounds needs for them (the median of its last 5; one step at least), and its "
        "replicas' pseudo-gradients count weighted by the steps they took, so that a live "
        "straggler neither holds the others nor loses its work (docs/fault_tolerance.md, "
        "\"Stragglers\"). null: every worker takes all inner.steps and the others wait for it "
        "(up to 30 s, then it misses the round)")

    @field_validator("straggler_deadline")
    @classmethod
    def _at_least_one(cls, value: float | None) -> float | None:
        if value is not None and value < 1.0:
            raise ValueError(
                f"must be at least 1 (got {value:g}): a straggler's steps stop at this many "
                "times the fastest worker's usual time, so below 1 every worker would be cut "
                "short; set 1.5 (the default), or null to turn the deadline off")
        return value

    @model_validator(mode="after")
    def _check_layout(self) -> ScalingConfig:
        if self.replicas % self.replicas_per_worker:
            raise ValueError(
                f"scaling.replicas ({self.replicas}) must be divisible by "
                f"scaling.replicas_per_worker ({self.replicas_per_worker}); e.g. set "
                "--scaling.replicas_per_worker="
                f"{math.gcd(self.replicas, self.replicas_per_worker)}")
        if self.workers_per_replica > 1 and self.replicas_per_worker > 1:
            raise ValueError(
                f"scaling.workers_per_replica ({self.workers_per_replica}) > 1 spreads one "
                "replica over several workers, so each worker hosts exactly one: set "
                "--scaling.replicas_per_worker=1")
        if self.min_workers is not None and self.workers_per_replica > 1:
            raise ValueError(
                f"scaling.min_workers ({self.min_workers}) has no effect with "
                f"scaling.workers_per_replica ({self.workers_per_replica}) > 1: a replica spread "
                "over several workers needs them all, so the run cannot shrink; remove it")
        if self.min_workers is not None and self.min_workers not in self.allowed_workers():
            raise ValueError(
                f"scaling.min_workers ({self.min_workers}) must be one of "
                f"{self.allowed_workers()}: the worker counts up to R·G/V = "
                f"{self.num_workers} that split R = {self.replicas} replicas evenly (a replica "
                "spread over workers_per_replica > 1 workers needs them all)")
        if self.min_workers == self.num_workers:
            fewer = [w for w in self.allowed_workers() if w < self.num_workers]
            fix = f"lower it to one of {fewer} for an elastic run, or " if fewer else ""
            raise ValueError(f"scaling.min_workers ({self.min_workers}) is R/V, the only worker "
                             f"count it then allows, so it has no effect; {fix}remove it")
        if self.fault_tolerance == "replica":
            self._check_replica_groups()
        return self

    def _check_replica_groups(self) -> None:
        """The layouts `fault_tolerance: replica` can run (Ray 2.60's torchft integration)."""
        if self.workers_per_replica > 1:
            raise ValueError(
                "scaling.fault_tolerance: replica needs scaling.workers_per_replica = 1: Ray "
                "Train's replica groups are one worker each; set --scaling.fault_tolerance="
                "restart or --scaling.workers_per_replica=1")
        if self.min_workers is not None:
            raise ValueError(
                "scaling.fault_tolerance: replica cannot be combined with scaling.min_workers: "
                "Ray Train does not resize a run with torchft; remove scaling.min_workers")
        if self.num_workers < 2:
            raise ValueError(
                f"scaling.fault_tolerance: replica needs at least 2 workers (R/V = "
                f"{self.num_workers}): a quorum of a majority of the workers goes on when one "
                "is lost; lower scaling.replicas_per_worker or use restart")

    def allowed_workers(self) -> list[int]:
        """Every worker count W ≤ R/V on which the run's replicas lay out whole: the divisors
        of R (each worker then hosts R/W of them). A replica spread over G > 1 workers needs
        all R·G of them."""
        if self.workers_per_replica > 1:
            return [self.num_workers]
        return [w for w in range(1, self.num_workers + 1) if self.replicas % w == 0]

    @property
    def worker_counts(self) -> list[int]:
        """The worker counts the run may use: R·G/V alone, or with scaling.min_workers the
        allowed ones from it up."""
        if self.min_workers is None:
            return [self.num_workers]
        return [w for w in self.allowed_workers() if w >= self.min_workers]

    def replicas_per_worker_at(self, workers: int) -> int:
        """V when the run has `workers` workers (one of worker_counts): R·G/W."""
        return self.replicas * self.workers_per_replica // workers

    @property
    def num_workers(self) -> int:
        """Ray Train workers: R·G/V."""
        return self.replicas * self.workers_per_replica // self.replicas_per_worker

    @property
    def worker_cpus(self) -> float:
        """Logical CPUs each worker reserves: cpus_per_worker, or 1 while it is unset (the
        train CLI resolves it for a local cluster first: train.with_cpus_per_worker)."""
        return self.cpus_per_worker or 1.0

    @property
    def torch_threads(self) -> int:
        """Torch's intra-op threads in each worker: the whole part of `worker_cpus`, at least 1
        (what Ray gives OMP_NUM_THREADS)."""
        return max(1, math.floor(self.worker_cpus))


# Muon's momentum where inner.optimizer is muon and inner.muon_momentum is unset (torch's
# default, and MuLoCo's).
MUON_MOMENTUM = 0.95


class InnerConfig(Section):
    """Each replica's local optimizer (docs/strategies.md, "Notation"): AdamW, or Muon on the
    hidden weight matrices and AdamW on the rest (workers/inner_optimizer.py)."""

    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw, or muon: Muon (torch.optim.Muon, its update scaled to "
        "AdamW's RMS) on the hidden weight matrices, AdamW on embeddings, head and norms")
    muon_momentum: float | None = Field(None, ge=0, lt=1, description="Muon's Nesterov "
                                        f"momentum (inner.optimizer muon; default "
                                        f"{MUON_MOMENTUM})")
    lr: float | None = Field(None, gt=0, description="peak inner lr (default: the strategy's "
                             "paper value)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    weight_decay: float | None = Field(None, ge=0, description="AdamW weight decay (default 0.1; "
                                       "adamw_ddp 0.15)")
    steps: int = Field(20, gt=0, description="H, inner steps per outer round (paper: 30); "
                       "for adamw_ddp, the data-parallel steps between two progress lines")
    warmup: float = Field(0.1, ge=0, lt=1, description="fraction of all inner steps spent in "
                          "linear warmup from 0.1x lr; then cosine to 0.1x lr")
    clip: float | None = Field(1.0, gt=0, description="gradient-norm clip (null: no clipping)")

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"inner.betas {list(betas)}: each must be in [0, 1), e.g. "
                             "[0.9, 0.95]")
        return betas

    @model_validator(mode="after")
    def _settle_muon_momentum(self) -> InnerConfig:
        if self.optimizer == "muon":
            if self.muon_momentum is None:
                self.muon_momentum = MUON_MOMENTUM
        elif self.muon_momentum is not None:
            raise ValueError(f"inner.muon_momentum {self.muon_momentum:g} has no effect with "
                             "inner.optimizer adamw: set inner.optimizer=muon, or drop it")
        return self


class OuterConfig(Section):
    """The outer step: which merge, and its optimizer (docs/strategies.md). The strategy's own
    options (outer.sparsity, outer.keep_fraction, ...) are the fields of its options model in
    the registry (strategies.py), checked and filled in with their defaults here."""

    # Keys beyond the fields below are the strategy's options (`strategy_options`).
    model_config = ConfigDict(extra="allow")

    strategy: str = Field("diloco", description=", ".join(STRATEGIES))
    lr: float | None = Field(None, ge=0, description="outer lr η (default: the strategy's)")
    momentum: float | None = Field(None, ge=0, lt=1, description="outer momentum μ "
                                   "(default: the strategy's)")
    nesterov: bool | None = Field(None, description="Nesterov momentum (default: the strategy's)")
    placement: Placement = Field(
        "sharded", description="who merges each tensor: sharded (owners spread over the workers, "
        "balanced by cost), rank0 (one worker merges all), replicated (every worker merges all)")
    comm_dtype: Literal[tuple(WIRE_FORMATS)] = Field(  # type: ignore[valid-type]
        "float32", description="how pseudo-gradients and updates travel to and from their "
        "owners: bfloat16 halves the bytes; int8 and float8 (e4m3) quarter them, one byte per "
        "entry plus a float32 scale per row (merges still run in float32 or float64 on the "
        "decoded values; all-reduced sums stay float32); int2 and int4, with topk: SparseLoCo's "
        "wire, the largest topk of each 64x64 chunk's entries in 12-bit positions and 2- or "
        "4-bit codes, gathered by every worker (placement replicated) or, for the merges of "
        "every Δ_r, sent to each tensor's owner, whose update comes back packed alike with "
        "the owner's own error feedback (placement sharded or rank0)")
    topk: float | None = Field(
        None, gt=0, lt=1, description="send only this fraction of each row of a "
        "pseudo-gradient, its largest entries (values in comm_dtype and int32 indices; with "
        "comm_dtype int2 or int4, of each 64x64 chunk); updates stay dense. Best with "
        "error_feedback")
    error_feedback: bool = Field(
        False, description="each replica adds what the transport lost of its pseudo-gradient "
        "last round to this round's before sending it (needs a lossy comm_dtype or topk)")
    error_decay: float = Field(
        1.0, gt=0, le=1, description="error feedback's β: each replica's residual is "
        "multiplied by it before it joins the next round's pseudo-gradient (SparseLoCo's "
        "decaying accumulator uses 0.95; 1 keeps it whole). Needs error_feedback")

    fragments: int = Field(
        1, ge=1, description="streaming: split the parameters into this many fragments of whole "
        "transformer layers, balanced by size, each synced every inner.steps, staggered by "
        "inner.steps / fragments (which must be whole)")
    delay: int = Field(
        0, ge=0, description="inner steps a fragment's sync overlaps with training: its "
        "pseudo-gradient is sent and merged in the background and the update lands this many "
        "steps later (less than inner.steps / fragments)")
    mix: float = Field(
        0.0, ge=0, lt=1, description="where a fragment's update lands, each replica keeps "
        "mix·local + (1 − mix)·global of it (0: takes the global, as DiLoCo)")

    @field_validator("strategy")
    @classmethod
    def _check_strategy(cls, strategy: str) -> str:
        if strategy not in STRATEGIES:
            raise ValueError(f"outer.strategy must be one of {', '.join(STRATEGIES)} (got "
                             f"{strategy!r})")
        return strategy

    @model_validator(mode="after")
    def _take_the_strategys_options(self) -> OuterConfig:
        # Every option of the strategy, as given or its default (an unset per-R default stays
        # None until TrainConfig knows R: settle_options).
        self.__pydantic_extra__ = strategy_options(self.strategy, self.__pydantic_extra__ or {})
        return self

    def settle_options(self, replicas: int) -> None:
        """Fill in the options whose defaults depend on the number of replicas R."""
        self.__pydantic_extra__ = strategy_options(self.strategy, self.strategy_options,
                                                   replicas)

    @property
    def strategy_options(self) -> dict[str, Any]:
        """The strategy's options (its options model's fields in the registry), resolved."""
        return dict(self.__pydantic_extra__ or {})

    @property
    def has_outer_step(self) -> bool:
        """The registry's word (strategies.StrategySpec): False for the data-parallel
        baseline, whose gradients are all-reduced every inner step (adamw_ddp)."""
        return STRATEGIES[self.strategy].has_outer_step

    @property
    def streaming(self) -> bool:
        """Whether replicas keep parameters of their own between syncs (fragments, delay or
        mix): then they are part of a checkpoint."""
        return self.fragments > 1 or self.delay > 0 or self.mix > 0

    @property
    def lossy_wire(self) -> bool:
        """Whether the outer sync's wire loses anything: a lossy outer.comm_dtype (the
        registry's WIRE_FORMATS) or outer.topk. Error feedback needs one."""
        return not WIRE_FORMATS[self.comm_dtype].lossless or self.topk is not None

    @model_validator(mode="after")
    def _take_the_strategys_wire(self) -> OuterConfig:
        # First of the checks: they check the wire the run will use (sparseloco's int2 top-k).
        wire = STRATEGIES[self.strategy].wire
        unset = set(wire) - self.model_fields_set
        for option in unset:
            setattr(self, option, wire[option])
        if "error_feedback" in unset and not self.lossy_wire:
            self.error_feedback = False  # the run's own lossless wire: nothing to correct
        if not self.error_feedback and "error_decay" in unset:
            self.error_decay = 1.0  # the strategy's β decays a residual this run keeps none of
        return self

    @model_validator(mode="after")
    def _check_chunked_wire(self) -> OuterConfig:
        if not WIRE_FORMATS[self.comm_dtype].chunked or not self.has_outer_step:
            return self  # without an outer step: TrainConfig says the wire has no effect
        if self.topk is None:
            raise ValueError(f"outer.comm_dtype={self.comm_dtype} sends the largest entries of "
                             "each 64x64 chunk: set outer.topk, the share kept (SparseLoCo: "
                             "0.01-0.03)")
        if self.placement != "replicated" and OuterMerge.of(self).of_mean:
            # Owners pay off where the merge is costly (docs/outer_sync.md, "Every worker
            # merging, or each tensor's owner"): not for a merge of the mean.
            raise ValueError(f"outer.comm_dtype={self.comm_dtype} with outer.placement="
                             f"{self.placement} has each tensor's owner merge and send its "
                             "update back packed, for the merges of every Δ_r (tsv, isocts, "
                             f"ties, dare); {self.strategy} merges the mean, which every "
                             "worker merges for less (SparseLoCo): set "
                             "outer.placement=replicated")
        return self

    @model_validator(mode="after")
    def _check_error_feedback(self) -> OuterConfig:
        if self.error_feedback and not self.lossy_wire:
            raise ValueError("outer.error_feedback corrects what the transport loses, and float32 "
                             "without outer.topk loses nothing: set outer.comm_dtype to int8, "
                             "float8 or bfloat16, or outer.topk, or turn error_feedback off")
        if self.error_decay != 1.0 and not self.error_feedback:
            raise ValueError(f"outer.error_decay ({self.error_decay:g}) decays error feedback's "
                             "residuals: set outer.error_feedback=true, or leave error_decay "
                             "at 1")
        if self.error_feedback and not self.has_outer_step:
            raise ValueError("outer.error_feedback has no effect with adamw_ddp (it has no outer "
                             "sync): turn it off")
        return self

    def quorum_outer(self) -> OuterConfig:
        """These settings as the quorum's outer step runs them (scaling.fault_tolerance:
        replica): every worker merges what the quorum gathered, i.e. placement replicated."""
        return self.model_copy(update={"placement": "replicated"})


class WandbConfig(Section):
    """Optional Weights & Biases logging (needs `pip install 'isoloco_ray[wandb]'`)."""

    project: str | None = Field(None, description="W&B project; setting it turns logging on "
                                "(nothing contacts W&B otherwise)")
    entity: str | None = Field(None, description="W&B team or user")
    group: str | None = Field(None, description="W&B group (in a Tune grid, unset: the grid's "
                                "name)")
    tags: list[str] = Field(default_factory=list, description="W&B tags")
    mode: Literal["online", "offline"] | None = Field(
        None, description="online, or offline (no network; upload later with `wandb sync`); "
        "unset: WANDB_MODE, else online")

    @model_validator(mode="after")
    def _needs_project(self) -> WandbConfig:
        unused = [name for name in ("entity", "group", "mode") if getattr(self, name) is not None]
        unused += ["tags"] if self.tags else []
        if self.project is None and unused:
            raise ValueError(f"run.wandb.{unused[0]} needs run.wandb.project (W&B logging is "
                             "on only when a project is set)")
        return self


class RunConfig(Section):
    """Length, evaluation, naming and storage of the run."""

    name: str | None = Field(None, description="run name (default: strategy-R-timestamp); "
                             "reusing a name resumes that run")
    storage_path: str = Field("runs", min_length=1, description="directory for runs, a local "
                              "path (made absolute) or a URI such as s3://bucket/prefix")

    _storage_text = field_validator("storage_path", mode="before")(path_text)

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str | None) -> str | None:
        return None if name is None else check_name(name, "run.name")
    rounds: int | None = Field(None, gt=0, description="outer rounds (default 12, or from "
                               "token_budget)")
    token_budget: int | None = Field(None, gt=0, description="total training tokens over all "
                                     "replicas; rounds = budget // (batch·seq·H·R)")
    eval_every: int = Field(4, gt=0, description="evaluate every N rounds (and first and last)")
    eval_tokens: int = Field(65536, gt=0, description="validation tokens per evaluation")
    seed: int = Field(0, description="seed of model init and every random stream")
    checkpoint_every: int = Field(4, gt=0, description="checkpoint every N rounds (and at "
                                  "the end)")
    keep_checkpoints: int = Field(2, gt=0, description="checkpoints kept (the newest)")
    max_failures: int = Field(3, ge=-1, description="worker-group restarts from the latest "
                              "checkpoint after a crash (-1: unlimited)")
    max_bad_rounds: int = Field(3, gt=0, description="stop after this many consecutive rounds "
                                "in which every replica diverged")
    autocast: Literal["auto", "bf16", "off"] = Field(
        "auto", description="bf16 autocast of forward passes: auto = on GPU only")
    compile: bool = Field(False, description="torch.compile the model's forward")
    num_cpus: int | None = Field(None, gt=0, description="logical CPUs of a local Ray cluster "
                                 "(default: 2x the cores, at least 4)")
    wandb: WandbConfig = WandbConfig()
