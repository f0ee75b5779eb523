"""What each training worker runs: R/W replicas' inner steps, the outer sync, eval, metrics,
checkpoints.

`Trainer` is plain PyTorch (+ torch.distributed when W > 1) so tests can run it in one process
or in a gloo group without Ray; `train_loop_per_worker` adapts it to Ray Train.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from isoloco_ray import run_files, storage
from isoloco_ray.config import TrainConfig, config_differences
from isoloco_ray.data.format import DataError, DatasetMeta, split_files
from isoloco_ray.data.stream import ReplicaStream, RowReader, replica_share
from isoloco_ray.workers import checkpoint, resume
from isoloco_ray.workers.collectives import (TrafficCounter, all_gather_scalars,
                                             all_gather_strings, all_reduce_scalars,
                                             all_reduce_sum)
from isoloco_ray.workers.evaluate import eval_sequences, evaluate, perplexity
from isoloco_ray.workers.export import ExportError, export_model
from isoloco_ray.workers.fragments import round_events, split_fragments
from isoloco_ray.workers.layout import WorkerLayout, placement_warning
from isoloco_ray.workers.model import Runtime, build_model, count_parameters
from isoloco_ray.workers.outer.step import OuterStepStats, OuterSync
from isoloco_ray.workers.overlap import Background
from isoloco_ray.workers.replica import (Replica, inner_step, load_parameters,
                                         make_inner_optimizer, snapshot_parameters)

Metrics = dict[str, Any]

# A final eval loss within this many nats of ln V is no better than a uniform prediction.
UNIFORM_MARGIN = 1e-3


class TrainingStopped(RuntimeError):
    """The run cannot go on (diverged replicas, workers disagreeing); the message says why."""


@dataclass
class WorkerEnv:
    """What the worker loop needs from whoever runs it (Ray Train, a test, a benchmark)."""

    rank: int
    world: int
    device: torch.device
    read_rows: RowReader  # reads row ranges of train shards (Ray Data, or pyarrow)
    # Called by every rank once per round with the metrics and, on checkpoint rounds, the
    # directory holding this rank's checkpoint files (valid only during the call).
    report: Callable[[Metrics, Path | None], None]
    restore_from: Path | None = None  # a checkpoint directory to resume from
    # Given the bytes of a checkpoint (every rank's files), why it will not fit where it goes,
    # or None; asked on rank 0 before each checkpoint (storage.checkpoint_room).
    checkpoint_room: Callable[[int], str | None] | None = None
    # Test hook: called after each replica's inner steps with (round, replica).
    after_replica: Callable[[int, int], None] | None = None


class Trainer:
    """One worker's training state; everything listed here is what a checkpoint holds."""

    layout: WorkerLayout  # hosted replicas and process groups (not state: rebuilt at start)
    model: nn.Module  # scratch module the hosted replicas take turns in
    global_params: dict[str, torch.Tensor]  # θ_t, identical on every worker
    replicas: list[Replica]  # the replicas this worker hosts (their θ_r, AdamW, stream, ...)
    outer: OuterSync  # outer optimizer (the momentum buffers of the tensors this rank owns)
    # outer.fragments: the tensors synced together (one fragment: all), and the syncs started
    # but not landed (none at a round's end, where checkpoints are taken: fragments.py).
    fragments: list[tuple[str, ...]]
    in_flight: dict[int, Future[OuterStepStats] | OuterStepStats]
    background: Background | None  # the thread syncs run on with outer.delay (not state)
    # adamw_ddp: its one AdamW and LR schedule over the global model, alike on every rank (the
    # replicas then only supply batches); None for the DiLoCo strategies.
    data_parallel: tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR] | None
    round: int  # outer rounds completed
    initial_eval_loss: float | None
    last_eval_loss: float | None
    train_seconds: float
    first_round_seconds: float
    bytes_total: int  # outer bytes the busiest rank received, summed over rounds
    bad_rounds: int  # consecutive rounds skipped because every replica diverged

    def __init__(self, cfg: TrainConfig, data_dir: Path, env: WorkerEnv) -> None:
        self.cfg = cfg
        self.env = env
        self.layout = WorkerLayout.create(cfg.scaling, env.rank, env.world,
                                          background_sync=cfg.outer.delay > 0)
        meta = DatasetMeta.load(data_dir)
        self.model = build_model(cfg.model, meta.vocab_size, cfg.run.seed).to(env.device)
        self.runtime = Runtime.create(self.model, env.device, cfg.run.autocast, cfg.run.compile)
        self.global_params = snapshot_parameters(self.model)
        total_steps = cfg.run.rounds * cfg.inner.steps
        fused = env.device.type == "cuda"
        self.replicas = [
            Replica(r, self.model, cfg.inner, total_steps,
                    ReplicaStream(replica_share(data_dir, r, cfg.scaling.replicas),
                                  env.read_rows, cfg.data.seq_len, cfg.data.batch_size,
                                  vocab_size=self.model.config.vocab_size),
                    fused=fused, in_model=self._replicas_in_model(),
                    keeps_params=cfg.outer.streaming)
            for r in self.layout.hosted
        ]
        self.outer = OuterSync(cfg.outer, cfg.scaling.replicas, cfg.run.seed,
                               self.layout.sync_group)
        self.fragments = split_fragments({n: p.shape for n, p in self.global_params.items()},
                                         cfg.outer.fragments)
        self.in_flight = {}
        self.background = Background(env.device) if cfg.outer.delay > 0 else None
        self.data_parallel = (make_inner_optimizer(self.model, cfg.inner, total_steps, fused)
                              if cfg.outer.strategy == "adamw_ddp" else None)
        self.round = 0
        self.initial_eval_loss = self.last_eval_loss = None
        self.train_seconds = self.first_round_seconds = 0.0
        self.bytes_total = 0
        self.bad_rounds = 0
        self.eval_set = eval_sequences(split_files(data_dir, "valid"), cfg.data.seq_len,
                                       cfg.run.eval_tokens)
        if env.restore_from is not None:
            self.restore(env.restore_from)

    def _replicas_in_model(self) -> bool:
        """Whether the hosted replicas' parameters can live in the model module: for the only
        replica of a worker, while they equal the global ones at every round's end (an
        evaluation loads those into the module), and for adamw_ddp's replicas, which only
        supply batches."""
        outer = self.cfg.outer
        return outer.strategy == "adamw_ddp" or (len(self.layout.hosted) == 1
                                                 and not outer.streaming)

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write this rank's part of a checkpoint of the state after `self.round` rounds."""
        if self.env.rank == 0:
            counters = {name: getattr(self, name) for name in checkpoint.COUNTERS}
            checkpoint.save_shared(directory, self.global_params, self.outer.state_dict(),
                                   {**counters, "config": self.cfg.model_dump(mode="json")})
            if self.data_parallel is not None:
                optimizer, schedule = self.data_parallel
                checkpoint.save_data_parallel(directory, {"optimizer": optimizer.state_dict(),
                                                          "schedule": schedule.state_dict()})
        if not self.layout.saves_replicas:
            return  # the replica's first worker saves what all its workers hold alike
        if self.outer.rank == 0 or not self.outer.route.everyone_merges:
            checkpoint.save_outer_momentum(directory, self.outer.rank,
                                           self.outer.state_dict()["buffers"])
        for replica in self.replicas:
            checkpoint.save_replica(directory, replica.index, replica.state_dict())

    def restore(self, directory: Path) -> None:
        """Continue from a checkpoint exactly where the saved run stood. Raises
        checkpoint.CheckpointError, naming the files, for a damaged checkpoint (every file is
        checked first: never half-restored) or one written with other settings."""
        problems = checkpoint.checkpoint_problems(directory)
        if problems:
            raise checkpoint.CheckpointError(checkpoint.damage_report(directory, problems))
        params, outer_state, state = checkpoint.load_shared(directory)
        differing = config_differences(state.pop("config"), self.cfg)
        if differing:
            raise checkpoint.CheckpointError(
                f"the checkpoint in {directory} was written with different settings: "
                f"{', '.join(differing)}; resume with the same configuration or use a new "
                "run.name")
        # In the model's order (safetensors returns names sorted): merges visit tensors in it.
        self.global_params = {name: params[name].to(self.env.device)
                              for name in self.global_params}
        self.outer.load_state_dict(outer_state, {n: p.shape for n, p in params.items()},
                                   self.fragments)
        for name, value in checkpoint.read_counters(state, directory / checkpoint.STATE_FILE
                                                    ).items():
            setattr(self, name, value)
        for replica in self.replicas:
            replica.load_state_dict(checkpoint.load_replica(directory, replica.index),
                                    self.global_params)
        if self.data_parallel is not None:
            saved = checkpoint.load_data_parallel(directory)
            optimizer, schedule = self.data_parallel
            optimizer.load_state_dict(saved["optimizer"])
            schedule.load_state_dict(saved["schedule"])

    def check_workers_agree(self, full: bool) -> str:
        """The global parameters' fingerprint, after checking every worker holds the same:
        the on-device `parameters_checksum`, or with `full` (checkpoint rounds) the sha256."""
        digest = (checkpoint.parameters_sha256 if full
                  else checkpoint.parameters_checksum)(self.global_params)
        hashes = all_gather_strings(digest)
        if len(set(hashes)) > 1:
            raise TrainingStopped(
                f"the workers' global parameters differ after round {self.round} "
                f"(hashes by rank: {hashes}); the outer sync is not deterministic here")
        return digest

    def stop_if_any_rank_failed(self, error: str | None) -> None:
        """Every rank stops together when any rank's data failed (a rank that stopped alone
        would leave the others waiting in the next collective)."""
        errors = all_gather_strings(error or "")
        failed = [(rank, message) for rank, message in enumerate(errors) if message]
        if failed:
            rank, message = failed[0]
            raise TrainingStopped(f"worker {rank} in round {self.round + 1}: {message}")

    def stop_unless_checkpoint_fits(self, directory: Path) -> None:
        """Every rank stops together, before writing anything, when this round's checkpoint
        (every rank's files in `directory`) will not fit where checkpoints go: half a
        checkpoint and an unreadable Ray Train record are what a disk that fills up during a
        checkpoint leaves, and restarts from the last checkpoint would only fill it again."""
        if self.env.checkpoint_room is None:
            return
        size = sum(path.stat().st_size for path in directory.iterdir())
        (needed,) = all_reduce_scalars([size], self.env.device)
        problem = self.env.checkpoint_room(int(needed)) if self.env.rank == 0 else None
        verdict = all_gather_strings(problem or "")[0]  # rank 0's, on every rank
        if verdict:
            raise TrainingStopped(f"the checkpoint of round {self.round} was not written: "
                                  f"{verdict}")

    # -- one round -------------------------------------------------------------------------------

    def evaluate(self) -> float:
        """Validation loss of the global parameters."""
        load_parameters(self.model, self.global_params)
        loss = evaluate(self.runtime, self.eval_set, self.env.rank, self.env.world,
                        self.cfg.data.micro_batch_size)
        if not math.isfinite(loss):  # the same on every rank: the loss is all-reduced
            raise TrainingStopped(
                f"the validation loss is {loss} after round {self.round}; the last checkpoint "
                "holds the last good state: lower inner.lr or outer.lr and start a new run")
        return loss

    def diloco_round(self) -> tuple[float, float, OuterStepStats]:
        """H inner steps on every hosted replica, and the syncs of the round's fragments
        (fragments.round_events; with one fragment and no delay: the outer step at the end).

        Returns (sum of the finite replicas' mean losses on this rank, counted by the first
        worker of each replica only, inner seconds, the round's syncs' stats together).
        """
        steps = self.cfg.inner.steps
        stats = OuterStepStats()
        losses: dict[int, list[torch.Tensor]] = {r.index: [] for r in self.replicas}
        inner_seconds, done, checked = 0.0, 0, False
        data_error = None
        try:
            for event in round_events(self.round, self.cfg.run.rounds, steps,
                                      self.cfg.outer.fragments, self.cfg.outer.delay):
                if event.step > done:
                    seconds, data_error = self._inner_steps(event.step - done, losses,
                                                            event.step == steps, data_error)
                    inner_seconds += seconds
                    done, checked = event.step, False
                if event.starts:
                    # Every rank stops together before a sync when any rank's data failed.
                    self.stop_if_any_rank_failed(data_error)
                    checked = True
                    self._start_sync(event.fragment, event.sync_round)
                else:
                    stats.add(self._finish_sync(event.fragment))
            if done < steps:
                seconds, data_error = self._inner_steps(steps - done, losses, True, data_error)
                inner_seconds += seconds
                checked = False
            if not checked:
                self.stop_if_any_rank_failed(data_error)
        finally:
            self._wait_for_syncs()
        counted = self.layout.position == 0
        total = 0.0
        for replica in self.replicas:
            loss = torch.stack(losses[replica.index]).mean().item()
            if self.layout.shard is not None:
                loss = self.layout.shard.mean(loss, self.env.device)
            if replica.index not in stats.dropped and counted:
                total += loss
        return total, inner_seconds, stats

    def _inner_steps(self, steps: int, losses: dict[int, list[torch.Tensor]], ends_round: bool,
                     data_error: str | None) -> tuple[float, str | None]:
        """`steps` inner steps of every hosted replica, in turn; after a data error, none (the
        ranks stop together at the next check). Returns (seconds, the data error if any)."""
        started = time.perf_counter()
        for replica in self.replicas:
            if data_error is not None:
                break
            try:
                losses[replica.index] += replica.run_inner_steps(
                    self.model, self.runtime, steps, self.cfg.data.micro_batch_size,
                    self.layout.shard)
            except DataError as exc:  # a replica's G workers read the same rows: all stop
                data_error = str(exc)
                break
            if ends_round and self.env.after_replica is not None:
                self.env.after_replica(self.round, replica.index)
        return time.perf_counter() - started, data_error

    def _start_sync(self, fragment: int, sync_round: int) -> None:
        """Take the hosted replicas' Δ_r of `fragment` and start its outer step: at once, or
        in the background with outer.delay."""
        outer = self.cfg.outer
        names = self.fragments[fragment]
        diverged = [r.index for r in self.replicas if not r.losses_finite]
        for replica in self.replicas:
            replica.losses_finite = True
        # Without delay or mix, θ_r of the fragment is replaced by the global one right after
        # the step: its storage can hold Δ_r meanwhile.
        in_place = outer.delay == 0 and outer.mix == 0
        deltas = {r.index: r.pseudo_gradient(self.global_params, names, in_place)
                  for r in self.replicas}
        feedback = {r.index: r.feedback for r in self.replicas} if outer.error_feedback else None
        target = {name: self.global_params[name] for name in names}

        def step() -> OuterStepStats:
            return self.outer.step(target, deltas, sync_round, diverged, feedback)

        if self.background is not None:
            self.in_flight[fragment] = self.background.start(step)
            return
        started = time.perf_counter()
        stats = step()
        stats.wait_seconds = time.perf_counter() - started  # training waited for all of it
        self.in_flight[fragment] = stats

    def _finish_sync(self, fragment: int) -> OuterStepStats:
        """Land `fragment`'s sync: its global tensors hold the new values; each replica takes
        them (mixed with its own by outer.mix), or starts again from the global parameters if
        it was left out."""
        pending = self.in_flight.pop(fragment)
        if isinstance(pending, Future):
            assert self.background is not None
            waiting = time.perf_counter()
            stats = self.background.finish(pending)
            stats.wait_seconds = time.perf_counter() - waiting
        else:
            stats = pending
        for replica in self.replicas:
            if replica.index in stats.dropped:
                replica.reset(self.global_params)
            else:
                replica.take_global(self.global_params, self.fragments[fragment],
                                    self.cfg.outer.mix)
        return stats

    def _wait_for_syncs(self) -> None:
        """Let syncs still running end (the round stopped early: every rank started them, so
        they complete), without landing them."""
        for pending in self.in_flight.values():
            if isinstance(pending, Future):
                pending.exception()
        self.in_flight.clear()

    def data_parallel_round(self) -> tuple[float, float, OuterStepStats]:
        """adamw_ddp: H data-parallel AdamW steps on the global model, gradients averaged over
        all R replicas' batches every step (a replica spread over G workers gives each its rows
        of the replica's batch)."""
        assert self.data_parallel is not None
        stats, traffic = OuterStepStats(), TrafficCounter()
        optimizer, schedule = self.data_parallel
        params = list(self.model.parameters())
        shard = self.layout.shard
        shares = self.cfg.scaling.replicas * self.cfg.scaling.workers_per_replica
        load_parameters(self.model, self.global_params)

        def average_over_all_replicas() -> None:
            for p in params:
                if p.grad is None:  # no batch read here (a data error): still join the sum
                    p.grad = torch.zeros_like(p)
            computed = time.perf_counter()
            all_reduce_sum([p.grad for p in params], traffic)
            stats.comm_seconds += time.perf_counter() - computed
            for p in params:
                p.grad /= shares

        started = time.perf_counter()
        loss_sum = torch.zeros((), device=self.env.device)
        data_error = None
        for _ in range(self.cfg.inner.steps):
            batches = []  # the hosted replicas' batches: their gradients add up in .grad
            try:
                if data_error is None:
                    batches = [replica.stream.next_batch() for replica in self.replicas]
            except DataError as exc:
                # Keep joining the steps' all-reduce so the other ranks reach the end of the
                # round, where every rank stops.
                data_error = str(exc)
            loss_sum += inner_step(
                self.runtime, optimizer, schedule,
                [batch if shard is None else shard.rows(batch) for batch in batches],
                self.cfg.data.micro_batch_size, self.cfg.inner.clip, average_over_all_replicas)
        inner_seconds = time.perf_counter() - started - stats.comm_seconds
        self.stop_if_any_rank_failed(data_error)
        stats.bytes_received = traffic.take()
        stepped = snapshot_parameters(self.model)
        if parameters_finite(stepped):  # alike on every rank: the same averaged gradients
            self.global_params = stepped
        else:
            # The DiLoCo strategies' guard, for the one data-parallel "replica": the round is
            # skipped (parameters as they were before it) and AdamW's moments are reset.
            optimizer.state.clear()
            stats.dropped, stats.skipped = list(range(self.cfg.scaling.replicas)), True
        # Every worker's loss is over its share: the world's sum, / G, is the replicas' sum.
        return (loss_sum.item() / self.cfg.inner.steps / self.cfg.scaling.workers_per_replica,
                inner_seconds, stats)

    def run(self) -> Metrics:
        """Train until cfg.run.rounds rounds are done; returns the final metrics (every rank),
        or {"error": why, "rounds": done} when the run had to stop (TrainingStopped)."""
        env = self.env
        try:
            if self.initial_eval_loss is None:
                self.initial_eval_loss = self.last_eval_loss = self.evaluate()
                env.report({"round": 0, "tokens": 0, "eval_loss": self.initial_eval_loss,
                            "eval_perplexity": perplexity(self.initial_eval_loss)}, None)
            self._train_rounds()
        except TrainingStopped as stop:
            # Returned, not raised: a retry from the last checkpoint would only repeat it.
            return {"error": str(stop), "rounds": self.round}
        finally:
            for replica in self.replicas:
                replica.stream.close()
            if self.background is not None:
                self.background.close()
        load_parameters(self.model, self.global_params)
        return self.summary()

    def _train_rounds(self) -> None:
        cfg, env = self.cfg, self.env
        run_round = (self.data_parallel_round if cfg.outer.strategy == "adamw_ddp"
                     else self.diloco_round)
        while self.round < cfg.run.rounds:
            started = time.perf_counter()
            loss_sum, inner_seconds, stats = run_round()
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
            good = cfg.scaling.replicas - len(stats.dropped)
            (loss_sum,) = all_reduce_scalars([loss_sum], env.device)
            # Per rank: the outer sync's load differs between ranks (owners, rank0).
            by_rank = all_gather_scalars(
                [stats.bytes_received, stats.comm_seconds, stats.merge_seconds,
                 stats.wait_seconds], env.device)
            bytes_by_rank = [int(values[0]) for values in by_rank]
            self.bytes_total += max(bytes_by_rank)
            metrics: Metrics = {
                "round": self.round,
                "tokens": self.round * cfg.tokens_per_round,
                "loss": loss_sum / good if good else math.nan,
                "tokens_per_s": cfg.tokens_per_round / seconds,
                "round_seconds": seconds,
                "inner_seconds": inner_seconds,
                # The slowest / busiest rank's figures: the round waits for it.
                "outer_comm_seconds": max(values[1] for values in by_rank),
                "outer_merge_seconds": max(values[2] for values in by_rank),
                # The training thread's time blocked on outer syncs (outer.delay hides the rest).
                "outer_wait_seconds": max(values[3] for values in by_rank),
                "outer_bytes_received": max(bytes_by_rank),
                "outer_bytes_by_rank": bytes_by_rank,
                "dropped_replicas": stats.dropped,
            }
            saving = self.round % cfg.run.checkpoint_every == 0 or self.round == cfg.run.rounds
            metrics["state_sha256" if saving else "state_checksum"] = \
                self.check_workers_agree(full=saving)
            if self.round % cfg.run.eval_every == 0 or self.round == cfg.run.rounds:
                self.last_eval_loss = self.evaluate()
                metrics.update(eval_loss=self.last_eval_loss,
                               eval_perplexity=perplexity(self.last_eval_loss))
            if saving:
                with tempfile.TemporaryDirectory() as directory:
                    self.save(Path(directory))
                    self.stop_unless_checkpoint_fits(Path(directory))
                    env.report(metrics, Path(directory))
            else:
                env.report(metrics, None)

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
        return {
            "status": "done" if diverged is None else "diverged",
            **({} if diverged is None else {"diverged": diverged}),
            "rounds": self.round,
            "tokens": self.round * cfg.tokens_per_round,
            "num_parameters": count_parameters(self.model),
            "initial_eval_loss": self.initial_eval_loss,
            "final_eval_loss": self.last_eval_loss,
            "final_eval_perplexity": perplexity(self.last_eval_loss),
            "tokens_per_s": steady_tokens_per_s(self.round, cfg.tokens_per_round,
                                                self.train_seconds, self.first_round_seconds),
            "train_seconds": self.train_seconds,
            "first_round_seconds": self.first_round_seconds,
            "outer_bytes_per_round": self.bytes_total / max(self.round, 1),
            "model_sha256": checkpoint.parameters_sha256(self.global_params),
        }


