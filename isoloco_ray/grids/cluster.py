"""The Ray cluster a grid runs on, and how many trials it fits at once."""

from __future__ import annotations

import math
import os
import sys

from isoloco_ray.config import TrainConfig
from isoloco_ray.gpu_memory import GpuMemory
from isoloco_ray.grids.plan import GridPlan

# Logical CPUs a trial needs beyond its driver and workers: Ray Data's read tasks.
DATA_CPUS = 1.0


def trial_needs(cfg: TrainConfig, trial_cpus: float) -> dict[str, float]:
    """Logical resources one trial holds while it trains: its driver, its workers, data."""
    workers = cfg.scaling.num_workers
    return {"CPU": trial_cpus + workers * cfg.scaling.worker_cpus + DATA_CPUS,
            "GPU": float(workers) if cfg.scaling.use_gpu else 0.0}


def largest_gpu_memory(plan: GridPlan) -> GpuMemory | None:
    """The bytes per GPU worker of the grid's hungriest GPU trial (most state, then highest
    estimated peak), which start_ray checks against the GPUs; None without GPU trials."""
    from isoloco_ray.data.format import Dataset
    from isoloco_ray.train import gpu_memory_of

    datasets: dict[str, Dataset] = {}
    memories = []
    for trial in plan.trials:
        if trial.config.scaling.use_gpu and trial.data_dir is not None:
            key = str(trial.data_dir)
            if key not in datasets:
                datasets[key] = Dataset.open(trial.data_dir)
            memories.append(gpu_memory_of(trial.config, datasets[key]))
    return max(memories, key=lambda m: (m.state_bytes, m.peak_bytes), default=None)


def start_cluster(plan: GridPlan, requested: int | None, count: int | None = None) -> int:
    """Join or start Ray and choose how many trials run at once.

    A local cluster gets enough logical CPUs for the trials asked for (Tune's trial drivers
    and Ray Data need slots besides the workers); the concurrency is capped by what the
    cluster fits, because a trial whose driver holds a CPU its workers need would wait."""
    import ray

    from isoloco_ray.train import start_ray

    need: dict[str, float] = {}
    for trial in plan.trials:
        for key, value in trial_needs(trial.config, plan.file.resources.trial_cpus).items():
            need[key] = max(need.get(key, 0.0), value)
    cfg = plan.trials[0].config
    local = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if local and cfg.run.num_cpus is None:
        cores = os.cpu_count() or 1
        num_cpus = max(4, 2 * cores, math.ceil((requested or 1) * need["CPU"]))
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"num_cpus": num_cpus})})
    # With the dashboard (on 127.0.0.1): Ray Train's PlacementGroupCleaner asks the state API,
    # which the dashboard serves, whether a trial's TrainController is alive. Without it, the
    # workers' placement group of a trial that Tune stopped (a scheduler's verdict, a failed
    # trial) is never removed, and the next trial waits for those CPUs forever.
    start_ray(cfg, dashboard=True, memory=largest_gpu_memory(plan))
    available = ray.cluster_resources()
    fits = min(int(available.get(key, 0.0) // value) for key, value in need.items() if value)
    if requested is not None:
        if requested > fits:
            print(f"warning: --max-concurrent {requested} is more trials than the cluster fits "
                  f"now ({fits}; each needs {_format_needs(need)}): a trial beyond that holds "
                  "its driver's CPU while it waits for workers, which can stall the grid",
                  file=sys.stderr)
        return requested
    if fits < 1:
        print(f"warning: a trial needs {_format_needs(need)} but the cluster has "
              f"{_format_needs(available)} now; trials wait until it grows", file=sys.stderr)
    return max(1, min(fits, len(plan.trials) if count is None else count))


def _format_needs(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(key, 0.0):g} {key}" for key in ("CPU", "GPU")
                     if key == "CPU" or resources.get(key))
