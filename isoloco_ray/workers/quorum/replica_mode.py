"""A Ray Train worker of a `scaling.fault_tolerance: replica` run (docs/fault_tolerance.md).

Each worker is one torchft replica group with a quorum seat (quorum/seat.py): its outer syncs run
over the workers alive, and Ray Train replaces a lost worker alone. Nothing here goes through
Ray Train's reports, each of which waits for every worker (a lost one would hold them all until
Ray Train restarts the whole group, which this mode exists to avoid). Instead:

- progress: each round's writer (the lowest worker rank in its quorum that took the round, not
  one that only joined in it: CommittedSync.writer) puts the round's metrics on the driver's
  queue;
- checkpoints: every worker of a checkpoint round's quorum writes its replicas' files (one
  that joined in the round, those it rejoins with), and the writer the shared ones, into the
  run directory's `ftcheckpoint_<round>/`, keeping the newest complete one besides the newest
  (QuorumReports); a resumed run starts from the newest intact one
  (resume.open_resume_point) and deletes those newer (an earlier attempt's). One taken in a
  round a worker missed lacks that worker's replicas, which are not needed: restored, they
  start again from θ at its round (checkpoint.absent_replicas);
- the end: the final round's writer exports the model and writes `ft_end.json`, the run's
  result, which the driver reads; a worker that has to stop writes why there instead.

A worker replacing a lost one reads nothing from storage: it is healed by its peers in its
first sync (θ, outer optimizer, counters; quorum/seat.py says why it always is) and its replicas go
on from there (SeatedTrainer.join). Only workers that start the run together resume it from the
newest checkpoint. If the run ends before it gets a quorum, it waits at most
its quorum timeout, then returns. A worker still running `END_GRACE_S` after the run's result
was written (one that hangs alive) exits: Ray Train waits for every worker before it ends a
run.
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from isoloco_ray import own_files, run_files, storage, strict_json
from isoloco_ray.config import TrainConfig
from isoloco_ray.data.format import Dataset
from isoloco_ray.fault_tolerance import min_quorum, read_end
from isoloco_ray.workers.agreement import TrainingStopped
from isoloco_ray.workers.loop import Trainer
from isoloco_ray.workers.model import parameter_shapes
from isoloco_ray.workers.quorum.seat import QuorumSeat
from isoloco_ray.workers.quorum.seated_trainer import SeatedTrainer
from isoloco_ray.workers.quorum.sync import quorum_numel
from isoloco_ray.workers.rounds.round_metrics import Metrics
from isoloco_ray.workers.state import checkpoint, resume
from isoloco_ray.workers.state.export import export_into_summary
from isoloco_ray.workers.worker_env import WorkerEnv

# How long a worker may go on once the run's result is written (its last checkpoint files may
# still be uploading), and how often it looks for the result.
END_GRACE_S = 60.0
END_POLL_S = 1.0

def seated_trainer(cfg: TrainConfig, data: Path | Dataset, env: WorkerEnv, lighthouse: str, *,
                   timeout: timedelta, quorum_timeout: timedelta,
                   host: str = "127.0.0.1") -> SeatedTrainer:
    """Worker `env.rank`'s Trainer with a quorum seat (env.seat is replaced) through which a
    peer that fell behind is healed: the seat's state callbacks are this Trainer's. The
    timeouts are the run's (fault_tolerance.timeouts)."""
    holder: dict[str, SeatedTrainer] = {}
    dataset = Dataset.open(data)
    shapes = parameter_shapes(cfg.model, dataset.meta.vocab_size).values()
    numel = quorum_numel(cfg.outer.quorum_outer(), [torch.Size(shape) for shape in shapes],
                         cfg.scaling.replicas_per_worker)
    seat = QuorumSeat(env.rank, cfg.scaling.num_workers, cfg.scaling.replicas, numel,
                      lighthouse,
                      lambda: holder["trainer"].quorum_state(),
                      lambda state: holder["trainer"].load_quorum_state(state),
                      min_workers=min_quorum(cfg.scaling.num_workers), host=host,
                      timeout=timeout, quorum_timeout=quorum_timeout,
                      fingerprint=lambda: checkpoint.parameters_checksum(
                          holder["trainer"].global_params),
                      current_round=lambda: holder["trainer"].round)
    try:
        holder["trainer"] = SeatedTrainer(cfg, dataset, replace(env, seat=seat))
    except BaseException:
        seat.shutdown()
        raise
    return holder["trainer"]


def lighthouse_address(loopback: bool) -> str:
    """The lighthouse Ray Train started (its address is in TORCHFT_LIGHTHOUSE). torchft names
    it by the head's host name, whatever it listens on; on a local cluster, where it listens on
    loopback, it is reached there."""
    address = os.environ["TORCHFT_LIGHTHOUSE"]
    if not loopback:
        return address
    parts = urlsplit(address)
    return f"{parts.scheme}://127.0.0.1:{parts.port}"


