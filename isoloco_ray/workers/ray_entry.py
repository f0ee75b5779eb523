"""What Ray Train runs in each worker (`train_loop_per_worker`): the WorkerEnv from Ray's
context, the resume from the newest intact checkpoint, the Trainer's run (loop.py), the model's
export; in `scaling.fault_tolerance: replica` mode the same through replica_mode.py. Imports
Ray; loop.py does not know this module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from isoloco_ray import run_files, storage
from isoloco_ray.config import TrainConfig
from isoloco_ray.data.format import Dataset
from isoloco_ray.own_files import replace_file
from isoloco_ray.workers.parallel.layout import placement_warning
from isoloco_ray.workers.rounds.round_metrics import Metrics
from isoloco_ray.workers.state import checkpoint, resume
from isoloco_ray.workers.worker_env import WorkerEnv

if TYPE_CHECKING:
    from isoloco_ray.workers.loop import Trainer


def fault_once_hook(spec: str | None) -> FaultHooks | None:
    """Fault injection for tests and benchmarks/chaos.py (None without a spec): the
    FaultHooks of `spec`."""
    return FaultHooks(spec) if spec else None


class FaultHooks:
    """Fault injection for tests and benchmarks/chaos.py. Called (WorkerEnv.after_replica)
    after each replica's inner steps with (round, replica); `after_step` after each inner step.

    "ROUND:REPLICA:MARKER" SIGKILLs this worker after REPLICA's inner steps in round ROUND
    (0-based, i.e. mid-round), once; "ROUND:REPLICA:stop=SECONDS:MARKER" instead stops it there
    (SIGSTOP, every thread: its heartbeats too, as a paused or swapped-out process) and has a
    process of its own send SIGCONT SECONDS later; "ROUND:REPLICA:slow=F/SECONDS:MARKER" makes
    it F times slower from there for SECONDS (each inner step followed by a sleep of F − 1
    times its own length: a throttled or shared machine, alive and heartbeating);
    "ROUND:REPLICA:node=SECONDS:MARKER" writes the id of the Ray node it runs on and its
    process id to MARKER.node, then stops as stop= does (benchmarks/soak.py --nodes removes
    that node, the worker's processes with it, as a machine lost mid-round). MARKER is created
    first (its time is the fault's) and disarms the fault for the workers that start later.
    Several, comma-separated. An item "floor=SECONDS" makes each inner step last at least
    SECONDS (`after_step` sleeps the rest): benchmarks/soak.py's workers then wait on their
    steps, as workers bound by an accelerator do, rather than share two CPU cores as five (a
    slowed worker's steps are the floor's times F)."""

    def __init__(self, spec: str) -> None:
        self.faults: dict[tuple[int, int], tuple[str, str | None, str | None]] = {}
        self.floor = 0.0
        for item in spec.split(","):
            if item.startswith("floor="):
                self.floor = float(item[len("floor="):])
                continue
            round_text, replica_text, rest = item.split(":", 2)
            kind = value = None
            if rest.startswith(("stop=", "slow=", "node=")):
                setting, rest = rest.split(":", 1)
                kind, value = setting.split("=", 1)
            self.faults[int(round_text), int(replica_text)] = (rest, kind, value)
        self.slow_factor, self.slow_until = 1.0, 0.0
        self.step_started: float | None = None  # the previous step's end (or replica's start)

    def __call__(self, round_index: int, replica: int) -> None:
        self.step_started = None  # the next replica's first step: from its next step's end
        fault = self.faults.get((round_index, replica))
        if fault is None:
            return
        marker, kind, value = fault
        try:
            Path(marker).touch(exist_ok=False)
        except FileExistsError:
            return
        if kind is None:
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "slow":
            assert value is not None
            factor, seconds = value.split("/")
            self.slow_factor = float(factor)
            self.slow_until = time.monotonic() + float(seconds)
            return
        if kind == "node":
            import ray

            # Whole or not at all (written beside it, then renamed): the soak reads it at once.
            replace_file(Path(f"{marker}.node"),
                         f"{ray.get_runtime_context().get_node_id()} {os.getpid()}")
        subprocess.Popen(["sh", "-c", f"sleep {value}; kill -CONT {os.getpid()}"],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.kill(os.getpid(), signal.SIGSTOP)

    def after_step(self, round_index: int, replica: int) -> None:
        """Pad the step just taken to the floor, then while slowed sleep F − 1 times its
        length (timed from the previous step's end; a replica's first step, whose start this
        hook does not see, from its own end: padded to the floor whole)."""
        started = self.step_started
        if self.floor:
            time.sleep(self.floor if started is None
                       else max(0.0, started + self.floor - time.monotonic()))
        now = time.monotonic()
        if now < self.slow_until:
            length = self.floor if started is None else now - started
            time.sleep((self.slow_factor - 1.0) * length)
        self.step_started = time.monotonic()


def train_loop_per_worker(loop_config: dict[str, Any]) -> Metrics | None:
    """Ray Train entry point: builds the `WorkerEnv` from Ray's context, resumes from the
    newest intact checkpoint if there is one, runs the trainer, and exports the model (rank 0).

    Returns {"error": ..., "rounds": 0} on every rank, naming the bad files, when the run has
    checkpoints but none can be resumed from. With scaling.fault_tolerance: replica the run
    goes through replica_mode.py instead, and returns nothing."""
    import ray
    import ray.train
    import ray.train.torch

    # Here, not at the top: the driver (every grid trial's process too) imports this module to
    # hand Ray Train this function, and needs neither the model stack (transformers) nor loop.py.
    from isoloco_ray.data.ray_reader import read_with_ray_data
    from isoloco_ray.workers.loop import Trainer
    from isoloco_ray.workers.state.export import export_into_summary

    cfg = TrainConfig.model_validate(loop_config["config"])
    # Ray gives OMP_NUM_THREADS the worker's whole CPUs, but torch may have read it before, or
    # capped it: set what the run reserved (scaling.cpus_per_worker) explicitly.
    torch.set_num_threads(cfg.scaling.torch_threads)
    dataset = Dataset.open(storage.location(loop_config["data_dir"], "data.path"))
    run_dir = storage.location(loop_config["run_dir"])
    progress = loop_config.get("progress")
    context = ray.train.get_context()
    rank = context.get_world_rank()

    def report(metrics: Metrics, checkpoint_dir: Path | None, writer: bool) -> None:
        if writer and progress is not None:
            progress.put(metrics)
        saved = None if checkpoint_dir is None else ray.train.Checkpoint.from_directory(
            checkpoint_dir)
        ray.train.report(metrics, checkpoint=saved)

    env = WorkerEnv(
        rank=rank,
        world=context.get_world_size(),
        device=ray.train.torch.get_device(),
        read_rows=read_with_ray_data,
        report=report,
        checkpoint_room=lambda needed: storage.checkpoint_room(run_dir, needed),
    )
    hooks = fault_once_hook(loop_config.get("kill_at"))
    if hooks is not None:
        env = replace(env, after_replica=hooks, after_step=hooks.after_step)
    if cfg.scaling.fault_tolerance == "replica":
        from isoloco_ray.workers.quorum.replica_mode import train_replica_worker

        train_replica_worker(cfg, dataset, run_dir, env, progress, loop_config["loopback"],
                             loop_config["ft_timeouts"])
        return None

    def build(restore_from: Path | None) -> Trainer:
        return Trainer(cfg, dataset, replace(env, restore_from=restore_from))

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
        export_into_summary(summary, trainer.model, dataset, run_dir / run_files.MODEL_DIR)
    return summary
