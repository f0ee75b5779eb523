"""What each training worker runs: its state (`Trainer`: R/W replicas, the global parameters,
the outer optimizer), rounds run by rounds/diloco.py or rounds/data_parallel.py, eval,
metrics (round_metrics.py), agreement checks (agreement.py), checkpoints.

`Trainer` is plain PyTorch (+ torch.distributed when W > 1) so tests can run it in one process
or in a gloo group without Ray; ray_entry.py adapts it to Ray Train.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from isoloco_ray.config import TrainConfig
from isoloco_ray.data.format import Dataset
from isoloco_ray.data.stream import ReplicaStream, replica_share
from isoloco_ray.metrics import RoundMetrics, RunSummary
from isoloco_ray.workers.agreement import (
    TrainingStopped,
    check_workers_agree,
    stop_unless_checkpoint_fits,
)
from isoloco_ray.workers.evaluate import eval_sequences, evaluate, perplexity
from isoloco_ray.workers.model import Runtime, build_model, count_parameters
from isoloco_ray.workers.outer.step import OuterSync
from isoloco_ray.workers.parallel.layout import WorkerLayout
from isoloco_ray.workers.replica import (
    Replica,
    load_parameters,
    parameters_finite,
    snapshot_parameters,
)
from isoloco_ray.workers.rounds.data_parallel import DataParallelRounds
from isoloco_ray.workers.rounds.diloco import DiLoCoRounds
from isoloco_ray.workers.rounds.fragments import split_fragments
from isoloco_ray.workers.rounds.round_metrics import Metrics, round_metrics
from isoloco_ray.workers.rounds.round_parts import RoundParts
from isoloco_ray.workers.rounds.streaming import StreamingRounds
from isoloco_ray.workers.state import checkpoint
from isoloco_ray.workers.state.checkpoint_manager import AttributeState, CheckpointManager, Roles
from isoloco_ray.workers.worker_env import WorkerEnv

# A final eval loss within this many nats of ln V is no better than a uniform prediction.
UNIFORM_MARGIN = 1e-3


class Trainer:
    """One worker's training state; everything listed here is what a checkpoint holds."""

    layout: WorkerLayout  # hosted replicas and process groups (not state: rebuilt at start)
    dataset: Dataset  # the prepared data, opened once (not state: the run's data.path)
    model: LlamaForCausalLM  # scratch model the hosted replicas take turns in
    # θ_t, identical on every worker; updated in place, never rebound (the runner holds it).
    global_params: dict[str, torch.Tensor]
    replicas: list[Replica]  # the replicas this worker hosts (their θ_r, AdamW, stream, ...)
    outer: OuterSync  # outer optimizer (the momentum buffers of the tensors this rank owns)
    # outer.fragments: the tensors synced together (one fragment: all; fragments.py).
    fragments: list[tuple[str, ...]]
    # What runs a round: DiLoCo's inner steps and outer syncs (no state of its own at a
    # round's end), or adamw_ddp's data-parallel steps (its AdamW and LR schedule).
    runner: DiLoCoRounds | DataParallelRounds
    # Every part above and the counters below, saved and restored one way (which worker
    # writes which file: checkpoint_manager.py).
    checkpoints: CheckpointManager
    round: int  # outer rounds completed
    initial_eval_loss: float | None
    last_eval_loss: float | None
    train_seconds: float
    first_round_seconds: float
    bytes_total: int  # outer bytes the busiest rank received, summed over rounds
    bad_rounds: int  # consecutive rounds skipped because every replica diverged

    # Whether its outer syncs go through env.seat (SeatedTrainer); the plain one refuses a seat
    # rather than ignore it.
    syncs_through_seat = False

    def __init__(self, cfg: TrainConfig, data: Path | Dataset, env: WorkerEnv) -> None:
        if self.syncs_through_seat and env.seat is None:
            raise ValueError(f"a {type(self).__name__} needs a quorum seat (WorkerEnv.seat)")
        if env.seat is not None and not self.syncs_through_seat:
            raise ValueError(f"a {type(self).__name__} takes no quorum seat (WorkerEnv.seat): "
                             "a worker with a seat runs a SeatedTrainer "
                             "(workers/quorum/seated_trainer.py)")
        self.cfg = cfg
        self.env = env
        self.layout = WorkerLayout.create(cfg.scaling, env.rank, env.world,
                                          background_sync=cfg.outer.delay > 0)
        self.dataset = Dataset.open(data)
        self.model = build_model(cfg.model, self.dataset.meta.vocab_size, cfg.run.seed)
        # Moves the parameters in place. transformers wraps `to` (functools.wraps of
        # Module.to), which hides its signature from the type checker.
        self.model.to(env.device)  # type: ignore[arg-type]
        self.runtime = Runtime.create(self.model, env.device, cfg.run.autocast, cfg.run.compile)
        self.global_params = snapshot_parameters(self.model)
        total_steps = cfg.resolved.rounds * cfg.inner.steps
        fused = env.device.type == "cuda"
        self.replicas = [
            Replica(r, self.model, cfg.inner, total_steps,
                    ReplicaStream(replica_share(self.dataset, r, cfg.scaling.replicas),
                                  env.read_rows, cfg.data.seq_len, cfg.data.batch_size,
                                  vocab_size=self.model.config.vocab_size),
                    fused=fused, in_model=self._replicas_in_model(),
                    keeps_params=cfg.outer.streaming)
            for r in self.layout.hosted
        ]
        self.outer = self._outer_sync()
        self.fragments = split_fragments({n: p.shape for n, p in self.global_params.items()},
                                         cfg.outer.fragments)
        parts = RoundParts(cfg, env, self.layout, self.model, self.runtime, self.global_params,
                           self.replicas, self.outer, self.fragments)
        self.runner = self._round_runner(parts)
        self.round = 0
        self.initial_eval_loss = self.last_eval_loss = None
        self.train_seconds = self.first_round_seconds = 0.0
        self.bytes_total = 0
        self.bad_rounds = 0
        self.eval_set = eval_sequences(self.dataset.split_files("valid"), cfg.data.seq_len,
                                       cfg.run.eval_tokens)
        self.checkpoints = CheckpointManager(
            cfg, AttributeState(self, checkpoint.COUNTERS), self.global_params, self.outer,
            self.replicas, self.runner if isinstance(self.runner, DataParallelRounds) else None,
            self.fragments)
        if env.restore_from is not None:
            self.checkpoints.restore(env.restore_from)

    def _outer_sync(self) -> OuterSync:
        """The outer step over this worker's outer group."""
        return OuterSync(self.cfg.outer, self.cfg.scaling.replicas, self.cfg.run.seed,
                         self.layout.sync_group, self.layout.workers_per_replica,
                         self.layout.position)

    def _round_runner(self, parts: RoundParts) -> DiLoCoRounds | DataParallelRounds:
        """What runs a round: DiLoCo's (streaming ones with outer.fragments, delay or mix), or
        adamw_ddp's data-parallel steps."""
        if not self.cfg.outer.has_outer_step:
            return DataParallelRounds(parts)
        return StreamingRounds(parts) if self.cfg.outer.streaming else DiLoCoRounds(parts)

    def _replicas_in_model(self) -> bool:
        """Whether the hosted replicas' parameters can live in the model module: for the only
        replica of a worker, while they equal the global ones at every round's end (an
        evaluation loads those into the module), and for adamw_ddp's replicas, which only
        supply batches."""
        outer = self.cfg.outer
        return not outer.has_outer_step or (len(self.layout.hosted) == 1
                                            and not outer.streaming)

    # -- checkpoints ---------------------------------------------------------------------------

    def writes_run_files(self) -> bool:
        """Whether this worker writes what every worker holds alike (a checkpoint's shared
        files, the model, the run's progress): rank 0."""
        return self.env.rank == 0

    def roles(self) -> Roles:
        """Which files of a checkpoint this worker writes (checkpoint_manager.Roles)."""
        return Roles.in_group(self.layout, self.outer.route.everyone_merges)

    def save(self, directory: Path, record: Metrics | None = None) -> None:
        """Write this worker's part of a checkpoint of the state after `self.round` rounds;
        `record`: the round's metrics line, kept with it (checkpoint.saved_record)."""
        self.checkpoints.save(directory, self.roles(), record)

    # -- one round -------------------------------------------------------------------------------

    def evaluate(self) -> float:
        """Validation loss of the global parameters."""
        load_parameters(self.model, self.global_params)
        rank, world = self._collective_share()
        loss = evaluate(self.runtime, self.eval_set, rank, world,
                        self.cfg.resolved.micro_batch_size)
        if not math.isfinite(loss):  # the same on every rank: the loss is all-reduced
            raise TrainingStopped(
                f"the validation loss is {loss} after round {self.round}; the last checkpoint "
                "holds the last good state: lower inner.lr or outer.lr and start a new run")
        return loss

    def _collective_share(self) -> tuple[int, int]:
        """(rank, world) of this worker in the collectives of evaluation (each rank scores its
        share of the eval set) and of the checkpoint check."""
        return self.env.rank, self.env.world

    def _before_rounds(self) -> None:
        """What a worker does before its first round (nothing here: a seated one joins)."""

    def run(self) -> Metrics:
        """Train until cfg.run.rounds rounds are done; returns the final metrics (every rank),
        or {"error": why, "rounds": done} when the run had to stop (TrainingStopped)."""
        env = self.env
        try:
            self._before_rounds()
            if self.initial_eval_loss is None:
                self.initial_eval_loss = self.last_eval_loss = self.evaluate()
                env.report(RoundMetrics(round=0, tokens=0, eval_loss=self.initial_eval_loss,
                                        eval_perplexity=perplexity(self.initial_eval_loss),
                                        **self.runner.quorum_metrics()).as_dict(), None,
                           self.writes_run_files())
            self._train_rounds()
        except TrainingStopped as stop:
            # Returned, not raised: a retry from the last checkpoint would only repeat it.
            return {"error": str(stop), "rounds": self.round}
        finally:
            for replica in self.replicas:
                replica.stream.close()
            self.runner.close()
        load_parameters(self.model, self.global_params)
        return self.summary()

    def _checkpoint_round(self) -> bool:
        """Whether a checkpoint is taken after round `self.round`."""
        return (self.round % self.cfg.run.checkpoint_every == 0
                or self.round == self.cfg.resolved.rounds)

    def _train_rounds(self) -> None:
        cfg, env = self.cfg, self.env
        while self.round < cfg.resolved.rounds:
            started = time.perf_counter()
            loss_sum, inner_seconds, stats = self.runner.run_round(self.round)
            self.round += 1
            if not parameters_finite(self.global_params):
                raise TrainingStopped(
                    f"the global parameters are not finite after the outer step of round "
                    f"{self.round} (outer.strategy {cfg.outer.strategy}, outer.lr "
                    f"{cfg.outer.lr:g}); the last checkpoint holds the last good state: lower "
                    "outer.lr and start a new run")
            self.bad_rounds = self.bad_rounds + 1 if stats.skipped else 0
            if self.bad_rounds >= cfg.run.max_bad_rounds:
                raise TrainingStopped(
                    f"every replica diverged (non-finite loss or pseudo-gradient) in "
                    f"{self.bad_rounds} consecutive rounds, up to round {self.round}; the last "
                    "checkpoint holds the last good state: lower inner.lr or outer.lr and "
                    "resume from it with a new run, or raise run.max_bad_rounds")
            seconds = time.perf_counter() - started
            self.train_seconds += seconds
            if self.round == 1:
                self.first_round_seconds = seconds
            metrics = round_metrics(cfg, self.round, loss_sum, seconds, inner_seconds, stats,
                                    env.device)
            self.bytes_total += metrics.outer_bytes_received or 0  # the busiest rank's
            # Over a quorum: who took part (QuorumRounds).
            metrics = replace(metrics, **self.runner.quorum_metrics())
            saving = self._checkpoint_round()
            agreement = check_workers_agree(self.global_params, self.round, full=saving)
            if saving:
                metrics.state_sha256 = agreement
            else:
                metrics.state_checksum = agreement
            if self.round % cfg.run.eval_every == 0 or self.round == cfg.resolved.rounds:
                self.last_eval_loss = self.evaluate()
                metrics.eval_loss = self.last_eval_loss
                metrics.eval_perplexity = perplexity(self.last_eval_loss)
            if saving:
                with tempfile.TemporaryDirectory() as directory:
                    self.save(Path(directory), metrics.as_dict())
                    stop_unless_checkpoint_fits(Path(directory), self.round,
                                                self._collective_share()[0], env.device,
                                                env.checkpoint_room)
                    env.report(metrics.as_dict(), Path(directory), self.writes_run_files())
            else:
                env.report(metrics.as_dict(), None, self.writes_run_files())

    def divergence(self) -> str | None:
        """Why a run that reached its end is still no success, or None: its last rounds were
        skipped (every replica diverged), or its final eval loss is no better than a uniform
        prediction's, ln V (a destroyed model: e.g. an absurd outer.lr)."""
        if self.bad_rounds:
            return (f"every replica diverged in the last {self.bad_rounds} round(s), which were "
                    "skipped")
        uniform = math.log(self.model.config.vocab_size)
        final = self.last_eval_loss
        if final is not None and final >= uniform - UNIFORM_MARGIN:
            return (f"the final eval loss {final:.4f} is no better than a uniform prediction's "
                    f"(ln V = {uniform:.4f}): lower outer.lr or inner.lr")
        return None

    def summary(self) -> Metrics:
        """The run's final figures (summary.json, less what only the driver knows)."""
        cfg = self.cfg
        diverged = self.divergence()
        return RunSummary(
            status="done" if diverged is None else "diverged",
            diverged=diverged,
            rounds=self.round,
            tokens=self.round * cfg.tokens_per_round,
            num_parameters=count_parameters(self.model),
            initial_eval_loss=self.initial_eval_loss,
            final_eval_loss=self.last_eval_loss,
            final_eval_perplexity=(None if self.last_eval_loss is None
                                   else perplexity(self.last_eval_loss)),
            tokens_per_s=steady_tokens_per_s(self.round, cfg.tokens_per_round,
                                             self.train_seconds, self.first_round_seconds),
            train_seconds=self.train_seconds,
            first_round_seconds=self.first_round_seconds,
            outer_bytes_per_round=self.bytes_total / max(self.round, 1),
            model_sha256=checkpoint.parameters_sha256(self.global_params),
        ).as_dict()


def steady_tokens_per_s(rounds: int, tokens_per_round: int, train_seconds: float,
                        first_round_seconds: float) -> float:
    """Training throughput after start-up: the first round also pays for starting the data
    streams (Ray Data spawns its reader processes then), so it is left out when there are
    others."""
    if rounds > 1:
        return (rounds - 1) * tokens_per_round / max(train_seconds - first_round_seconds, 1e-9)
    return rounds * tokens_per_round / max(train_seconds, 1e-9)