def stored_checkpoints(run_dir: Any) -> list[Any]:
    """The run's checkpoints (ray.train.Checkpoint), newest first."""
    import pyarrow.fs
    import ray.train

    filesystem, path = storage.arrow_location(run_dir)
    prefix = run_files.FT_CHECKPOINT.split("{", 1)[0]
    try:
        entries = filesystem.get_file_info(pyarrow.fs.FileSelector(path))
    except FileNotFoundError:
        return []
    names = sorted((entry.base_name for entry in entries
                    if entry.type == pyarrow.fs.FileType.Directory
                    and entry.base_name.startswith(prefix)), reverse=True)
    return [ray.train.Checkpoint(posixpath.join(path, name), filesystem=filesystem)
            for name in names]


class QuorumReports:
    """WorkerEnv.report of a seated worker: progress and checkpoints (the module's docstring).
    The writer keeps the newest `keep` checkpoints and the newest complete one (every file
    it needs: checkpoint.needed_files), so that a copy cut short never leaves the run
    without one to resume from."""

    def __init__(self, run_dir: Any, progress: Any, keep: int) -> None:
        self.run_dir, self.progress, self.keep = run_dir, progress, keep

    def __call__(self, metrics: Metrics, directory: Path | None, writer: bool) -> None:
        if writer and self.progress is not None:
            self.progress.put(metrics)
        if directory is None:
            return
        try:
            storage.upload_directory(directory, self.run_dir / run_files.FT_CHECKPOINT.format(
                round=metrics["round"]))
        except own_files.LinkRefused as planted:  # every worker meets it: all stop
            raise TrainingStopped(str(planted)) from None
        if writer:
            self._prune()

    def _prune(self) -> None:
        """Delete all but the newest `keep` checkpoints and the newest complete one."""
        filesystem, _ = storage.arrow_location(self.run_dir)
        stored = stored_checkpoints(self.run_dir)
        complete = next((saved for saved in stored if self._complete(filesystem, saved.path)),
                        None)
        for old in stored[self.keep:]:
            if old is not complete:
                filesystem.delete_dir(old.path)

    def _complete(self, filesystem: Any, path: str) -> bool:
        """Whether checkpoint `path` holds every file it needs (needed_files: none of the
        replicas of workers missing from its round)."""
        import pyarrow.fs

        names = [entry.base_name for entry in filesystem.get_file_info(
            pyarrow.fs.FileSelector(path))]
        if checkpoint.STATE_FILE not in names:
            return False
        try:
            with filesystem.open_input_stream(posixpath.join(path, checkpoint.STATE_FILE)) as f:
                state = json.loads(f.read())
            needed = checkpoint.needed_files(state)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False  # unreadable: resume skips it too
        return needed <= set(names)


def drop_newer_checkpoints(run_dir: Any, resumed: str) -> None:
    """Delete the run's checkpoints newer than `resumed` (the one a restart resumes from):
    an earlier attempt's, damaged or incomplete, whose files the rounds run again would
    otherwise mix with their own into what looks like a complete checkpoint."""
    filesystem, _ = storage.arrow_location(run_dir)
    name = posixpath.basename(resumed.rstrip("/"))
    for saved in stored_checkpoints(run_dir):
        if posixpath.basename(saved.path) > name:
            filesystem.delete_dir(saved.path)


class EndWatch:
    """While a worker trains: once the run's result is written (by whichever worker), calls
    `exit` if the worker has not ended `grace` seconds later (see the module's docstring)."""

    def __init__(self, run_dir: Any, grace: float = END_GRACE_S, poll: float = END_POLL_S,
                 exit: Callable[[], None] | None = None) -> None:
        self.run_dir, self.grace, self.poll = run_dir, grace, poll
        self.exit = exit or _exit_worker
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> EndWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ended.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._ended.wait(self.poll):
            if read_end(self.run_dir) is not None:
                if not self._ended.wait(self.grace):
                    self.exit()
                return


def _exit_worker() -> None:
    print(f"the run's result is written and this worker has not ended {END_GRACE_S:g} s "
          "later: it exits", file=sys.stderr, flush=True)
    os._exit(0)


