"""What runs inside Ray for a trial: the Tune function trainable (one TorchTrainer per
trial) and how a Tune trial names its run."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

from isoloco_ray import run_files, strict_json
from isoloco_ray.config import TrainConfig
from isoloco_ray.grids.expand import Trial
from isoloco_ray.own_files import replace_file
from isoloco_ray.storage import hold_run, location, run_directory


def run_trial(params: dict[str, Any]) -> dict[str, Any]:
    """The Tune function trainable: one trial's TorchTrainer, reporting every round to Tune.

    Returns the run's summary (Tune's last result). A trial whose run already finished (the
    grid was interrupted right after) returns that run's summary without training again.
    The traceback of a failure is kept in the run's error.txt for the report. The run's
    directory is held while the trial runs (storage.hold_run)."""
    trial = params["trial"]
    cfg = TrainConfig.model_validate(trial["config"])
    data_dir = location(trial["data_dir"], "data.path")
    run_dir = run_directory(cfg.run.storage_path, cfg.run.name)
    with hold_run(run_dir):
        return _run_trial_held(cfg, data_dir, run_dir)


def _run_trial_held(cfg: TrainConfig, data_dir: Any, run_dir: Any) -> dict[str, Any]:
    """`run_trial` once its run directory is held."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from isoloco_ray.driver import check_run_dir, run_once, saved_config

    if (run_dir / run_files.SUMMARY).is_file():
        return strict_json.finite_or_none(json.loads((run_dir / run_files.SUMMARY).read_text()))
    (run_dir / run_files.ERROR).unlink(missing_ok=True)
    try:
        check_run_dir(cfg, run_dir, saved_config(run_dir))
        summary = run_once(cfg, data_dir, run_dir, started=time.perf_counter(),
                           callbacks=[TuneReportCallback()],
                           after_fit=wait_for_tune_to_take_reports)
    except Exception:
        replace_file(run_dir / run_files.ERROR, traceback.format_exc())
        raise
    # summary.json is strict JSON (a NaN eval loss is null: the report says "diverged");
    # so is what Tune records.
    return strict_json.finite_or_none(summary)


def wait_for_tune_to_take_reports(settle_seconds: float = 0.5, limit_seconds: float = 60) -> None:
    """Return once the trial's Tune session has taken every report Ray Train sent it.

    TuneReportCallback hands each round's report from Train's controller to this trial's
    actor through a one-slot queue, which the actor's main thread moves into the session's
    one-slot result queue. A trial function that returns while the last report is still in
    the first queue makes Tune put its "function returned" marker in the result queue first,
    and the main thread then blocks for ever putting the report behind it (Ray 2.60: a grid
    hung once in a few dozen trials on a loaded machine). Both queues must stay empty for
    `settle_seconds` (the main thread takes an item from one and puts it in the other at
    once); after `limit_seconds` the function returns regardless."""
    from ray.train._internal.session import get_session

    session = get_session()
    reports = getattr(session, "_inter_actor_queue", None)
    results = getattr(session, "result_queue", None)
    if reports is None or results is None:
        return
    deadline = time.monotonic() + limit_seconds
    empty_since = None
    while time.monotonic() < deadline:
        if reports.empty() and results.empty():
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since >= settle_seconds:
                return
        else:
            empty_since = None
        time.sleep(0.05)


def trial_name(trial: Any) -> str:
    """Tune's name and directory of a trial: the grid's stable trial name."""
    return trial.config["trial"]["name"]


def trial_run_dir(trial: Any) -> Path:
    """The run directory of a Tune trial (its config's run.storage_path / run.name)."""
    run = trial.config["trial"]["config"]["run"]
    return run_directory(run["storage_path"], run["name"])


def trial_space(trial: Trial) -> dict[str, Any]:
    """What run_trial receives of a trial (Tune's config["trial"])."""
    return {"name": trial.name, "overrides": trial.overrides, "data_dir": str(trial.data_dir),
            "config": trial.config.model_dump(mode="json")}
