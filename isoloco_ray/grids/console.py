"""What a grid prints: the dry run's plan, and one line per trial round, completion or
failure (Tune's own tables are kept quiet)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from isoloco_ray import run_files
from isoloco_ray.grids.expand import Trial, describe
from isoloco_ray.grids.plan import GridPlan
from isoloco_ray.grids.scheduler import describe_scheduler
from isoloco_ray.grids.search import STARTUP_TRIALS, first_proposals
from isoloco_ray.grids.trainable import trial_name, trial_run_dir
from isoloco_ray.metrics import format_progress
from isoloco_ray.run_records import finite, last_error_line


def print_plan(plan: GridPlan) -> None:
    """One line per trial: what it trains and what the grid set. A search: the space, the
    points searched and each point's first proposals (fixed by the seed)."""
    if plan.search is None:
        print(f"grid {plan.name}: {len(plan.trials)} trials -> {plan.grid_dir}")
    else:
        print(f"grid {plan.name}: a search of {len(plan.trials)} grid point"
              f"{'s' if len(plan.trials) != 1 else ''} x {plan.search.spec.samples} samples = "
              f"{plan.search.count} trials -> {plan.grid_dir}")
        print(f"  search: {plan.search.spec.describe()}, {plan.file.metric.mode} "
              f"{plan.file.metric.name}")
        for path, dimension in plan.search.spec.space.items():
            print(f"    {path}: {dimension.describe()}")
    if plan.file.scheduler is not None:
        print(f"  early stopping: {describe_scheduler(plan.file.scheduler)}")
    if plan.search is None:
        print_trials(plan.trials)
        return
    print("  grid points:")
    print_trials(plan.trials)
    samples = plan.search.spec.samples
    if samples > STARTUP_TRIALS:
        print(f"  first {STARTUP_TRIALS} proposals of each point (random, fixed by the seed; "
              "TPE proposes the rest from the results):")
    else:  # TPE would start after STARTUP_TRIALS results: a seeded random search
        print(f"  the {samples} proposal{'s' if samples != 1 else ''} of each point (random, "
              f"fixed by the seed: TPE starts after {STARTUP_TRIALS}):")
    shown = min(samples, STARTUP_TRIALS)
    print_trials(first_proposals(plan, shown))


def print_trials(trials: list[Trial]) -> None:
    """One line per trial: its layout, length, learning rates and what the grid set."""
    width = max(len(t.name) for t in trials)
    for trial in trials:
        cfg = trial.config
        workers = cfg.scaling.num_workers
        print(f"  {trial.name:<{width}}  R={cfg.scaling.replicas} on {workers} "
              f"{'GPU ' if cfg.scaling.use_gpu else ''}worker{'s' if workers > 1 else ''}, "
              f"{cfg.run.rounds} rounds x H={cfg.inner.steps}, "
              f"{cfg.run.rounds * cfg.tokens_per_round:,} tokens, inner "
              f"{'Muon+AdamW ' if cfg.inner.optimizer == 'muon' else ''}lr {cfg.inner.lr:g}"
              + (f", outer lr {cfg.outer.lr:g}" if cfg.outer.has_outer_step else "")
              + f" | {describe(trial.overrides)}")


def progress_printer() -> Any:
    """A Tune callback printing each trial's rounds, completion and failure on the console
    (Tune's own status tables are turned off)."""
    from ray import tune

    class ProgressPrinter(tune.Callback):
        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                            **info: Any) -> None:
            if "round" in result:
                config = trial.config["trial"]["config"]
                line = format_progress(result, config["run"]["rounds"],
                                       overlapped=config["outer"]["delay"] > 0)
                print(f"{trial_name(trial)}: {line}", flush=True)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any,
                              **info: Any) -> None:
            result = trial.last_result or {}
            if "final_eval_loss" in result:
                loss = finite(result["final_eval_loss"])
                if result.get("status") == "diverged":
                    outcome = f"diverged: {result.get('diverged')}"
                elif loss is None:
                    outcome = "diverged, final eval loss not a finite number"
                else:
                    outcome = f"done, final eval loss {loss:.4f}"
                print(f"{trial_name(trial)}: {outcome}, {result.get('seconds', 0.0):.0f}s",
                      flush=True)
            elif (trial_run_dir(trial) / run_files.STOPPED).is_file():  # the scheduler stopped it
                marker = json.loads((trial_run_dir(trial) / run_files.STOPPED).read_text())
                print(f"{trial_name(trial)}: stopped early at round {marker['round']} "
                      f"({marker['metric']} {_number(marker['value'])})", flush=True)

        def on_trial_error(self, iteration: int, trials: list, trial: Any,
                           **info: Any) -> None:
            error_file = trial_run_dir(trial) / run_files.ERROR
            error = error_file.read_text() if error_file.is_file() else trial.get_error() or ""
            print(f"{trial_name(trial)}: FAILED: {last_error_line(str(error))}", flush=True)

    return ProgressPrinter()


def _number(value: Any) -> str:
    """`5.4321`, or `not a finite number` (null in strict JSON)."""
    number = finite(value)
    return "not a finite number" if number is None else f"{number:.4f}"


@contextlib.contextmanager
def quiet_tune() -> Iterator[None]:
    """Keep Tune's status tables and failure tracebacks off the console: the progress
    printer says what happens, in one line per round, and error.txt keeps the traceback."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the legacy reporter obeys verbose=0
    loggers = [logging.getLogger(name) for name in ("ray.tune.execution.tune_controller",
                                                    "ray.tune.tune")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
