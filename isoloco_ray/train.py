"""`python -m isoloco_ray.train [CONFIG.yaml] [--section.field=value ...]`: one DiLoCo run.

Validates the whole configuration against the data before any Ray process starts, then runs one
Ray Train TorchTrainer, printing a line per outer round, and ends with `summary: <path>`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from isoloco_ray import run_files, strict_json
from isoloco_ray.config import (
    ConfigError,
    ScalingConfig,
    TrainConfig,
    config_differences,
    load_config,
)
from isoloco_ray.data.checks import epochs, validated_data_dir
from isoloco_ray.data.format import DataError, DatasetMeta
from isoloco_ray.elastic import allowed_counts_only, ray_scaling_config
from isoloco_ray.fault_tolerance import (
    check_torchft_available,
    quorum_summary,
    timeouts,
    torchft_backend,
)
from isoloco_ray.local_ray import joined_cluster
from isoloco_ray.metrics import RunSummary, format_progress
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
# How long a run on a joined cluster (which may autoscale) waits for the GPUs scaling.use_gpu
# needs before it is refused.
GPU_WAIT_SECONDS = float(os.environ.get("ISOLOCO_RAY_GPU_WAIT_SECONDS", 600))
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


def start_ray(cfg: TrainConfig, *, dashboard: bool = False) -> None:
    """Join the cluster named by RAY_ADDRESS (e.g. under `ray job submit`), or start a local one
    with more logical CPUs than cores: Ray Data's read tasks need slots beside the workers;
    then check it has the GPUs the run asks for (`check_gpus`) and that CUDA works on them
    (`cuda_check`). An unset scaling.cpus_per_worker counts as 1 here (main resolves it
    first). `dashboard`: a local cluster also runs Ray's dashboard (on 127.0.0.1), which
    serves the state API."""
    _join_or_start_ray(cfg, dashboard)
    check_gpus(cfg, joined=joined_cluster())
    if cfg.scaling.use_gpu:
        from isoloco_ray.cuda_check import check_cuda_on_gpu_nodes

        check_cuda_on_gpu_nodes()


def _join_or_start_ray(cfg: TrainConfig, dashboard: bool) -> None:
    """`start_ray` without the GPU check."""
    import ray

    for key, value in QUIET_RAY_ENV.items():
        os.environ.setdefault(key, value)
    if joined_cluster() and not ray.is_initialized():
        # A real cluster may autoscale: its CPUs now say nothing about what it can run.
        ray.init(log_to_driver=False, logging_level="ERROR")
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
    waiting up to GPU_WAIT_SECONDS for them, saying so."""
    import ray

    if not cfg.scaling.use_gpu:
        return
    need = min(cfg.scaling.worker_counts)
    have = ray.cluster_resources().get("GPU", 0.0)
    if have >= need:
        return
    if joined:
        print(f"waiting up to {GPU_WAIT_SECONDS:g} s for {need} GPUs (scaling.use_gpu: one per "
              f"worker); the cluster has {have:g} now, an autoscaler may add nodes", flush=True)
        deadline = time.monotonic() + GPU_WAIT_SECONDS
        while have < need and time.monotonic() < deadline:
            time.sleep(min(GPU_POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
            have = ray.cluster_resources().get("GPU", 0.0)
        if have >= need:
            return
    waited = f" after {GPU_WAIT_SECONDS:g} s" if joined else ""
    raise ConfigError(f"scaling.use_gpu: the Ray cluster has {have:g} GPUs{waited} and the run "
                      f"needs {need} (one per worker); set scaling.use_gpu=false to train on "
                      "CPUs, or run on a cluster with GPUs")


def start_line(cfg: TrainConfig, data_dir: Path) -> str:
    """The line a run starts with: strategy, layout, threads per worker, model, length, data."""
    workers, threads = cfg.scaling.num_workers, cfg.scaling.torch_threads
    return (f"isoloco_ray: {cfg.outer.strategy}, R={cfg.scaling.replicas} on {workers} "
            f"worker{'s' if workers > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}, "
            f"model {cfg.model.preset}, {cfg.run.rounds} rounds x H={cfg.inner.steps}, "
            f"data {data_dir}")


def follow_progress(queue: Any, rounds: int, log_path: Path, stop: threading.Event,
                    on_metrics: Callable[[dict[str, Any]], None] | None = None,
                    overlapped: bool = False) -> None:
    """Print and record (metrics.jsonl, and `on_metrics`, e.g. W&B) each report rank 0 puts on
    `queue` until `stop`. A failing `on_metrics` is reported once and then left out: the
    console and metrics.jsonl go on."""
    from ray.util.queue import Empty

    while not (stop.is_set() and queue.empty()):
        try:
            metrics = queue.get(timeout=0.5)
        except Empty:
            continue
        print(format_progress(metrics, rounds, overlapped), flush=True)
        try:  # opened per round: object storage has no appending to an open file
            with log_path.open("a") as log:
                log.write(strict_json.dumps(metrics) + "\n")
        except Exception as exc:  # noqa: BLE001 - an unreachable store must not stop the run
            print(f"warning: cannot record round {metrics.get('round')} in {log_path} "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        if on_metrics is not None:
            try:
                on_metrics(metrics)
            except Exception as exc:  # noqa: BLE001 - a logger must not stop the record
                print(f"warning: logging round {metrics.get('round')} failed "
                      f"({type(exc).__name__}: {exc}); no further rounds are sent there, "
                      f"{log_path} keeps every round", file=sys.stderr, flush=True)
                on_metrics = None


def build_trainer(cfg: TrainConfig, data_dir: Path, run_dir: Path, progress: Any = None,
                  callbacks: Sequence[Any] = ()) -> Any:
    """The Ray Train TorchTrainer of one run (R/V workers; each streams its replicas' shares
    with Ray Data itself, from their positions: `stream.read_with_ray_data`).

    `progress`: a ray.util.queue.Queue that rank 0 puts every report on; `callbacks`: Ray
    Train callbacks (e.g. Tune's TuneReportCallback).
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    from isoloco_ray.workers.loop import train_loop_per_worker

    joined = joined_cluster()
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.model_dump(mode="json"), "data_dir": str(data_dir),
                           "run_dir": str(run_dir), "progress": progress,
                           "loopback": not joined, "ft_timeouts": timeouts(),
                           # Test hook: see workers/loop.py kill_once_hook.
                           "kill_at": os.environ.get("ISOLOCO_RAY_KILL_AT")},
        torch_config=(torchft_backend(cfg, joined)
                      if cfg.scaling.fault_tolerance == "replica" else None),
        scaling_config=ray_scaling_config(cfg.scaling),
        run_config=ray.train.RunConfig(
            name=run_dir.name, storage_path=str(run_dir.parent), callbacks=list(callbacks),
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
            logging_config=ray.train.LoggingConfig(log_level="ERROR")),
    )


def fit(cfg: TrainConfig, data_dir: Path, run_dir: Path, callbacks: Sequence[Any] = (),
        on_metrics: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the TorchTrainer, printing progress lines; returns rank 0's final metrics.

    `callbacks`: Ray Train callbacks (Tune's in a grid); `on_metrics`: called in the driver
    with every report."""
    import ray
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from isoloco_ray.workers.resume import repair_record

    # On this (the driver's) node: a queue on a node that is lost would take every later
    # progress line with it, while the run goes on elsewhere.
    progress = Queue(actor_options={"num_cpus": 0, "scheduling_strategy":
                                    NodeAffinitySchedulingStrategy(
                                        ray.get_runtime_context().get_node_id(), soft=False)})
    # Before Ray Train reads it: a record a crash left unreadable would stop the run for good.
    repaired = repair_record(run_dir)
    if repaired is not None:
        print(repaired, file=sys.stderr, flush=True)
    replica_mode = cfg.scaling.fault_tolerance == "replica"
    if replica_mode:  # a result left by an earlier attempt of this run is not this one's
        (run_dir / run_files.FT_END).unlink(missing_ok=True)
    stop = threading.Event()
    follower = threading.Thread(target=follow_progress, daemon=True,
                                args=(progress, cfg.run.rounds, run_dir / run_files.METRICS, stop,
                                      on_metrics, cfg.outer.delay > 0))
    follower.start()
    from isoloco_ray.workers.replica_mode import read_end

    try:
        with allowed_counts_only(cfg.scaling):
            result = build_trainer(cfg, data_dir, run_dir, progress, callbacks).fit()
    except ray_train_failure():
        # In replica mode a worker that outlived the run's result by long enough exits, and
        # Ray Train may count that as its last failure: the run is over all the same.
        if not replica_mode or read_end(run_dir) is None:
            raise
    finally:
        stop.set()
        follower.join()
    if not replica_mode:
        return result.return_value
    # Left by the final round's writer (workers/replica_mode.py): rank 0 may have been lost.
    final = read_end(run_dir)
    if final is None:
        return {"error": f"the workers ended without leaving the run's result "
                         f"({run_files.FT_END}); run the same command again to resume from the "
                         "latest checkpoint"}
    metrics = run_dir / run_files.METRICS
    if "error" not in final and metrics.exists():
        final.update(quorum_summary(metrics.read_text().splitlines()))
    return final


def write_config(run_dir: Path, cfg: TrainConfig) -> None:
    """Write `run_dir/config.json`, the settings a resume must match, atomically: on a full
    disk the previous one stays whole (a truncated one would stop every later resume)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    strict_json.write(run_dir / run_files.CONFIG, cfg.model_dump(mode="json"), indent=2)


def write_summary(cfg: TrainConfig, final: dict[str, Any], data_dir: Path, run_dir: Path,
                  seconds: float) -> dict[str, Any]:
    """Write `run_dir/summary.json` for a finished run and return its contents."""
    summary = RunSummary(**final).as_dict() | RunSummary(
        strategy=cfg.outer.strategy, replicas=cfg.scaling.replicas,
        model_dir=str(run_dir / run_files.MODEL_DIR), run_dir=str(run_dir),
        data_dir=str(data_dir), seconds=seconds).as_dict()
    strict_json.write(run_dir / run_files.SUMMARY, summary, indent=2)
    return summary


def ray_train_failure() -> type[Exception]:
    """The exception TorchTrainer.fit raises when the workers failed for good."""
    from ray.train import TrainingFailedError

    return TrainingFailedError


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for configuration errors)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(args)
        data_dir = validated_data_dir(cfg)
        check_wandb_available(cfg)
        check_torchft_available(cfg)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = run_name(cfg)
    try:
        run_dir = check_writable(cfg.run.storage_path) / name
        held = hold_run(run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with held:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})})
        return train_run(cfg, data_dir, run_dir)


def train_run(cfg: TrainConfig, data_dir: Path, run_dir: Path) -> int:
    """`main` once the run directory is held: resume or start the run, then summarise it;
    returns the exit status."""
    if (run_dir / run_files.SUMMARY).exists():
        print(f"error: run.name: {run_dir} already holds a finished run; choose another "
              "run.name", file=sys.stderr)
        return 2
    resuming = (run_dir / run_files.CONFIG).exists()
    saved = json.loads((run_dir / run_files.CONFIG).read_text()) if resuming else None
    cfg = with_cpus_per_worker(cfg, saved)
    if resuming:
        differing = config_differences(saved, cfg)
        if differing:
            print(f"error: run.name: {run_dir} is a run with other settings "
                  f"({', '.join(differing)}); resume it with the same settings or choose "
                  "another run.name", file=sys.stderr)
            return 2
        print(f"resuming {run_dir} from its latest checkpoint", flush=True)
    from isoloco_ray.workers.export import ExportError, refuse_foreign

    try:  # found now, not after the training, whose model could then not be put in place
        refuse_foreign(run_dir / run_files.MODEL_DIR)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        start_ray(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ray_start_seconds = time.perf_counter() - started
    try:
        write_config(run_dir, cfg)
    except OSError as exc:
        print(f"error: run.storage_path: cannot write {run_dir / run_files.CONFIG} "
              f"({exc.strerror or exc}); free space there and run the same command again",
              file=sys.stderr)
        return 1

    print(start_line(cfg, data_dir), flush=True)
    passes = epochs(cfg, DatasetMeta.load(data_dir))
    if passes > 1:
        print(f"note: the run reads each replica's share of the train data {passes:.1f} times "
              "(epochs, each in the same order)", flush=True)
    with RunLogger(cfg, run_dir) as wandb_run:
        try:
            final = fit(cfg, data_dir, run_dir, on_metrics=wandb_run.log)
        except ray_train_failure() as exc:
            print(f"error: the run failed after {cfg.run.max_failures} restart(s) "
                  f"(run.max_failures): {exc}\nIts checkpoints are kept: run the same command "
                  "again to resume from the latest one.", file=sys.stderr)
            return 1
        if "resume_warning" in final:  # a damaged checkpoint was skipped; said here, as the
            print(final["resume_warning"], file=sys.stderr)  # workers' stderr is not shown
        if "error" in final:
            after = f" after round {final['rounds']}" if final.get("rounds") else ""
            print(f"error: the run stopped{after}: {final['error']}", file=sys.stderr)
            return 1
        summary = write_summary(cfg, {**final, "ray_start_seconds": ray_start_seconds},
                                data_dir, run_dir, time.perf_counter() - started)
        wandb_run.finish(summary)
    print(f"final eval loss {summary['final_eval_loss']:.4f} (from "
          f"{summary['initial_eval_loss']:.4f}), {summary['tokens']:,} tokens, "
          f"{summary['tokens_per_s']:,.0f} tok/s, {summary['seconds']:.0f}s")
    print(f"summary: {run_dir / run_files.SUMMARY}")
    if summary.get("status") == "diverged":
        print(f"error: the run diverged: {summary['diverged']}; its model is in "
              f"{summary['model_dir']}, marked DIVERGED.txt", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
