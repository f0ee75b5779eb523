"""Run the worker loop without Ray: in this process, or in W local processes joined by gloo.

The same `Trainer` Ray Train runs, fed by pyarrow instead of Ray Data. Tests use it to check the
math (layouts, outer steps, exact resume) in seconds; benchmarks use it as the Ray-free
reference. Inside `keep_processes()` the W processes are spawned once and serve every group
of that size (a spawn costs seconds: torch and transformers are imported again).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from isoloco_ray import storage
from isoloco_ray.config import TrainConfig
from isoloco_ray.data.stream import read_with_pyarrow
from isoloco_ray.workers.loop import Trainer
from isoloco_ray.workers.rounds.round_metrics import Metrics
from isoloco_ray.workers.worker_env import WorkerEnv


class StopAfterRound(Exception):
    """Raised by a local run's report after `stop_after` rounds: a simulated interruption."""


def local_env(rank: int = 0, world: int = 1,
              reports: list[Metrics] | None = None, checkpoints: Path | None = None,
              restore_from: Path | None = None, stop_after: int | None = None,
              device: torch.device | str = "cpu") -> WorkerEnv:
    """A WorkerEnv reading local shards with pyarrow.

    Reports are appended to `reports`; checkpoints are copied to `checkpoints/round_NNNNNN`
    (every rank's files into one directory, as Ray Train does); `stop_after` interrupts the
    run right after that round's report. `device`: where the model runs (one worker).
    """

    def report(metrics: Metrics, checkpoint_dir: Path | None, writer: bool) -> None:
        if reports is not None:
            reports.append(metrics)
        if checkpoint_dir is not None and checkpoints is not None:
            shutil.copytree(checkpoint_dir, checkpoints / f"round_{metrics['round']:06d}",
                            dirs_exist_ok=True)
        if stop_after is not None and metrics["round"] == stop_after:
            raise StopAfterRound(stop_after)

    return WorkerEnv(
        rank=rank, world=world, device=torch.device(device),
        read_rows=read_with_pyarrow,
        report=report, restore_from=restore_from,
        checkpoint_room=(None if checkpoints is None else
                         lambda needed: storage.checkpoint_room(checkpoints, needed)),
    )


# A rank waits this long for the others to join its group (gloo's default: 30 minutes).
GROUP_JOIN_TIMEOUT = datetime.timedelta(minutes=5)


def _run_in_group(rank: int, world: int, scratch: str, threads: int, fn: Callable[..., Any],
                  args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank,
                            world_size=world, timeout=GROUP_JOIN_TIMEOUT)
    try:
        torch.save(fn(rank, world, *args), f"{scratch}/result_{rank}.pt")
    finally:
        dist.destroy_process_group()


# After a rank's failure, how long the other ranks' own reports are waited for.
FAILED_GROUP_WAIT = 10.0


class GroupFailed(RuntimeError):
    """A rank of a kept process group raised or died; the message holds its traceback."""


def _serve_ranks(conn: multiprocessing.connection.Connection) -> None:
    """A kept process: runs one rank of each group it is sent, in the sender's environment and
    directory of the moment (as a process spawned for it would), until sent None. (torch's
    global generator is seeded at random in every process: nothing relies on it.)"""
    while (task := conn.recv()) is not None:
        environ, cwd, rank, world, scratch, threads, fn, args = task
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        try:
            _run_in_group(rank, world, scratch, threads, fn, args)
            conn.send(None)
        except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
            conn.send(traceback.format_exc())


