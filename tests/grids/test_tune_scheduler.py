"""Early stopping in grids: the `scheduler:` key, the wrapped Tune schedulers, stopped.json,
reports and --resume of stopped trials, one real grid with ASHA."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import TUNE_CONFIGS, started_grid, strict_json, write_grid
from isoloco_ray import tune
from isoloco_ray.grids.expand import build_trials, check_scheduler
from isoloco_ray.grids.spec import SchedulerSpec, load_grid_file

CONTINUE, STOP = "CONTINUE", "STOP"


# ---------------------------------------------------------------------------------------------
# Settings: refused with the field and the fix, before Ray starts


@pytest.mark.parametrize("scheduler, message", [
    ({"name": "hyperband"}, "scheduler.name: unknown scheduler 'hyperband'; use one of asha: "
                            "asynchronous successive halving"),
    ({"name": "asha", "metric": "final_eval_loss"},
     "scheduler.metric: 'final_eval_loss' is not reported every round, so a scheduler cannot "
     "judge running trials by it; use one of eval_loss, eval_perplexity, loss"),
    ({"name": "median", "grace_rounds": 0},
     "scheduler.grace_rounds: must be a whole number >= 1 (got 0)"),
    ({"name": "asha", "grace_rounds": math.inf},
     "scheduler.grace_rounds: must be a finite number (got inf)"),
    ({"name": "asha", "reduction_factor": 1},
     "scheduler.reduction_factor: must be a finite number above 1 (got 1.0); 3 keeps the best "
     "third"),
    ({"name": "asha", "reduction_factor": math.nan},
     "scheduler.reduction_factor: must be a finite number above 1 (got nan)"),
    ({"name": "median", "reduction_factor": 2},
     "scheduler.reduction_factor applies to name: asha only; remove it or set name: asha"),
    ({"name": "asha", "min_trials": 2},
     "scheduler.min_trials applies to name: median only"),
    ({"name": "asha", "grace_rounds": 2},
     "scheduler.grace_rounds (2) must be below run.rounds (2, the longest trial): no trial "
     "could be stopped; lower grace_rounds or remove scheduler:"),
    ({"name": "asha", "grace_rounds": 1, "eval_every": 2},  # eval_every: the base's run.
     "scheduler.metric: eval_loss is reported every run.eval_every (2) rounds, and in no trial "
     "on a round from scheduler.grace_rounds (1) to before its last round, where a trial can be "
     "stopped: lower run.eval_every or grace_rounds, or use metric: loss"),
])
def test_bad_scheduler_settings_exit_2_before_ray(tmp_path, small_dataset, capsys, no_ray,
                                                  scheduler, message):
    scheduler = dict(scheduler)
    eval_every = scheduler.pop("eval_every", 1)
    path = write_grid(tmp_path, small_dataset, scheduler=scheduler)
    assert tune.main([str(path), f"--run.eval_every={eval_every}"]) == 2
    err = capsys.readouterr().err
    # (the first check of a dataset in a session prints "verifying ..." before)
    assert f"error: {message}" in err or ("\nerror: " in f"\n{err}" and message in err)
    assert "Traceback" not in err
    assert not (tmp_path / "grids").exists()


def test_dry_run_shows_the_scheduler_and_grid_json_records_it(tmp_path, small_dataset, capsys,
                                                              no_ray):
    scheduler = {"name": "asha", "grace_rounds": 1, "reduction_factor": 2}
    path = write_grid(tmp_path, small_dataset, scheduler=scheduler)
    assert tune.main([str(path), "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "  early stopping: asha on eval_loss (lower is better), judged on the rounds that "
        "report it, after 1 grace round, reduction factor 2")
    manifest = tune.plan_grid(path, []).manifest(None)
    assert manifest["scheduler"] == {"name": "asha", "metric": "eval_loss", "grace_rounds": 1,
                                     "reduction_factor": 2.0, "min_trials": 3}


def test_shipped_asha_grid_is_valid(tmp_path):
    grid = load_grid_file(TUNE_CONFIGS / "demo_outer_lr_asha.yaml")
    trials = build_trials(grid, {}, tmp_path)
    check_scheduler(grid.scheduler, trials)
    assert grid.scheduler == SchedulerSpec(name="asha", grace_rounds=2, reduction_factor=3)
    assert [t.config.outer.lr for t in trials] == [0.7, 1.0, 0.05, 1.4, 0.2, 0.5]
    assert {t.config.run.eval_every for t in trials} == {1}


# ---------------------------------------------------------------------------------------------
# The wrapped scheduler, driven without Ray


class FakeTrial:
    """What the schedulers read of a Tune trial."""

    def __init__(self, name: str, run_root: Path, rounds: int):
        self.trial_id = name
        self.status = "RUNNING"
        self.config = {"trial": {"name": name, "config": {
            "run": {"storage_path": str(run_root), "name": name, "rounds": rounds}}}}


class FakeController:
    def __init__(self, trials: list[FakeTrial]):
        self.trials = trials

    def get_live_trials(self) -> list[FakeTrial]:
        return self.trials


def feed(scheduler: Any, controller: FakeController, trial: FakeTrial,
         losses: dict[int, float], eval_every: int = 1) -> list[str]:
    """Report rounds 0..max(losses) as a trial does (eval_loss on eval rounds only, loss from
    round 1); the decisions, one per round."""
    decisions = []
    for rnd in range(max(losses) + 1):
        result: dict[str, Any] = {"round": rnd, "tokens": 100 * rnd,
                                  # what Tune adds: left out of stopped.json but the pid
                                  "pid": 4242, "training_iteration": rnd + 1,
                                  "trial_id": trial.trial_id, "time_total_s": 1.0 * rnd,
                                  "config/trial/name": trial.trial_id}
        if rnd:
            result["loss"] = losses[rnd]
        if rnd % eval_every == 0 or rnd == max(losses):
            result["eval_loss"] = losses[rnd]
        decisions.append(scheduler.on_trial_result(controller, trial, result))
        if decisions[-1] == STOP:
            break
    return decisions


@pytest.mark.parametrize("name", ["asha", "median"])
def test_scheduler_stops_a_worse_trial_and_writes_stopped_json(tmp_path, name):
    extra = {"reduction_factor": 2} if name == "asha" else {"min_trials": 1}
    spec = SchedulerSpec(name=name, grace_rounds=1, **extra)
    scheduler = tune.make_scheduler(spec, max_rounds=4)
    good, bad, nan = (FakeTrial(n, tmp_path, 4) for n in ("good", "bad", "nan"))
    controller = FakeController([good, bad, nan])
    for trial in (good, bad, nan):
        scheduler.on_trial_add(controller, trial)

    # Every round of the good trial, the last one too: a trial is never stopped there (ASHA
    # itself stops at max_t), and Tune's final result (the summary, no round) is ignored.
    assert feed(scheduler, controller, good, {r: 6.0 - r for r in range(5)}) == [CONTINUE] * 5
    assert scheduler.on_trial_result(controller, good, {"final_eval_loss": 2.0}) == CONTINUE
    scheduler.on_trial_complete(controller, good, {"final_eval_loss": 2.0})
    assert not (tmp_path / "good" / "stopped.json").exists()

    # Evaluated every 2 rounds: round 1 is not judged (no eval_loss), round 2 is.
    assert feed(scheduler, controller, bad, {r: 6.0 for r in range(5)}, eval_every=2) == [
        CONTINUE, CONTINUE, STOP]
    marker = strict_json(tmp_path / "bad" / "stopped.json")
    assert marker["round"] == 2 and marker["value"] == 6.0 and marker["scheduler"] == name
    assert marker["metric"] == "eval_loss" and marker["trial_pid"] == 4242
    assert marker["metrics"] == {"round": 2, "tokens": 200, "loss": 6.0, "eval_loss": 6.0}
    assert marker["reason"].startswith(f"stopped early by {name} on eval_loss")

    # A diverging trial (NaN eval loss) counts as the worst, and its marker stays strict JSON.
    decisions = feed(scheduler, controller, nan, {0: 6.0, 1: math.nan, 2: math.nan})
    assert decisions == [CONTINUE, STOP]
    assert strict_json(tmp_path / "nan" / "stopped.json")["value"] is None


def test_median_waits_for_min_trials_instead_of_pausing(tmp_path):
    scheduler = tune.make_scheduler(SchedulerSpec(name="median", grace_rounds=1), 4)
    first, second = FakeTrial("a", tmp_path, 4), FakeTrial("b", tmp_path, 4)
    pending = FakeTrial("c", tmp_path, 4)
    pending.status = "PENDING"  # Tune's rule would PAUSE `second` to let it run
    controller = FakeController([first, second, pending])
    feed(scheduler, controller, first, {r: 5.0 for r in range(5)})
    assert feed(scheduler, controller, second, {r: 9.0 for r in range(5)}) == [CONTINUE] * 5
    assert not list(tmp_path.glob("*/stopped.json"))


# ---------------------------------------------------------------------------------------------
# A stopped trial in the report and on --resume (from the run files, no Ray)


def stop_trial(run_dir: Path, rnd: int, loss: float) -> None:
    """What a stopped trial leaves: its rounds so far and stopped.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"round": r, "tokens": 768 * r, "eval_loss": loss}) + "\n"
        for r in range(rnd + 1)))
    (run_dir / "stopped.json").write_text(json.dumps(
        {"round": rnd, "scheduler": "asha", "metric": "eval_loss", "value": loss,
         "reason": "stopped early by asha on eval_loss", "metrics": {"round": rnd}}))


