"""Every user-facing setting of a training run, validated with pydantic.

`TrainConfig` is what `python -m isoloco_ray.train` builds from its defaults, an optional YAML
file and `--section.field=value` flags. Fields left at `None` are filled from presets after
validation (model size from `model.preset`; learning rates, momentum and merge options from the
outer strategy's paper values in the registry, isoloco_ray/strategies.py), so a resolved config
has no `None` left where a number is needed and is what checkpoints and summaries record.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from isoloco_ray.strategies import STRATEGIES, WIRE_FORMATS, OuterMerge, option_strategies
from isoloco_ray.workers.outer.route import Route

ModelPreset = Literal["tiny", "demo", "178M", "512M"]
Strategy = Literal[tuple(STRATEGIES)]  # type: ignore[valid-type]

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

# Which strategies each outer.* option applies to; setting one for another strategy is an
# error rather than silently ignored.
OPTION_STRATEGIES = option_strategies()


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


class _Section(BaseModel):
    # inf/nan in any float setting would train a NaN model: refused where it is read.
    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


class ModelConfig(_Section):
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


class DataConfig(_Section):
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


class ScalingConfig(_Section):
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


class InnerConfig(_Section):
    """Each replica's local AdamW (docs/strategies.md, "Notation")."""

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


class OuterConfig(_Section):
    """The outer step: which merge, and its optimizer (docs/strategies.md)."""

    strategy: Strategy = Field(
        "diloco", description="diloco, diloco_sgd, isoc, isoloco, isocts, tsv, ties, dare, "
        "adamw_ddp")
    lr: float | None = Field(None, ge=0, description="outer lr η (default: the strategy's)")
    momentum: float | None = Field(None, ge=0, lt=1, description="outer momentum μ "
                                   "(default: the strategy's)")
    nesterov: bool | None = Field(None, description="Nesterov momentum (default: the strategy's)")
    orthogonalize: Literal["gradient", "update"] | None = Field(
        None, description="isoloco: ISO-C before momentum (gradient) or after it (update)")
    common_fraction: float | None = Field(None, ge=0, le=1, description="isocts common fraction")
    keep_fraction: float | None = Field(None, gt=0, le=1, description="tsv keep fraction "
                                        "(default 1/R)")
    decorrelate: bool | None = Field(None, description="tsv: orthogonalise the stacked bases")
    sparsity: float | None = Field(None, ge=0, lt=1, description="ties/dare: fraction dropped")
    prune: Literal["magnitude", "random"] | None = Field(None, description="ties/dare pruning")
    prune_dim: Literal["all", "row", "column"] | None = Field(
        None, description="ties/dare: prune entries, whole rows or whole columns")
    rescale: bool | None = Field(None, description="ties/dare: rescale kept entries by 1/(1-p)")
    disjoint: bool | None = Field(None, description="ties/dare: TIES sign-elected disjoint merge")
    placement: Literal["sharded", "rank0", "replicated"] = Field(
        "sharded", description="who merges each tensor: sharded (owners spread over the workers, "
        "balanced by cost), rank0 (one worker merges all), replicated (every worker merges all)")
    comm_dtype: Literal[tuple(WIRE_FORMATS)] = Field(  # type: ignore[valid-type]
        "float32", description="how pseudo-gradients and updates travel to and from their "
        "owners: bfloat16 halves the bytes; int8 and float8 (e4m3) quarter them, one byte per "
        "entry plus a float32 scale per row (merges still run in float32 or float64 on the "
        "decoded values; all-reduced sums stay float32)")
    topk: float | None = Field(
        None, gt=0, lt=1, description="send only this fraction of each row of a "
        "pseudo-gradient, its largest entries (values in comm_dtype and int32 indices); "
        "updates stay dense. Best with error_feedback")
    error_feedback: bool = Field(
        False, description="each replica adds what the transport lost of its pseudo-gradient "
        "last round to this round's before sending it (needs a lossy comm_dtype or topk)")

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

    @property
    def streaming(self) -> bool:
        """Whether replicas keep parameters of their own between syncs (fragments, delay or
        mix): then they are part of a checkpoint."""
        return self.fragments > 1 or self.delay > 0 or self.mix > 0

    @model_validator(mode="after")
    def _check_error_feedback(self) -> OuterConfig:
        if self.error_feedback and WIRE_FORMATS[self.comm_dtype].lossless and self.topk is None:
            raise ValueError("outer.error_feedback corrects what the transport loses, and float32 "
                             "without outer.topk loses nothing: set outer.comm_dtype to int8, "
                             "float8 or bfloat16, or outer.topk, or turn error_feedback off")
        if self.error_feedback and self.strategy == "adamw_ddp":
            raise ValueError("outer.error_feedback has no effect with adamw_ddp (it has no outer "
                             "sync): turn it off")
        return self

    def quorum_outer(self) -> OuterConfig:
        """These settings as the quorum's outer step runs them (scaling.fault_tolerance:
        replica): every worker merges what the quorum gathered, i.e. placement replicated."""
        return self.model_copy(update={"placement": "replicated"})