class _KeptRanks:
    """`world` spawned processes serving one gloo group after another (`keep_processes`)."""

    def __init__(self, world: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.connections: list[multiprocessing.connection.Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for _ in range(world):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve_ranks, args=(theirs,))
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)

    def run(self, scratch: str, threads: int, fn: Callable[..., Any], args: tuple[Any, ...]
            ) -> None:
        """Every rank of one group. GroupFailed with the traceback of every rank that failed
        (the others' collectives fail within moments of a rank's error: each is waited for
        up to FAILED_GROUP_WAIT seconds, so the cause is among them, whichever came first)."""
        world = len(self.connections)
        for rank, conn in enumerate(self.connections):
            conn.send((dict(os.environ), os.getcwd(), rank, world, scratch, threads, fn, args))
        pending = dict(enumerate(self.connections))
        failures: dict[int, str] = {}
        while pending:
            ready = multiprocessing.connection.wait(
                list(pending.values()), timeout=FAILED_GROUP_WAIT if failures else None)
            if not ready:
                break
            for done in ready:
                rank = self.connections.index(done)  # type: ignore[arg-type]  # one of them
                try:
                    failure = self.connections[rank].recv()
                except EOFError:
                    failure = f"the process died (exit code {self.processes[rank].exitcode})"
                if failure is not None:
                    failures[rank] = failure
                del pending[rank]
        if failures:
            raise GroupFailed("\n".join(f"rank {rank} of {world} failed:\n{failures[rank]}"
                                        for rank in sorted(failures)))

    def close(self, wait: bool = True) -> None:
        """Stops the processes: once their groups are done (`wait`), or at once."""
        for conn in self.connections if wait else ():
            with contextlib.suppress(OSError):
                conn.send(None)
        for process in self.processes:
            process.join(timeout=10 if wait else 0)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.connections:
            conn.close()


_kept: dict[int, _KeptRanks] | None = None  # world size -> its processes, in keep_processes()


@contextlib.contextmanager
def keep_processes() -> Iterator[None]:
    """Within it, `in_gloo_group` spawns the processes of each world size once and reuses them
    (a group that fails has its processes replaced); they are stopped on exit."""
    global _kept
    outer, _kept = _kept, ({} if _kept is None else _kept)
    try:
        yield
    finally:
        if outer is None:
            for ranks in _kept.values():
                ranks.close()
            _kept = None


def in_gloo_group(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1
                  ) -> list[Any]:
    """fn(rank, world, *args) on `world` spawned processes joined in one gloo group, each with
    `threads` intra-op threads; every rank's return value (tensors and plain values), in rank
    order. `fn` must be a module-level function (spawn pickles it by name)."""
    with tempfile.TemporaryDirectory() as scratch:
        if _kept is None:
            mp.start_processes(_run_in_group, nprocs=world, start_method="spawn", join=True,
                               args=(world, scratch, threads, fn, args))
        else:
            if world not in _kept:
                _kept[world] = _KeptRanks(world)
            try:
                _kept[world].run(scratch, threads, fn, args)
            except BaseException:  # a failed or interrupted group: its processes are not reused
                _kept.pop(world).close(wait=False)
                raise
        # Written just now by our own processes into a private temporary directory.
        return [torch.load(Path(scratch, f"result_{rank}.pt"), weights_only=False)
                for rank in range(world)]


def _train_rank(rank: int, world: int, config: dict[str, Any], data_dir: str,
                restore_from: str | None, checkpoints: str | None
                ) -> tuple[Metrics, dict[str, torch.Tensor]] | None:
    """One gloo rank of `run_local`: rank 0's summary and final global parameters."""
    cfg = TrainConfig.model_validate(config)
    trainer = Trainer(cfg, Path(data_dir), local_env(
        rank, world, restore_from=None if restore_from is None else Path(restore_from),
        checkpoints=None if checkpoints is None else Path(checkpoints)))
    summary = trainer.run()
    return (summary, trainer.global_params) if rank == 0 else None


def run_local(cfg: TrainConfig, data_dir: Path, threads_per_worker: int = 1,
              workers: int | None = None, **env_options: Any
              ) -> tuple[Metrics, dict[str, torch.Tensor]]:
    """Train `cfg` on `workers` (default cfg.scaling.num_workers) local processes (gloo); rank
    0's summary and final global parameters. With one worker everything runs in this process
    and `env_options` go to `local_env` (checkpoints, restore_from, stop_after, reports); with
    several, only checkpoints and restore_from. Each worker uses `threads_per_worker` intra-op
    threads (float sums depend on the thread count)."""
    world = workers or cfg.scaling.num_workers
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_worker)
        try:
            trainer = Trainer(cfg, data_dir, local_env(**env_options))
            return trainer.run(), trainer.global_params
        finally:
            torch.set_num_threads(threads)
    paths = {key: None if env_options.get(key) is None else str(env_options[key])
             for key in ("restore_from", "checkpoints")}
    others = sorted(set(env_options) - set(paths))
    if others:
        raise ValueError(f"{others} are supported with one worker only")
    results = in_gloo_group(_train_rank, world, cfg.model_dump(mode="json"), str(data_dir),
                            paths["restore_from"], paths["checkpoints"],
                            threads=threads_per_worker)
    return results[0]