def test_resume_keeps_stopped_trials_stopped(tmp_path, small_dataset, capsys, no_ray):
    path, grid_dir = started_grid(tmp_path, small_dataset, ["diloco", "isoc", "diloco_sgd"])
    plan = tune.plan_grid(path, [])
    stopped = plan.trials[2].run_dir
    assert [t.name for t in tune.unfinished_trials(plan.trials)] == ["2-diloco_sgd"]
    stop_trial(stopped, 1, 5.9)
    # A Train run torn down under its trial may leave error.txt: still stopped, not failed.
    (stopped / "error.txt").write_text("ray.exceptions.ActorDiedError: the actor died\n")
    assert tune.unfinished_trials(plan.trials) == []

    assert tune.main([str(path), "--resume"]) == 1  # 1-isoc failed; the stop is no failure
    out = capsys.readouterr().out
    assert "every trial has finished, failed or been stopped early; nothing to resume" in out
    assert "1 of 3 trials were stopped early by the scheduler" in out
    assert "1 of 3 trials are not done: 1 failed" in out
    rows = {row["trial"]: row for row in csv.DictReader((grid_dir / "results.csv").open())}
    assert {name: row["status"] for name, row in rows.items()} == {
        "0-diloco": "done", "1-isoc": "failed", "2-diloco_sgd": "stopped"}
    assert float(rows["2-diloco_sgd"]["final eval loss"]) == 5.9  # its latest eval
    results = (grid_dir / "results.md").read_text()
    assert ("## Stopped early\n\n- `2-diloco_sgd`: round 1, eval_loss 5.9000: stopped early by "
            "asha on eval_loss") in results
    assert "2-diloco_sgd" not in results.split("## Failed")[1].split("## Stopped early")[0]
    assert not (grid_dir / "tune-resume-1").exists()