def parameters_finite(params: dict[str, torch.Tensor]) -> bool:
    """Whether every parameter value is finite (one host sync for all tensors)."""
    bad = torch.stack([torch.isfinite(t).logical_not().sum() for t in params.values()]).sum()
    return int(bad) == 0


def steady_tokens_per_s(rounds: int, tokens_per_round: int, train_seconds: float,
                        first_round_seconds: float) -> float:
    """Training throughput after start-up: the first round also pays for starting the data
    streams (Ray Data spawns its reader processes then), so it is left out when there are
    others."""
    if rounds > 1:
        return (rounds - 1) * tokens_per_round / max(train_seconds - first_round_seconds, 1e-9)
    return rounds * tokens_per_round / max(train_seconds, 1e-9)


def kill_once_hook(spec: str | None) -> Callable[[int, int], None] | None:
    """Fault injection for tests: "ROUND:REPLICA:MARKER" SIGKILLs this worker after REPLICA's
    inner steps in round ROUND (0-based, i.e. mid-round), once: MARKER is created first and
    disarms the hook for the restarted workers."""
    if not spec:
        return None
    round_text, replica_text, marker = spec.split(":", 2)

    def hook(round_index: int, replica: int) -> None:
        if (round_index, replica) == (int(round_text), int(replica_text)):
            try:
                Path(marker).touch(exist_ok=False)
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def train_loop_per_worker(loop_config: dict[str, Any]) -> Metrics | None:
    """Ray Train entry point: builds the `WorkerEnv` from Ray's context, resumes from the
    newest intact checkpoint if there is one, runs the trainer, and exports the model (rank 0).

    Returns {"error": ..., "rounds": 0} on every rank, naming the bad files, when the run has
    checkpoints but none can be resumed from."""
    import ray
    import ray.train
    import ray.train.torch

    from isoloco_ray.data.stream import read_with_ray_data

    cfg = TrainConfig.model_validate(loop_config["config"])
    # Ray gives OMP_NUM_THREADS the worker's whole CPUs, but torch may have read it before, or
    # capped it: set what the run reserved (scaling.cpus_per_worker) explicitly.
    torch.set_num_threads(cfg.scaling.torch_threads)
    data_dir = storage.location(loop_config["data_dir"], "data.path")
    run_dir = storage.location(loop_config["run_dir"])
    progress = loop_config.get("progress")
    context = ray.train.get_context()
    rank = context.get_world_rank()

    def report(metrics: Metrics, checkpoint_dir: Path | None) -> None:
        if rank == 0 and progress is not None:
            progress.put(metrics)
        saved = None if checkpoint_dir is None else ray.train.Checkpoint.from_directory(
            checkpoint_dir)
        ray.train.report(metrics, checkpoint=saved)

    def build(restore_from: Path | None) -> Trainer:
        env = WorkerEnv(
            rank=rank,
            world=context.get_world_size(),
            device=ray.train.torch.get_device(),
            read_rows=read_with_ray_data,
            report=report,
            restore_from=restore_from,
            checkpoint_room=lambda needed: storage.checkpoint_room(run_dir, needed),
            after_replica=kill_once_hook(loop_config.get("kill_at")),
        )
        return Trainer(cfg, data_dir, env)

    # Ray Train's latest checkpoint, or the newest intact one before it if that is damaged
    # (resume.py). A damaged checkpoint is returned as the run's error, not raised: Ray Train
    # would restart the workers run.max_failures times for nothing. Every rank reaches the
    # same verdict, so all return alike, before any collective.
    latest = ray.train.get_checkpoint()
    candidates = [] if latest is None else resume.run_checkpoints(latest)
    with resume.open_resume_point(candidates) as start:
        if start.error is not None:
            return {"error": start.error, "rounds": 0}
        if start.warning is not None and rank == 0:
            print(start.warning, file=sys.stderr, flush=True)
        try:
            trainer = build(start.directory)  # restored in full before training goes on
        except checkpoint.CheckpointError as exc:  # naming the stored files, not the copies
            return {"error": str(exc).replace(str(start.directory), start.name), "rounds": 0}
    warning = start.warning
    node_of_rank: list[Any] = [None] * context.get_world_size()
    dist.all_gather_object(node_of_rank, ray.get_runtime_context().get_node_id())
    placement = placement_warning(node_of_rank, cfg.scaling.workers_per_replica)
    if placement is not None and rank == 0:
        print(placement, file=sys.stderr, flush=True)
    summary = trainer.run()
    if rank != 0:
        return None
    summary.update(workers=len(node_of_rank), nodes=len(set(node_of_rank)))
    if placement is not None:
        summary["placement_warning"] = placement
    if warning is not None:
        summary["resume_warning"] = warning
    summary["torch_threads"] = torch.get_num_threads()  # per worker (every rank sets alike)
    if "error" not in summary:
        try:  # a run without its model is not finished: the error keeps it resumable
            export_model(trainer.model, data_dir, run_dir / run_files.MODEL_DIR,
                         summary.get("diverged"))
        except ExportError as exc:
            summary["error"] = str(exc)
    return summary
