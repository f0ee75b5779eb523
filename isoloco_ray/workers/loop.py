"""What each training worker runs: R/W replicas' inner steps, the outer sync, eval, metrics.

`run_worker` is plain PyTorch (+ torch.distributed when W > 1) so tests can run it in one
process or in a gloo group without Ray; `train_loop_per_worker` adapts it to Ray Train.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from isoloco_ray.config import TrainConfig
from isoloco_ray.data.format import DatasetMeta, split_files
from isoloco_ray.data.stream import EpochReader, ReplicaStream
from isoloco_ray.workers.collectives import TrafficCounter, all_reduce_scalars, all_reduce_sum
from isoloco_ray.workers.evaluate import eval_sequences, evaluate, perplexity
from isoloco_ray.workers.model import build_model, count_parameters
from isoloco_ray.workers.outer_sync import OuterStepStats, OuterSync
from isoloco_ray.workers.replica import Replica, load_parameters, snapshot_parameters

Metrics = dict[str, Any]


@dataclass
class WorkerEnv:
    """What the worker loop needs from whoever runs it (Ray Train, a test, a benchmark)."""

    rank: int
    world: int
    device: torch.device
    read_epoch: Callable[[int], EpochReader]  # replica index -> its epoch reader
    report: Callable[[Metrics], None]  # called by every rank once per evaluation/round


class Trainer:
    """One worker's training state; everything listed here is what a checkpoint must hold."""

    model: nn.Module
    global_params: dict[str, torch.Tensor]  # θ_t, identical on every worker
    replicas: list[Replica]  # the replicas this worker hosts (their AdamW, schedule, stream)
    outer: OuterSync  # outer optimizer (momentum buffers)
    round: int  # outer rounds completed

    def __init__(self, cfg: TrainConfig, data_dir: Path, env: WorkerEnv) -> None:
        self.cfg = cfg
        self.env = env
        meta = DatasetMeta.load(data_dir)
        self.model = build_model(cfg.model, meta.vocab_size, cfg.run.seed).to(env.device)
        self.global_params = snapshot_parameters(self.model)
        total_steps = cfg.run.rounds * cfg.inner.steps
        per_worker = cfg.scaling.replicas_per_worker
        fused = env.device.type == "cuda"
        self.replicas = [
            Replica(r, self.model, cfg.inner, total_steps,
                    ReplicaStream(env.read_epoch(r), cfg.data.seq_len, cfg.data.batch_size),
                    fused=fused)
            for r in range(env.rank * per_worker, (env.rank + 1) * per_worker)
        ]
        self.outer = OuterSync(cfg.outer, cfg.scaling.replicas, cfg.run.seed)
        self.round = 0
        self.eval_set = eval_sequences(split_files(data_dir, "valid"), cfg.data.seq_len,
                                       cfg.run.eval_tokens)

    def evaluate(self) -> float:
        """Validation loss of the global parameters."""
        load_parameters(self.model, self.global_params)
        return evaluate(self.model, self.eval_set, self.env.rank, self.env.world,
                        self.cfg.data.micro_batch_size, self.env.device)

    def diloco_round(self) -> tuple[float, float, OuterStepStats]:
        """H inner steps on every hosted replica, then the outer step. (loss, inner s, stats)."""
        started = time.perf_counter()
        deltas, losses = {}, []
        for replica in self.replicas:
            deltas[replica.index], loss = replica.run_inner_steps(
                self.model, self.global_params, self.cfg.inner.steps,
                self.cfg.data.micro_batch_size, self.env.device)
            losses.append(loss)
        inner_seconds = time.perf_counter() - started
        stats = self.outer.step(self.global_params, deltas, self.round)
        return sum(losses), inner_seconds, stats

    def data_parallel_round(self) -> tuple[float, float, OuterStepStats]:
        """adamw_ddp: H data-parallel AdamW steps on the global model, gradients averaged over
        all R replicas' batches every step (replica 0's optimizer is the one optimizer)."""
        stats, traffic = OuterStepStats(), TrafficCounter()
        optimizer, schedule = self.replicas[0].optimizer, self.replicas[0].schedule
        params = list(self.model.parameters())
        load_parameters(self.model, self.global_params)
        started, loss_sum = time.perf_counter(), 0.0
        for _ in range(self.cfg.inner.steps):
            optimizer.zero_grad(set_to_none=True)
            for replica in self.replicas:
                batch = replica.stream.next_batch().to(self.env.device, non_blocking=True)
                for micro in batch.split(self.cfg.data.micro_batch_size):
                    share = len(micro) / len(batch)
                    loss = self.model(input_ids=micro, labels=micro).loss
                    (loss * share).backward()
                    loss_sum += loss.item() * share / self.cfg.inner.steps
            computed = time.perf_counter()
            all_reduce_sum([p.grad for p in params], traffic)
            stats.comm_seconds += time.perf_counter() - computed
            for p in params:
                p.grad /= self.cfg.scaling.replicas
            if self.cfg.inner.clip is not None:
                nn.utils.clip_grad_norm_(params, self.cfg.inner.clip)
            optimizer.step()
            schedule.step()
        inner_seconds = time.perf_counter() - started - stats.comm_seconds
        self.global_params = snapshot_parameters(self.model)
        stats.bytes_received = traffic.take()
        return loss_sum, inner_seconds, stats

    def run(self) -> Metrics:
        """Train for cfg.run.rounds outer rounds; returns the final metrics (on every rank)."""
        cfg, env = self.cfg, self.env
        tokens_per_round = cfg.tokens_per_round
        initial_eval = self.evaluate()
        env.report({"round": 0, "tokens": 0, "eval_loss": initial_eval,
                    "eval_perplexity": perplexity(initial_eval)})
        eval_loss = initial_eval
        train_seconds, first_round_seconds, bytes_total = 0.0, 0.0, 0
        run_round = (self.data_parallel_round if cfg.outer.strategy == "adamw_ddp"
                     else self.diloco_round)
        while self.round < cfg.run.rounds:
            started = time.perf_counter()
            loss_sum, inner_seconds, stats = run_round()
            self.round += 1
            seconds = time.perf_counter() - started
            train_seconds += seconds
            if self.round == 1:
                first_round_seconds = seconds
            bytes_total += stats.bytes_received
            (loss_sum,) = all_reduce_scalars([loss_sum], env.device)
            metrics: Metrics = {
                "round": self.round,
                "tokens": self.round * tokens_per_round,
                "loss": loss_sum / cfg.scaling.replicas,
                "tokens_per_s": tokens_per_round / seconds,
                "round_seconds": seconds,
                "inner_seconds": inner_seconds,
                "outer_comm_seconds": stats.comm_seconds,
                "outer_merge_seconds": stats.merge_seconds,
                "outer_bytes_received": stats.bytes_received,
            }
            if self.round % cfg.run.eval_every == 0 or self.round == cfg.run.rounds:
                eval_loss = self.evaluate()
                metrics.update(eval_loss=eval_loss, eval_perplexity=perplexity(eval_loss))
            env.report(metrics)
        load_parameters(self.model, self.global_params)
        return {
            "rounds": self.round,
            "tokens": self.round * tokens_per_round,
            "num_parameters": count_parameters(self.model),
            "initial_eval_loss": initial_eval,
            "final_eval_loss": eval_loss,
            "final_eval_perplexity": perplexity(eval_loss),
            "tokens_per_s": steady_tokens_per_s(self.round, tokens_per_round, train_seconds,
                                                first_round_seconds),
            "train_seconds": train_seconds,
            "first_round_seconds": first_round_seconds,
            "outer_bytes_per_round": bytes_total / max(self.round, 1),
        }