class WandbConfig(_Section):
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


class RunConfig(_Section):
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


class TrainConfig(_Section):
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
        for option, strategies in OPTION_STRATEGIES.items():
            value = getattr(self.outer, option)
            # The preset's own value is allowed, so a resolved config round-trips (adamw_ddp
            # fills lr/momentum/nesterov with inert values).
            if (value is not None and self.outer.strategy not in strategies
                    and value != preset.get(option)):
                raise ValueError(
                    f"outer.{option} does not apply to outer.strategy "
                    f"'{self.outer.strategy}' (only to {', '.join(strategies)}); remove it")
        for option, (only, instead) in spec.fixed.items():
            value = getattr(self.outer, option)
            if value is not None and value != only:
                raise ValueError(f"outer.{option} must be {only!r} for outer.strategy "
                                 f"'{spec.name}' (got {value!r}): {instead}")
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
        if self.outer.strategy == "tsv" and self.outer.keep_fraction is None:
            self.outer.keep_fraction = 1.0 / self.scaling.replicas
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
        outer, preset = self.outer, STRATEGIES[self.outer.strategy].paper
        if outer.strategy == "adamw_ddp":
            inert = [f"outer.{name}={getattr(outer, name)}" for name, harmless in
                     (("comm_dtype", "float32"), ("topk", None), ("placement", "sharded"))
                     if getattr(outer, name) != harmless]
            if inert:
                raise ValueError(f"{_have_no_effect(inert)} with adamw_ddp (it has no outer "
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
        if outer.sparsity == 0:
            inert = [f"outer.{name}={getattr(outer, name)}"
                     for name in ("prune", "prune_dim", "rescale")
                     if getattr(outer, name) != preset.get(name)]
            if inert:
                raise ValueError(f"{_have_no_effect(inert)} with outer.sparsity=0 (every "
                                 "entry is kept); set outer.sparsity > 0 or remove "
                                 f"{'it' if len(inert) == 1 else 'them'}")

    def _check_fault_tolerance(self) -> None:
        """What `scaling.fault_tolerance: replica` runs so far: every DiLoCo strategy's outer
        step over a quorum in float32, without streaming, on CPUs."""
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
        if outer.strategy == "adamw_ddp":
            unsupported.append("outer.strategy adamw_ddp (it all-reduces every inner step)")
        else:
            if outer.comm_dtype != "float32" or outer.topk is not None:
                unsupported.append("a compressed outer sync (outer.comm_dtype, outer.topk)")
        if outer.streaming:
            unsupported.append("outer.fragments, outer.delay or outer.mix")
        if self.scaling.use_gpu:
            unsupported.append("scaling.use_gpu")
        if unsupported:
            raise ValueError(
                f"scaling.fault_tolerance: replica does not run {'; '.join(unsupported)} yet "
                "(it runs every outer strategy but adamw_ddp, in float32, on CPUs: "
                "docs/fault_tolerance.md); set --scaling.fault_tolerance=restart")

    def _check_streaming(self) -> None:
        outer, steps = self.outer, self.inner.steps
        if outer.streaming and outer.strategy == "adamw_ddp":
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
    def tokens_per_round(self) -> int:
        """Training tokens consumed by all replicas in one outer round."""
        return (self.data.batch_size * self.data.seq_len * self.inner.steps
                * self.scaling.replicas)


# ---------------------------------------------------------------------------------------------
# Loading: defaults < YAML file < --section.field=value flags.


def _have_no_effect(settings: list[str]) -> str:
    """'a has no effect', 'a, b have no effect'."""
    return f"{', '.join(settings)} {'has' if len(settings) == 1 else 'have'} no effect"


class ConfigError(ValueError):
    """A configuration the run cannot use; its message names the field and the fix."""


def format_validation_error(error: Any) -> str:
    """One line per problem: `section.field: what is wrong`."""
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field; see --help for the fields of each section"
        elif item["type"] == "finite_number":
            message = f"must be a finite number (got {item.get('input')!r})"
        elif item["type"] in ("literal_error", "enum"):
            message = f"{message} (got {item.get('input')!r})"
        lines.append(message if not location or message.startswith(location)
                     else f"{location}: {message}")
    return "\n".join(lines)


def read_yaml_config(path: Path) -> dict[str, Any]:
    """The mapping in a YAML config file (sections as in TrainConfig)."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (line {line}, byte "
                          f"{exc.start}); save it as UTF-8") from None
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections "
                          "(model:, data:, scaling:, inner:, outer:, run:)")
    return loaded


def merge_nested(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `override`, section by section (override wins)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_nested(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_config(values: dict[str, Any]) -> TrainConfig:
    """Validate `values` into a TrainConfig, raising ConfigError with readable lines."""
    from pydantic import ValidationError

    try:
        return TrainConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


# What the command line accepts for "unset" in an optional field: YAML's null and Python's None,
# in any case. pydantic-settings takes one spelling (cli_parse_none_str); the others are mapped
# to it before parsing.
NULL_SPELLINGS = ("null", "none")
CLI_NONE = "None"

# The --help description; shown as written (pydantic-settings keeps its line breaks).
CLI_DESCRIPTION = """\
Every field can also be set in a YAML file given as the first argument; the
command line wins.

Optional fields (those that may be left unset: a preset's, the strategy's or the
data's value, or off) are unset again with null, None or none, as `field: null`
does in YAML: e.g. --inner.clip=null (no clipping), --outer.lr=null (the
strategy's paper value). The other fields always take a value."""


def parse_cli_overrides(args: list[str], prog: str) -> dict[str, Any]:
    """`--section.field=value` flags as a nested dict of the fields given, unvalidated.

    Parsed by pydantic-settings' CLI: `--help` prints every field with its default and
    description and exits; an unknown flag exits with status 2 and argparse's message. An
    optional field takes null, None or none (any case) for "unset" (`_unset_spellings`).
    """
    from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict
    from pydantic_settings.exceptions import SettingsError

    class CommandLine(TrainConfig, BaseSettings):
        model_config = SettingsConfigDict(cli_prog_name=prog, cli_avoid_json=True,
                                          cli_parse_none_str=CLI_NONE, cli_hide_none_type=True,
                                          cli_exit_on_error=False)

    CommandLine.__doc__ = CLI_DESCRIPTION  # the --help description
    try:
        return CliSettingsSource(CommandLine, cli_parse_args=_unset_spellings(args))()
    except SettingsError as exc:
        raise ConfigError(_explain_cli_error(str(exc))) from None


def _unset_spellings(args: list[str]) -> list[str]:
    """`args` with every spelling of "unset" (NULL_SPELLINGS, any case) given to an optional
    field turned into the one pydantic-settings parses (CLI_NONE), in both the `--f=value` and
    the `--f value` form. The same word given to a field that always has a value is a
    ConfigError naming the field (rather than a type error about the word)."""
    optional = set(optional_field_paths(TrainConfig))
    known = set(field_paths(TrainConfig))
    out = list(args)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg.partition("=")
        at = i
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                continue
            at, value = i + 1, args[i + 1]
        path = flag[2:]
        if value.lower() not in NULL_SPELLINGS or path not in known:
            continue
        if path not in optional:
            raise ConfigError(f"{path}: cannot be unset ({value!r}); it always takes a value, "
                              "see --help")
        out[at] = f"{flag}={CLI_NONE}" if eq else CLI_NONE
    return out


def _explain_cli_error(message: str) -> str:
    """argparse's complaint, with the closest real flag suggested for a misspelt one."""
    import difflib
    import re

    unknown = re.search(r"unrecognized arguments: (\S+)", message)
    if not unknown:
        return message.removeprefix("error parsing CLI: ")
    flag = unknown.group(1).split("=", 1)[0]
    known = [f"--{path}" for path in field_paths(TrainConfig)]
    close = difflib.get_close_matches(flag, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else "; see --help for every field"
    return f"{flag}: unknown option{hint}"


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field of `model` (sections and sub-sections walked)."""
    paths = []
    for name, spec in model.model_fields.items():
        if isinstance(spec.annotation, type) and issubclass(spec.annotation, BaseModel):
            paths += field_paths(spec.annotation, f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


def optional_field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of the leaf fields of `model` that accept None (their "unset" value)."""
    import types
    import typing

    paths = []
    for name, spec in model.model_fields.items():
        if isinstance(spec.annotation, type) and issubclass(spec.annotation, BaseModel):
            paths += optional_field_paths(spec.annotation, f"{prefix}{name}.")
        elif (typing.get_origin(spec.annotation) in (typing.Union, types.UnionType)
              and type(None) in typing.get_args(spec.annotation)):
            paths.append(f"{prefix}{name}")
    return paths


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted paths: {"inner": {"lr": 1}} -> {"inner.lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted paths as nested sections: {"inner.lr": 1} -> {"inner": {"lr": 1}}."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        *sections, name = path.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return nested


def load_config(args: list[str], prog: str = "python -m isoloco_ray.train") -> TrainConfig:
    """The TrainConfig of a command line `[CONFIG.yaml] [--section.field=value ...]`."""
    values: dict[str, Any] = {}
    if args and not args[0].startswith("-"):
        values = read_yaml_config(Path(args[0]))
        args = args[1:]
    return build_config(merge_nested(values, parse_cli_overrides(args, prog)))


# What a resumed run must share with the run that wrote its checkpoint: these define the math.
RESUME_MUST_MATCH = ("model", "data", "scaling", "inner", "outer")
# Within those, what a resumed run may change: it moves work between workers, not the math.
RESUME_MAY_CHANGE = ("outer.placement",)


def config_differences(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """Fields (`section.field`) in which a saved resolved config differs from `current` and
    that a resumed run must not change."""
    now = current.model_dump(mode="json")
    # A setting added since the checkpoint was written is missing from it: the run had its
    # default then.
    defaults = TrainConfig.model_construct().model_dump(mode="json")
    differing = [f"{section}.{key}" for section in RESUME_MUST_MATCH for key in now[section]
                 if saved.get(section, {}).get(key, defaults[section].get(key))
                 != now[section][key]
                 and f"{section}.{key}" not in RESUME_MAY_CHANGE]
    return differing + [f"run.{key}" for key in ("rounds", "seed")
                        if saved.get("run", {}).get(key) != now["run"][key]]
