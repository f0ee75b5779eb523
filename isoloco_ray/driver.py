"""One run from the driver's side, the same for `python -m isoloco_ray.train` and a Tune trial:
the checks a run directory must pass (`check_run_dir`: a resumed run keeps its settings), then
`run_once`: config.json, Ray Train's TorchTrainer with a progress line per round, summary.json.

The train CLI adds what only a console run has around it (starting Ray, W&B, exit statuses);
a grid's trainable adds Tune's report callback and error.txt (grids/trainable.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from isoloco_ray import run_files, strict_json
from isoloco_ray.config import ConfigError, TrainConfig, config_differences
from isoloco_ray.elastic import allowed_counts_only, ray_scaling_config
from isoloco_ray.fault_tolerance import quorum_summary, read_end, timeouts, torchft_backend
from isoloco_ray.local_ray import joined_cluster
from isoloco_ray.metrics import RunSummary, format_progress
from isoloco_ray.own_files import append_line


class RunFailed(Exception):
    """The run did not finish; the message, one line, says why and what to do next (its
    checkpoints and run directory are kept for a resume); `detail`, what Ray Train said."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


def saved_config(run_dir: Path) -> dict[str, Any] | None:
    """The config.json an earlier attempt of this run wrote, or None for a new run."""
    path = run_dir / run_files.CONFIG
    return json.loads(path.read_text()) if path.exists() else None


def check_run_dir(cfg: TrainConfig, run_dir: Path, saved: dict[str, Any] | None) -> None:
    """ConfigError unless `cfg` may run in `run_dir`: a run directory that holds a run
    (`saved`, its config.json) resumes it only with the same settings, and a model directory
    there must be this package's export (it is replaced at the end)."""
    if saved is not None:
        differing = config_differences(saved, cfg)
        if differing:
            raise ConfigError(f"run.name: {run_dir} is a run with other settings "
                              f"({', '.join(differing)}); resume it with the same settings or "
                              "choose another run.name")
    from isoloco_ray.workers.state.export import ExportError, refuse_foreign

    try:  # found now, not after the training, whose model could then not be put in place
        refuse_foreign(run_dir / run_files.MODEL_DIR)
    except ExportError as exc:
        raise ConfigError(str(exc)) from None


def run_once(cfg: TrainConfig, data_dir: Path, run_dir: Path, *, started: float,
             callbacks: Sequence[Any] = (),
             on_metrics: Callable[[dict[str, Any]], None] | None = None,
             after_fit: Callable[[], None] | None = None,
             ray_start_seconds: float | None = None) -> dict[str, Any]:
    """Run `cfg` in its held, checked run directory (`check_run_dir`) on the running Ray
    cluster: write config.json, fit the TorchTrainer, write summary.json; returns the summary.

    `started`: the perf_counter the run's wall time (`seconds`) counts from; `callbacks`: Ray
    Train callbacks (Tune's); `on_metrics`: called with every round's report (W&B);
    `after_fit`: called once the trainer returned. Raises RunFailed when config.json cannot be
    written, when Ray Train gave up (run.max_failures) and when the workers stopped the run;
    a damaged checkpoint skipped at resume is said on stderr (the workers' is not shown)."""
    try:
        write_config(run_dir, cfg)
    except OSError as exc:
        raise RunFailed(f"run.storage_path: cannot write {run_dir / run_files.CONFIG} "
                        f"({exc.strerror or exc}); free space there and run the same command "
                        "again") from exc
    try:
        final = fit(cfg, data_dir, run_dir, callbacks=callbacks, on_metrics=on_metrics)
    except ray_train_failure() as exc:
        raise RunFailed(f"the run failed after {cfg.run.max_failures} restart(s) "
                        "(run.max_failures); its checkpoints are kept: run the same command "
                        "again to resume from the latest one", detail=str(exc)) from exc
    if after_fit is not None:
        after_fit()
    if "resume_warning" in final:
        print(final["resume_warning"], file=sys.stderr, flush=True)
    if "error" in final:  # the loop gave up (e.g. every replica diverged)
        after = f" after round {final['rounds']}" if final.get("rounds") else ""
        raise RunFailed(f"the run stopped{after}: {final['error']}")
    if ray_start_seconds is not None:
        final = {**final, "ray_start_seconds": ray_start_seconds}
    return write_summary(cfg, final, data_dir, run_dir, time.perf_counter() - started)


