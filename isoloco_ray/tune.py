"""`python -m isoloco_ray.tune GRID.yaml [--section.field=value ...]`: a grid of runs on Ray Tune.

Every trial of the grid file (isoloco_ray.grids) is validated, with its data, before Ray starts.
Then a Tune function trainable builds one TorchTrainer per trial (the Ray Train V2 pattern:
`Tuner(trainer)` no longer works), its per-round metrics flow to Tune through
`TuneReportCallback`, trials run at once as far as the cluster fits them, and a failed trial
is recorded without stopping the others. With a `scheduler:` (grids.spec.SchedulerSpec)
Tune's ASHA or median stopping rule ends trials that fall behind, on the rounds that report
its metric (make_scheduler). With a `search:` (grids.spec.SearchSpec) each trial is a
point that one seeded Optuna searcher per point varies `samples` times (make_searcher), each
proposal added to grid.json as it is made. At the end (and after `--resume` of an
interrupted grid) the results table, eval-loss plot and best config are written
(isoloco_ray.report).

Layout of a grid directory (`<run.storage_path>/<grid name>/`): `grid.json` (the trials),
`runs/<trial>/` (each trial's training run, as the train CLI writes it), `tune/` (Tune's
experiment; each `--resume` gets a fresh one, `tune-resume-<n>/`), `results.md`,
`results.csv`, `eval_loss.png`, `best_config.yaml`.

`--resume` never reads Tune's state: grid directories live on shared storage, and Tune's
state is pickled (`tuner.pkl`, pickles inside `experiment_state-*.json`, searcher state), so a
tampered file would run code. The grid's own JSON decides instead: `grid.json` must match the
command line, and a trial whose run directory holds `summary.json` (finished), `error.txt`
(failed) or `stopped.json` (stopped early by the grid's `scheduler:`) is kept; the others
run in a fresh Tuner under their old names, so Ray Train finds their run directories and
continues from their last checkpoint (Ray Train reads `checkpoint_manager_snapshot.json`,
JSON; the checkpoints load with `torch.load(weights_only=True)`). A search resumes likewise
(search_state): fresh searchers are told the outcome of the trials over from their run files,
and propose the samples left.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from isoloco_ray import run_files, strict_json
from isoloco_ray.config import ConfigError
from isoloco_ray.data.format import DataError
from isoloco_ray.grids.cluster import start_cluster
from isoloco_ray.grids.console import print_plan, progress_printer, quiet_tune
from isoloco_ray.grids.plan import PROG, GridPlan, plan_grid
from isoloco_ray.grids.resume import TUNE_DIR, new_experiment_name, read_manifest, unfinished_trials
from isoloco_ray.grids.scheduler import describe_scheduler, make_scheduler
from isoloco_ray.grids.search import SearchState, make_searcher, search_of, search_state
from isoloco_ray.grids.trainable import run_trial, trial_name, trial_space
from isoloco_ray.report import print_report, write_report
from isoloco_ray.env_settings import read_env
from isoloco_ray.run_records import ReportError, RunRecord
from isoloco_ray.storage import check_could_write, check_writable


def run_grid(plan: GridPlan, max_concurrent: int | None, resume: bool) -> int:
    """Run (or resume) the grid with Ray Tune, then write and print the report.

    A resume runs only the unfinished trials (unfinished_trials; a search: search_state), in
    a fresh Tune experiment. Returns 0 when every trial finished or was stopped early by the
    scheduler, 1 when any failed, diverged or did not finish, 2 when the grid directory does
    not match the request."""
    manifest_path = plan.grid_dir / run_files.GRID
    todo = plan.trials
    state = None
    try:
        if resume:
            manifest = read_manifest(plan)
            if max_concurrent is not None and max_concurrent != manifest.get("max_concurrent"):
                print("note: --resume keeps the concurrency the grid started with "
                      f"({manifest.get('max_concurrent') or 'as many as fit'})",
                      file=sys.stderr)
            max_concurrent = manifest.get("max_concurrent")
            todo = unfinished_trials(plan.trials)
        elif manifest_path.exists() or (plan.grid_dir / TUNE_DIR).exists():
            raise ConfigError(f"{plan.grid_dir} already holds a grid; continue it with --resume "
                              "or choose another --name")
        else:
            manifest = plan.manifest(max_concurrent)
        if plan.search is not None:
            state = search_state(plan, manifest["trials"])
        check_writable(plan.grid_dir.parent)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    count = len(todo) if state is None else len(state.rerun) + len(state.todo)
    if count:
        run_trials(plan if state is not None else dataclasses.replace(plan, trials=todo),
                   max_concurrent, resume, manifest, state)
    else:
        print(f"grid {plan.name}: every trial has finished, failed or been stopped early; "
              "nothing to resume", flush=True)

    try:
        report, written = write_report(plan.grid_dir)
    except ReportError as exc:  # the trials are kept: only the report was not written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(report, written)
    return grid_status(report.runs)


def run_trials(plan: GridPlan, max_concurrent: int | None, resume: bool,
               manifest: dict[str, Any], state: SearchState | None = None) -> None:
    """Run `plan.trials` (a search: what `state` leaves to run) in a fresh Tune experiment
    of the grid directory; the first run writes grid.json (`manifest`) too."""
    from ray import tune

    from isoloco_ray.wandb_log import export_wandb_mode, tune_wandb_callback

    count = len(plan.trials) if state is None else len(state.rerun) + len(state.todo)
    concurrency = start_cluster(plan, max_concurrent, count)
    plan.grid_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        strict_json.write(plan.grid_dir / run_files.GRID, manifest, indent=2)
    experiment = new_experiment_name(plan.grid_dir)
    print(f"grid {plan.name}: {'resuming ' if resume else ''}{count} trial"
          f"{'s' if count != 1 else ''}, up to {concurrency} at once, in {plan.grid_dir}"
          + (f" (Tune: {experiment}/)" if resume else ""), flush=True)

    trainable = tune.with_resources(run_trial, {"CPU": plan.file.resources.trial_cpus})
    scheduler = None
    if plan.file.scheduler is not None:
        scheduler = make_scheduler(plan.file.scheduler, plan.max_rounds)
        print(f"early stopping: {describe_scheduler(plan.file.scheduler)}", flush=True)
    searcher = None
    param_space: dict[str, Any] = {"trial": tune.grid_search([trial_space(t)
                                                              for t in plan.trials])}
    if state is not None:
        searcher = make_searcher(plan, state, manifest)
        param_space = {}
        print(f"search: {search_of(plan).spec.describe()}"
              + (f", {state.proposed} trials proposed before" if state.proposed else ""),
              flush=True)
    export_wandb_mode(plan.trials[0].config.run.wandb)
    callbacks = [progress_printer()]
    wandb_callback = tune_wandb_callback(plan.trials[0].config.run.wandb, plan.name)
    if wandb_callback is not None:
        callbacks.append(wandb_callback)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(max_concurrent_trials=concurrency, scheduler=scheduler,
                                    search_alg=searcher,
                                    num_samples=1 if state is None else count,
                                    # A stopped trial's actor must end (its TorchTrainer's
                                    # controller and workers with it), not wait for reuse.
                                    reuse_actors=False,
                                    trial_name_creator=trial_name,
                                    trial_dirname_creator=trial_name),
        run_config=tune.RunConfig(name=experiment, storage_path=str(plan.grid_dir),
                                  callbacks=callbacks, verbose=0))
    with quiet_tune():
        tuner.fit()  # a failed trial is recorded in its result, not raised


def grid_status(runs: list[RunRecord]) -> int:
    """Print what did not finish; 0 when every trial is done or was stopped early by the
    scheduler (its verdict, not a failure), else 1."""
    counts: dict[str, int] = {}
    for run in runs:
        if run.status not in ("done", "stopped"):
            counts[run.status] = counts.get(run.status, 0) + 1
    stopped = sum(run.status == "stopped" for run in runs)
    if stopped:
        print(f"{stopped} of {len(runs)} trials were stopped early by the scheduler "
              f"({run_files.STOPPED} in their run directories)")
    if not counts:
        return 0
    print(f"{sum(counts.values())} of {len(runs)} trials are not done: "
          + ", ".join(f"{n} {status}" for status, n in counts.items())
          + ("; rerun with --resume to continue the unfinished ones"
             if counts.keys() & {"incomplete", "pending"} else ""))
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The tune CLI's own options; everything else is a --section.field=value override."""
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Run a grid of trainings (tune_configs/*.yaml) with Ray Tune, then write "
                    "a results table, an eval-loss plot and the best trial's config.",
        epilog="Any --section.field=value option of `python -m isoloco_ray.train --help` "
               "changes the base config of every trial (not a field the grid varies).")
    parser.add_argument("config", nargs="?", type=Path, metavar="GRID.yaml",
                        help="grid file: base:, grid:, trials:, metric:, resources:, "
                             "scheduler:, search:")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate and print the expanded trials, then exit; missing data "
                             "and unset $VARS in paths are warnings here (check a grid away "
                             "from its cluster)")
    parser.add_argument("--max-concurrent", type=int, metavar="N",
                        help="trials at once (default: resources.max_concurrent, else as many "
                             "as the cluster fits)")
    parser.add_argument("--resume", action="store_true",
                        help="continue an interrupted grid: unfinished trials run again (from "
                             "their last checkpoint), finished and failed ones are kept")
    parser.add_argument("--name", help="grid name, its directory under run.storage_path "
                                       "(default: the file's name: field, else its file name)")
    parser.add_argument("--from-wandb-sweep", type=Path, metavar="SWEEP.yaml",
                        help="print a grid file converted from a W&B sweep file, and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for configuration errors)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.from_wandb_sweep is not None:
        from isoloco_ray.sweep_convert import convert_main

        return convert_main(args.from_wandb_sweep)
    if args.config is None:
        parser.error("a grid file is required (e.g. tune_configs/demo_strategies.yaml)")
    if args.max_concurrent is not None and args.max_concurrent < 1:
        parser.error("--max-concurrent must be at least 1")
    try:
        read_env()  # every variable checked before anything starts
        plan = plan_grid(args.config, rest, args.name, dry_run=args.dry_run)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.dry_run:
        try:
            check_could_write(plan.grid_dir.parent)  # what the run checks, writing nothing
            print_plan(plan)
        except ConfigError as exc:  # a search's first proposal is not a valid config
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    max_concurrent = args.max_concurrent or plan.file.resources.max_concurrent
    try:
        return run_grid(plan, max_concurrent, args.resume)
    except ConfigError as exc:  # the cluster cannot hold a trial (train.start_ray)
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