def train_replica_worker(cfg: TrainConfig, dataset: Dataset, run_dir: Any, env: WorkerEnv,
                         progress: Any, loopback: bool, timeouts: dict[str, float]) -> None:
    """Ray Train's entry point in `replica` mode, once the WorkerEnv is built: join the
    others (healed by them if they are under way, else resuming from the newest intact
    checkpoint), train over the quorums, and leave the result in ft_end.json (the final
    round's writer, after exporting the model). Returns nothing: the driver reads the file."""
    if read_end(run_dir) is not None:
        return  # a replacement started after the run ended
    import ray

    env = replace(env, report=QuorumReports(run_dir, progress, cfg.run.keep_checkpoints))
    host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
    trainer = seated_trainer(cfg, dataset, env, lighthouse_address(loopback),
                             timeout=timedelta(seconds=timeouts["collective"]),
                             quorum_timeout=timedelta(seconds=timeouts["quorum"]), host=host)
    assert trainer.env.seat is not None
    warning = None
    try:
        with EndWatch(run_dir):
            if trainer.join():  # the run starts here: from storage, if it has a checkpoint
                error, warning = restore_newest(trainer, run_dir)
                if error is not None:  # every worker reaches the same verdict
                    write_end(run_dir, {"error": error, "rounds": 0})
                    return
            summary = trainer.run()
    except TimeoutError:
        # No quorum formed: the others may have finished (a worker replaced during the last
        # round), which leaves nothing to do. Otherwise the run stops here, with a reason:
        # replacing this worker would only wait again (forever with run.max_failures -1).
        if read_end(run_dir) is None:
            write_end(run_dir, {"error": no_quorum_error(trainer, timeouts["quorum"]),
                                "rounds": trainer.round})
        return
    finally:
        trainer.env.seat.shutdown()
    if "error" in summary:
        write_end(run_dir, summary)
        return
    if not trainer.writes_run_files():
        return
    summary.update(workers=cfg.scaling.num_workers, torch_threads=cfg.scaling.torch_threads)
    if warning is not None:
        summary["resume_warning"] = warning
    export_into_summary(summary, trainer.model, dataset, run_dir / run_files.MODEL_DIR)
    write_end(run_dir, summary)


def no_quorum_error(trainer: Trainer, waited: float) -> str:
    """Why a worker that got no quorum for `waited` seconds stops the run: naming the workers
    of the last quorum it was in and the setting that bounds the wait."""
    workers = trainer.cfg.scaling.num_workers
    committed = trainer.runner.committed
    seen = (f"the last quorum it was in, after round {trainer.round}, held workers "
            f"{committed.participants}" if committed is not None
            else "it was never in a quorum")
    return (f"worker {trainer.env.rank} saw no quorum of at least {min_quorum(workers)} of the "
            f"{workers} workers for {waited:g} s (ISOLOCO_RAY_FT_QUORUM_TIMEOUT_S); {seen}. "
            "Fewer workers than that are alive and reach the lighthouse: start the run again "
            "(the same command resumes from its newest checkpoint) when they can")


def restore_newest(trainer: Trainer, run_dir: Any) -> tuple[str | None, str | None]:
    """Restore `trainer` from the run's newest intact checkpoint, if it has one; returns
    (why none can be used, naming the bad files, or None; a warning if damaged newer ones
    were skipped, or None)."""
    with resume.open_resume_point(stored_checkpoints(run_dir)) as start:
        if start.error is not None:
            return start.error, None
        if start.directory is None:
            return None, None
        if start.warning is not None and trainer.env.rank == 0:
            print(start.warning, file=sys.stderr, flush=True)
        try:
            trainer.checkpoints.restore(start.directory)
        except checkpoint.CheckpointError as exc:  # naming the stored files, not copies
            return str(exc).replace(str(start.directory), start.name), None
        if trainer.writes_run_files():
            drop_newer_checkpoints(run_dir, start.name)
            record_restored_round(start.directory, run_dir, trainer.env.report)
        return None, start.warning


def record_restored_round(directory: Path, run_dir: Any, report: Callable[..., None]) -> None:
    """Record the round of the checkpoint a run resumes from if metrics.jsonl lacks it: the
    run was stopped (SIGTERM) after its writer put the round on the driver's queue, before
    the driver wrote it down, while the checkpoint was stored. The record kept in the
    checkpoint is then reported, once, so that every round is in metrics.jsonl."""
    record = checkpoint.saved_record(directory)
    if record is None or record.get("round") in recorded_rounds(run_dir):
        return
    report(record, None, True)


def recorded_rounds(run_dir: Any) -> set[int]:
    """The rounds metrics.jsonl holds (lines that do not parse are left out)."""
    path = run_dir / run_files.METRICS
    if not path.exists():
        return set()
    rounds = set()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("round"), int):
            rounds.add(record["round"])
    return rounds


def write_end(run_dir: Any, result: Metrics) -> None:
    """Leave the run's result (a summary, or {"error": ..., "rounds": ...}) for the driver."""
    strict_json.write(run_dir / run_files.FT_END, result)