def steady_tokens_per_s(rounds: int, tokens_per_round: int, train_seconds: float,
                        first_round_seconds: float) -> float:
    """Training throughput after start-up: the first round also pays for starting the data
    streams (Ray Data spawns its reader processes then), so it is left out when there are
    others."""
    if rounds > 1:
        return (rounds - 1) * tokens_per_round / max(train_seconds - first_round_seconds, 1e-9)
    return rounds * tokens_per_round / max(train_seconds, 1e-9)


def export_model(model: nn.Module, data_dir: Path, out_dir: Path) -> None:
    """Save the model (safetensors) and the data's tokenizer for `from_pretrained`."""
    from transformers import AutoTokenizer

    meta = DatasetMeta.load(data_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer_source = data_dir / meta.tokenizer
    AutoTokenizer.from_pretrained(tokenizer_source if tokenizer_source.exists()
                                  else meta.tokenizer).save_pretrained(out_dir)


def train_loop_per_worker(loop_config: dict[str, Any]) -> Metrics | None:
    """Ray Train entry point: builds the `WorkerEnv` from Ray's context and runs the trainer."""
    import ray.train
    import ray.train.torch

    from isoloco_ray.data.stream import dataset_name, ray_data_reader

    cfg = TrainConfig.model_validate(loop_config["config"])
    data_dir, run_dir = Path(loop_config["data_dir"]), Path(loop_config["run_dir"])
    progress = loop_config.get("progress")
    context = ray.train.get_context()
    rank = context.get_world_rank()

    def report(metrics: Metrics) -> None:
        if rank == 0 and progress is not None:
            progress.put(metrics)
        ray.train.report(metrics)

    env = WorkerEnv(
        rank=rank,
        world=context.get_world_size(),
        device=ray.train.torch.get_device(),
        read_epoch=lambda r: ray_data_reader(ray.train.get_dataset_shard(dataset_name(r))),
        report=report,
    )
    trainer = Trainer(cfg, data_dir, env)
    summary = trainer.run()
    if rank == 0:
        export_model(trainer.model, data_dir, run_dir / "model")
        return summary
    return None