def follow_progress(queue: Any, rounds: int, log_path: Path, stop: threading.Event,
                    on_metrics: Callable[[dict[str, Any]], None] | None = None,
                    overlapped: bool = False) -> None:
    """Print and record (metrics.jsonl, and `on_metrics`, e.g. W&B) each report the recording
    worker (rank 0, or a quorum's lowest: Trainer.writes_run_files) puts on `queue` until
    `stop`. A failing `on_metrics` is reported once and then left out: the console and
    metrics.jsonl go on."""
    from ray.util.queue import Empty

    while not (stop.is_set() and queue.empty()):
        try:
            metrics = queue.get(timeout=0.5)
        except Empty:
            continue
        print(format_progress(metrics, rounds, overlapped), flush=True)
        try:  # opened per round: object storage has no appending to an open file
            append_line(log_path, strict_json.dumps(metrics))
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
    with Ray Data itself, from their positions: `data.ray_reader.read_with_ray_data`).

    `progress`: a ray.util.queue.Queue the recording worker puts every report on;
    `callbacks`: Ray Train callbacks (e.g. Tune's TuneReportCallback).
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    from isoloco_ray.workers.ray_entry import train_loop_per_worker

    joined = joined_cluster()
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.model_dump(mode="json"), "data_dir": str(data_dir),
                           "run_dir": str(run_dir), "progress": progress,
                           "loopback": not joined, "ft_timeouts": timeouts(),
                           # Test hook: see workers/ray_entry.py fault_once_hook.
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

    from isoloco_ray.workers.state.resume import repair_record

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
                                args=(progress, cfg.resolved.rounds,
                                      run_dir / run_files.METRICS, stop, on_metrics,
                                      cfg.outer.delay > 0))
    follower.start()

    def attempt() -> Any:
        with allowed_counts_only(cfg.scaling):
            return build_trainer(cfg, data_dir, run_dir, progress, callbacks).fit()

    try:
        result, restarts = (restarting_on_controller_errors(attempt, cfg.run.max_failures,
                                                           run_dir)
                            if replica_mode else (attempt(), 0))
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
    # Left by the final round's writer (workers/quorum/replica_mode.py): rank 0 may have been lost.
    final = read_end(run_dir)
    if final is None:
        return {"error": f"the workers ended without leaving the run's result "
                         f"({run_files.FT_END}); run the same command again to resume from the "
                         "latest checkpoint"}
    metrics = run_dir / run_files.METRICS
    if "error" not in final and metrics.exists():
        final.update(quorum_summary(metrics.read_text().splitlines()))
    if "error" not in final:
        final["group_restarts"] = restarts
    return final


def restarting_on_controller_errors(attempt: Callable[[], Any], max_failures: int,
                                    run_dir: Path) -> tuple[Any, int]:
    """(`attempt()`'s result, the times it was made again): `attempt()` is a replica-mode
    fit, made again while it ends in a Ray Train controller error
    before the run's result is written, at most `max_failures` times (-1: no limit). Ray
    2.60's controller fails that way when several workers are lost at once (it replaces
    their groups one by one and the second is dead already); the workers of the next
    attempt start together and resume from the newest complete checkpoint, so the losses
    cost the rounds since it, not the run. Other failures are raised as they come."""
    from ray.train import ControllerError

    restarts = 0
    while True:
        try:
            return attempt(), restarts
        except ControllerError as exc:
            if read_end(run_dir) is not None or restarts == max_failures:
                raise
            restarts += 1
            lines = str(getattr(exc, "controller_failure", exc)).strip().splitlines()
            cause = lines[0] if lines else type(exc).__name__
            print(f"warning: Ray Train's controller failed ({cause}), as it does "
                  "when several workers are lost at once: every worker starts again from the "
                  f"newest complete checkpoint (restart {restarts} of "
                  f"{'unlimited' if max_failures < 0 else max_failures}, run.max_failures)",
                  file=sys.stderr, flush=True)


def write_config(run_dir: Path, cfg: TrainConfig) -> None:
    """Write `run_dir/config.json`, the settings a resume must match, atomically: on a full
    disk the previous one stays whole (a truncated one would stop every later resume)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    strict_json.write(run_dir / run_files.CONFIG, cfg.model_dump(mode="json"), indent=2)


def write_summary(cfg: TrainConfig, final: dict[str, Any], data_dir: Path, run_dir: Path,
                  seconds: float) -> dict[str, Any]:
    """Write `run_dir/summary.json` for a finished run and return its contents."""
    summary = replace(  # the workers' figures, and what only the driver knows
        RunSummary(**final), strategy=cfg.outer.strategy, replicas=cfg.scaling.replicas,
        model_dir=str(run_dir / run_files.MODEL_DIR), run_dir=str(run_dir),
        data_dir=str(data_dir), seconds=seconds).as_dict()
    strict_json.write(run_dir / run_files.SUMMARY, summary, indent=2)
    return summary


def ray_train_failure() -> type[Exception]:
    """The exception TorchTrainer.fit raises when the workers failed for good."""
    from ray.train import TrainingFailedError

    return TrainingFailedError