# ---------------------------------------------------------------------------------------------
# One real grid: ASHA stops a trial that does not learn


def trial_actors(trial_pid: int) -> list[dict]:
    """The actors of the trial whose process was `trial_pid`: its trial actor and every actor
    it owned, transitively (its TorchTrainer's controller, the controller's workers), from
    the GCS actor table (the state API needs the dashboard's HTTP server; psutil would also
    see other Ray clusters on the machine). Other trials' actors are not included."""
    from ray._private import state

    def address(actor: dict, key: str) -> tuple[str, int]:
        return actor[key]["IPAddress"], actor[key]["Port"]

    actors = list(state.actors().values())
    family = [actor for actor in actors if actor["Pid"] == trial_pid]
    owners = {address(actor, "Address") for actor in family}
    while grown := [actor for actor in actors if actor not in family
                    and address(actor, "OwnerAddress") in owners]:
        family += grown
        owners |= {address(actor, "Address") for actor in grown}
    return family


def wait_for_teardown(trial_pid: int, timeout_s: float = 30.0) -> list[dict]:
    """The trial's actors (trial_actors) once none is alive or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        family = trial_actors(trial_pid)
        if all(actor["State"] == "DEAD" for actor in family) or time.monotonic() > deadline:
            return family
        time.sleep(0.5)


def test_asha_stops_a_trial_that_does_not_learn(ray_cluster, small_dataset, tmp_path, capsys):
    # One trial at a time, the learning one first: ASHA records its rounds, then the second
    # (outer lr 0.001: its weights barely move) is judged against them at its first eval round
    # after the grace round. Evaluations every 2 rounds: the scheduler sees rounds 0, 2, 4.
    path = write_grid(tmp_path, small_dataset, name="asha",
                      # The bad trial would run 40 long rounds: Tune stops it in the middle
                      # of one, and its controller and workers must go with it (below).
                      trials=[{"outer.lr": 0.7},
                              {"outer.lr": 0.001, "run.rounds": 40, "inner.steps": 120}],
                      scheduler={"name": "asha", "grace_rounds": 1, "reduction_factor": 2},
                      # A trial takes the session cluster's 4 CPUs (1 + 2 workers + 1 data).
                      resources={"trial_cpus": 1, "max_concurrent": 1})
    grid = yaml.safe_load(path.read_text())
    grid["base"]["scaling"]["cpus_per_worker"] = 1
    grid["base"]["run"].update(rounds=4, eval_every=2)
    path.write_text(yaml.safe_dump(grid))

    assert tune.main([str(path)]) == 0  # a stop is the scheduler's verdict, not a failure
    out = capsys.readouterr().out
    grid_dir = tmp_path / "grids" / "asha"
    bad_name = "1-diloco-inner.steps=120-outer.lr=0.001-run.rounds=40"
    good, bad = (grid_dir / "runs" / name for name in ("0-diloco-outer.lr=0.7", bad_name))
    assert "0-diloco-outer.lr=0.7: done, final eval loss" in out
    assert f"{bad.name}: stopped early at round 2 (eval_loss " in out
    assert (good / "summary.json").is_file() and not (good / "stopped.json").exists()
    marker = strict_json(bad / "stopped.json")
    assert marker["round"] == 2 and marker["metrics"]["eval_loss"] == marker["value"]
    good_evals = {m["round"]: m["eval_loss"] for m in map(json.loads, (good / "metrics.jsonl")
                                                          .read_text().splitlines())
                  if "eval_loss" in m}
    assert marker["value"] > good_evals[2]
    assert not (bad / "summary.json").exists()
    # Its trial process is gone, and with it its TorchTrainer's controller and workers.
    family = wait_for_teardown(marker["trial_pid"])
    assert [(a["ActorClassName"], a["State"]) for a in family if a["State"] != "DEAD"] == []
    # Not vacuous: the trial's controller and workers are in the table, dead.
    assert {"TrainController", "RayTrainWorker"} <= {a["ActorClassName"] for a in family}
    rows = list(csv.DictReader((grid_dir / "results.csv").open()))
    assert [(r["trial"], r["status"]) for r in rows] == [
        ("0-diloco-outer.lr=0.7", "done"), (bad_name, "stopped")]

    # --resume keeps it stopped: nothing runs again.
    assert tune.main([str(path), "--resume"]) == 0
    assert "nothing to resume" in capsys.readouterr().out
    assert not (grid_dir / "tune-resume-1").exists()
