"""Early stopping (`scheduler:`): Tune's ASHA or median stopping rule on the rounds that
report its metric, and the stopped trial's stopped.json."""

from __future__ import annotations

import math
from typing import Any

from isoloco_ray import run_files, strict_json
from isoloco_ray.grids.spec import SchedulerSpec
from isoloco_ray.grids.trainable import trial_run_dir
from isoloco_ray.run_records import finite


def describe_scheduler(spec: SchedulerSpec) -> str:
    """`asha on eval_loss (lower is better), judged on the rounds that report it, after 1
    grace round, reduction factor 3`."""
    text = (f"{spec.name} on {spec.metric} (lower is better), judged on the rounds that report "
            f"it, after {spec.grace_rounds} grace round{'s' if spec.grace_rounds != 1 else ''}")
    if spec.name == "asha":
        return f"{text}, reduction factor {spec.reduction_factor:g}"
    return f"{text}, against at least {spec.min_trials} other trials"


# Tune's own fields of a result besides ray.tune.result.AUTO_RESULT_KEYS (time, host, config):
# left out of stopped.json, which keeps what the trial reported.
_TUNE_RESULT_FIELDS = ("trial_id", "experiment_tag", "done", "should_checkpoint")


def make_scheduler(spec: SchedulerSpec, max_rounds: int) -> Any:
    """Ray Tune's ASHAScheduler or MedianStoppingRule for `spec`, on time step `round`,
    wrapped so that it fits trials that each run a TorchTrainer:

    - it sees only the rounds that report `spec.metric` (eval_loss: the evaluation rounds,
      every run.eval_every), never Tune's final result (the run's summary, without `round`),
      so MedianStoppingRule never reads a result without its metric;
    - a non-finite value (a diverging trial) reaches it as +inf, the worst value, instead of
      NaN, which ASHA would record and never stop;
    - PAUSE becomes CONTINUE: pausing would tear down the trial's Train run only to restart it;
    - a trial is never stopped at its last round: it is writing its summary then;
    - a STOP writes the trial's stopped.json before Tune stops the trial (report and
      `--resume` read it).
    """
    from ray.tune.result import DEFAULT_METRIC
    from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule, TrialScheduler

    if spec.name == "asha":
        inner: TrialScheduler = ASHAScheduler(
            time_attr="round", metric=spec.metric, mode="min", max_t=max_rounds,
            grace_period=spec.grace_rounds, reduction_factor=spec.reduction_factor)
    else:
        inner = MedianStoppingRule(time_attr="round", metric=spec.metric, mode="min",
                                   grace_period=spec.grace_rounds,
                                   min_samples_required=spec.min_trials)

    class RoundScheduler(TrialScheduler):
        def __init__(self) -> None:
            super().__init__()
            self.last: dict[Any, dict[str, Any]] = {}  # trial -> last result `inner` saw
            self.finishing: set[Any] = set()  # trials `inner` would stop at their last round

        @property
        def metric(self) -> str:
            # Tune refuses a result without its scheduler's metric (_validate_result_metrics)
            # unless that is the anonymous default; rounds between evaluations and the final
            # summary have no eval_loss, and on_trial_result sorts them out instead.
            return DEFAULT_METRIC

        def set_search_properties(self, metric: str | None, mode: str | None,
                                  **kwargs: Any) -> bool:
            return inner.set_search_properties(metric, mode, **kwargs)

        def on_trial_add(self, controller: Any, trial: Any) -> None:
            inner.on_trial_add(controller, trial)

        def on_trial_error(self, controller: Any, trial: Any) -> None:
            inner.on_trial_error(controller, trial)

        def on_trial_remove(self, controller: Any, trial: Any) -> None:
            inner.on_trial_remove(controller, trial)

        def on_trial_result(self, controller: Any, trial: Any, result: dict) -> str:
            if "round" not in result or spec.metric not in result or trial in self.finishing:
                return TrialScheduler.CONTINUE
            value = finite(result[spec.metric])
            seen = {**result, spec.metric: math.inf if value is None else value}
            self.last[trial] = seen
            decision = inner.on_trial_result(controller, trial, seen)
            if decision == TrialScheduler.STOP:
                if result["round"] >= trial.config["trial"]["config"]["run"]["rounds"]:
                    self.finishing.add(trial)
                    return TrialScheduler.CONTINUE
                write_stopped(trial, spec, result)
                return TrialScheduler.STOP
            return TrialScheduler.CONTINUE  # PAUSE too (see above)

        def on_trial_complete(self, controller: Any, trial: Any, result: dict) -> None:
            if trial in self.last:  # the last round it saw: Tune's final result has no round
                inner.on_trial_complete(controller, trial, self.last.pop(trial))

        def choose_trial_to_run(self, controller: Any) -> Any:
            return inner.choose_trial_to_run(controller)

        def debug_string(self) -> str:
            return inner.debug_string()

    return RoundScheduler()


def write_stopped(trial: Any, spec: SchedulerSpec, result: dict[str, Any]) -> None:
    """The trial's stopped.json (atomic, strict JSON): the round it was stopped at, why, and
    what it reported then. `trial_pid` is the trial's process, gone once Tune stopped it."""
    from ray.tune.result import AUTO_RESULT_KEYS

    metrics = {key: value for key, value in result.items()
               if key not in AUTO_RESULT_KEYS and key not in _TUNE_RESULT_FIELDS
               and not key.startswith("config/")}
    run_dir = trial_run_dir(trial)
    run_dir.mkdir(parents=True, exist_ok=True)
    strict_json.write(run_dir / run_files.STOPPED, {
        "round": result["round"], "scheduler": spec.name, "metric": spec.metric,
        "value": result[spec.metric], "reason": f"stopped early by {describe_scheduler(spec)}",
        "trial_pid": result.get("pid"), "metrics": metrics}, indent=2)
