"""`python -m isoloco_ray.train [CONFIG.yaml] [--section.field=value ...]`: one DiLoCo run.

Validates the whole configuration against the data before any Ray process starts, then runs one
Ray Train TorchTrainer, printing a line per outer round, and ends with `summary: <path>`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from isoloco_ray import gpu_memory, run_files
from isoloco_ray.config import ConfigError, ScalingConfig, TrainConfig, load_config
from isoloco_ray.data.checks import epochs, validated_dataset
from isoloco_ray.data.format import DataError, Dataset
from isoloco_ray.data.prepare.documents import ensure_demo_for
from isoloco_ray.driver import RunFailed, check_run_dir, run_once, saved_config
from isoloco_ray.env_settings import read_env
from isoloco_ray.fault_tolerance import (absence_note, check_torchft_available,
                                         exposure_note)
from isoloco_ray.local_ray import RAY_ADDRESS_FIX, joined_cluster, unreachable_ray_address
from isoloco_ray.storage import check_writable, hold_run
from isoloco_ray.wandb_log import RunLogger, check_wandb_available

# Ray's defaults print dozens of lines per run on a laptop; these keep the console to our
# progress lines. They must be set before Ray starts; the Train ones reach the workers.
QUIET_RAY_ENV = {
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    # Ray Data starts a reader process per replica stream at once; above 4x this limit the
    # raylet prints a warning per burst that says nothing actionable here.
    "RAY_worker_maximum_startup_concurrency": "8",
}

# Ray Train's controller polls its workers this often (Ray's default: 2 s), and each checkpoint
# report and the end of a run wait for a poll. On a cluster of this machine, where runs are
# short and a poll costs nothing, 0.5 s took a tiny 2-round run from 17.3 s to 11.1 s. Set in
# this process, from which Ray Train passes it to its controller; a joined cluster keeps Ray's.
LOCAL_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}

# What the workers of a local cluster run with, unless this environment says otherwise. An
# OpenMP thread that waits for its team spins (the default, ACTIVE): on a machine shared with
# other jobs a preempted team member then stalls the others, and a worker with 2 threads on 2
# busy cores trained 3-4x slower than one with a single thread (R=8 demo, 1 worker: 1,152 vs
# 3,390 tok/s; PASSIVE: 4,671). Threads that sleep while they wait cost nothing of that.
LOCAL_WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# How often a run on a joined cluster (which may autoscale) looks for the GPUs scaling.use_gpu
# needs; it waits ISOLOCO_RAY_GPU_WAIT_SECONDS for them (env_settings.py) before it is refused.
GPU_POLL_SECONDS = 5.0


def run_name(cfg: TrainConfig) -> str:
    """`run.name`, or a fresh one from the strategy, R and the time."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return cfg.run.name or f"{cfg.outer.strategy}-R{cfg.scaling.replicas}-{stamp}"


def resolve_cpus_per_worker(scaling: ScalingConfig, *, local: bool, cores: int | None = None,
                            cluster_cpus: float | None = None) -> float:
    """`scaling.cpus_per_worker`, or, left unset, its default: on a local cluster the cores per
    worker (`cores // workers`, at least 1; `cores` defaults to this machine's), on a joined
    cluster 1 (its nodes are not this machine).

    `cluster_cpus`: the logical CPUs of the local cluster when they are fixed already (a
    cluster that is running, or `run.num_cpus`): the default then also leaves one of them to
    Ray Data's readers (at most `(cluster_cpus - 1) // workers`, at least 1)."""
    if scaling.cpus_per_worker is not None:
        return scaling.cpus_per_worker
    if not local:
        return 1.0
    workers = scaling.num_workers
    cpus = max(1, (cores or os.cpu_count() or 1) // workers)
    if cluster_cpus is not None:
        cpus = min(cpus, max(1, int((cluster_cpus - 1) // workers)))
    return float(cpus)


def running_cluster_cpus() -> float | None:
    """The logical CPUs of a Ray cluster this process is already connected to (a test's, a
    notebook's), else None. Never imports Ray: if it is not imported, none is running."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.cluster_resources().get("CPU", 0.0)


def with_cpus_per_worker(cfg: TrainConfig, saved: dict[str, Any] | None = None) -> TrainConfig:
    """`cfg` with `scaling.cpus_per_worker` resolved (resolve_cpus_per_worker) for the cluster
    this process will run on; `saved`, a resumed run's config.json, keeps the value the run
    started with when none is given (threads change float sums: a resumed run stays the same
    run)."""
    if cfg.scaling.cpus_per_worker is not None:
        return cfg
    saved_cpus = (saved or {}).get("scaling", {}).get("cpus_per_worker")
    if saved_cpus is not None:
        cpus = float(saved_cpus)
    else:
        local = not joined_cluster()
        running = running_cluster_cpus() if local else None
        cpus = resolve_cpus_per_worker(cfg.scaling, local=local,
                                       cluster_cpus=running or cfg.run.num_cpus)
    scaling = cfg.scaling.model_copy(update={"cpus_per_worker": cpus})
    return cfg.model_copy(update={"scaling": scaling})


def start_ray(cfg: TrainConfig, *, dashboard: bool = False,
              memory: gpu_memory.GpuMemory | None = None) -> None:
    """Join the cluster named by RAY_ADDRESS (e.g. under `ray job submit`), or start a local one
    with more logical CPUs than cores: Ray Data's read tasks need slots beside the workers;
    then check it has the GPUs the run asks for (`check_gpus`) and that CUDA works on them
    (`cuda_check`). An unset scaling.cpus_per_worker counts as 1 here (main resolves it
    first). `dashboard`: a local cluster also runs Ray's dashboard (on 127.0.0.1), which
    serves the state API. `memory`: a GPU run's bytes per worker, checked against the GPUs
    (gpu_memory.py)."""
    _join_or_start_ray(cfg, dashboard)
    check_gpus(cfg, joined=joined_cluster())
    if cfg.scaling.use_gpu:
        from isoloco_ray.cuda_check import check_cuda_on_gpu_nodes

        check_cuda_on_gpu_nodes(memory=memory)


def _join_or_start_ray(cfg: TrainConfig, dashboard: bool) -> None:
    """`start_ray` without the GPU check."""
    import ray

    for key, value in QUIET_RAY_ENV.items():
        os.environ.setdefault(key, value)
    if joined_cluster() and not ray.is_initialized():
        unreachable = unreachable_ray_address()
        if unreachable is not None:  # Ray would retry for minutes
            raise ConfigError(unreachable)
        # A real cluster may autoscale: its CPUs now say nothing about what it can run.
        try:
            ray.init(log_to_driver=False, logging_level="ERROR")
        except ConnectionError as exc:  # something answered there, but not a Ray cluster
            raise ConfigError(f"RAY_ADDRESS={os.environ['RAY_ADDRESS']!r}: {exc}; "
                              f"{RAY_ADDRESS_FIX}") from None
        return
    if not joined_cluster():
        for key, value in LOCAL_TRAIN_ENV.items():
            os.environ.setdefault(key, value)
    cpus_per_worker = cfg.scaling.worker_cpus
    workers_need = cfg.scaling.num_workers * cpus_per_worker
    if not ray.is_initialized():
        cores = os.cpu_count() or 1
        num_cpus = cfg.run.num_cpus or max(4, 2 * cores, math.ceil(workers_need + 2))
        if workers_need + 1 > num_cpus:
            raise ConfigError(
                f"run.num_cpus ({num_cpus}) leaves no CPU for Ray Data's readers beside "
                f"{cfg.scaling.num_workers} workers x scaling.cpus_per_worker "
                f"({cpus_per_worker:g}); raise run.num_cpus to at least "
                f"{math.ceil(workers_need + 1)}")
        # Loopback only, token auth on (local_ray.py): nobody else on the network can use it.
        from isoloco_ray.local_ray import start_local_cluster

        start_local_cluster(num_cpus, include_dashboard=dashboard, runtime_env={"env_vars": {
            key: os.environ.get(key, value) for key, value in LOCAL_WORKER_ENV.items()}})
        return
    available = ray.cluster_resources().get("CPU", 0)
    if not joined_cluster() and workers_need + 1 > available:
        raise ConfigError(
            f"the running Ray cluster has {available:g} CPUs: {cfg.scaling.num_workers} "
            f"workers x scaling.cpus_per_worker ({cpus_per_worker:g}) leave none for "
            "Ray Data's readers and the run would wait forever; lower "
            "scaling.cpus_per_worker (e.g. 0.5)")


def check_gpus(cfg: TrainConfig, joined: bool) -> None:
    """ConfigError when scaling.use_gpu asks for more GPUs (one per worker, at the fewest
    workers the run may use) than the Ray cluster has, instead of waiting for them forever: at
    once on a cluster of this machine; on a joined cluster, which an autoscaler may grow, after
    waiting up to ISOLOCO_RAY_GPU_WAIT_SECONDS for them, saying so."""
    import ray

    if not cfg.scaling.use_gpu:
        return
    need = min(cfg.scaling.worker_counts)
    have = ray.cluster_resources().get("GPU", 0.0)
    if have >= need:
        return
    wait = read_env().gpu_wait_seconds
    if joined:
        print(f"waiting up to {wait:g} s for {need} GPUs (scaling.use_gpu: one per "
              f"worker); the cluster has {have:g} now, an autoscaler may add nodes", flush=True)
        deadline = time.monotonic() + wait
        while have < need and time.monotonic() < deadline:
            time.sleep(min(GPU_POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
            have = ray.cluster_resources().get("GPU", 0.0)
        if have >= need:
            return
    waited = f" after {wait:g} s" if joined else ""
    raise ConfigError(f"scaling.use_gpu: the Ray cluster has {have:g} GPUs{waited} and the run "
                      f"needs {need} (one per worker); set scaling.use_gpu=false to train on "
                      "CPUs, or run on a cluster with GPUs")


def start_line(cfg: TrainConfig, data_dir: Path) -> str:
    """The line a run starts with: strategy, layout, threads per worker, model, length, data."""
    workers, threads = cfg.scaling.num_workers, cfg.scaling.torch_threads
    return (f"isoloco_ray: {cfg.outer.strategy}, R={cfg.scaling.replicas} on {workers} "
            f"worker{'s' if workers > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}, "
            f"model {cfg.model.preset}, {cfg.run.rounds} rounds x H={cfg.inner.steps}"
            f"{' (inner Muon+AdamW)' if cfg.inner.optimizer == 'muon' else ''}, "
            f"data {data_dir}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for configuration errors)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        read_env()  # every variable checked before anything starts
        cfg = load_config(args)
        ensure_demo_for(cfg)  # the demo corpus, prepared on first use when data.path is unset
        dataset = validated_dataset(cfg)
        check_wandb_available(cfg)
        check_torchft_available(cfg)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    exposure = exposure_note(cfg)
    if exposure is not None:
        print(exposure, file=sys.stderr, flush=True)
    name = run_name(cfg)
    try:
        run_dir = check_writable(cfg.run.storage_path) / name
        held = hold_run(run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with held:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})})
        return train_run(cfg, dataset, run_dir)


def gpu_memory_of(cfg: TrainConfig, dataset: Dataset) -> gpu_memory.GpuMemory:
    """The bytes one GPU worker of the run will hold (gpu_memory.py)."""
    from isoloco_ray.workers.model import parameter_shapes

    vocab = cfg.model.vocab_size or dataset.meta.vocab_size
    return gpu_memory.estimate(cfg, parameter_shapes(cfg.model, vocab), vocab)


def train_run(cfg: TrainConfig, dataset: Dataset, run_dir: Path) -> int:
    """`main` once the run directory is held: resume or start the run, then summarise it;
    returns the exit status."""
    if (run_dir / run_files.SUMMARY).exists():
        print(f"error: run.name: {run_dir} already holds a finished run; choose another "
              "run.name", file=sys.stderr)
        return 2
    saved = saved_config(run_dir)
    cfg = with_cpus_per_worker(cfg, saved)
    started = time.perf_counter()
    try:
        check_run_dir(cfg, run_dir, saved)
        if saved is not None:
            print(f"resuming {run_dir} from its latest checkpoint", flush=True)
        start_ray(cfg, memory=gpu_memory_of(cfg, dataset) if cfg.scaling.use_gpu else None)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ray_start_seconds = time.perf_counter() - started
    print(start_line(cfg, dataset.root), flush=True)
    passes = epochs(cfg, dataset.meta)
    if passes > 1:
        print(f"note: the run reads each replica's share of the train data {passes:.1f} times "
              "(epochs, each in the same order)", flush=True)
    with RunLogger(cfg, run_dir) as wandb_run:
        try:
            summary = run_once(cfg, dataset.root, run_dir, started=started,
                               on_metrics=wandb_run.log, ray_start_seconds=ray_start_seconds)
        except RunFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            if exc.detail:
                print(exc.detail, file=sys.stderr)
            return 1
        wandb_run.finish(summary)
    print(f"final eval loss {summary['final_eval_loss']:.4f} (from "
          f"{summary['initial_eval_loss']:.4f}), {summary['tokens']:,} tokens, "
          f"{summary['tokens_per_s']:,.0f} tok/s, {summary['seconds']:.0f}s")
    print(f"summary: {run_dir / run_files.SUMMARY}")
    absent = absence_note(summary)
    if absent is not None:
        print(absent)
    if summary.get("status") == "diverged":
        print(f"error: the run diverged: {summary['diverged']}; its model is in "
              f"{summary['model_dir']}, marked DIVERGED.txt", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
