"""Search (`search:`): one seeded Optuna searcher per grid point, its state rebuilt on
--resume from the runs' own files, never from Tune's pickled state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoloco_ray import run_files, strict_json
from isoloco_ray.config import ConfigError
from isoloco_ray.grids.expand import Search, Trial
from isoloco_ray.grids.plan import GridPlan, trial_entry
from isoloco_ray.grids.resume import run_is_over
from isoloco_ray.grids.trainable import trial_space
from isoloco_ray.own_files import replace_file
from isoloco_ray.run_records import ReportError, finite, last_error_line, load_run

# Proposals of each grid point's searcher drawn at random (seeded) before TPE models the
# results (Optuna's default, named so that --dry-run can say which proposals are fixed).
STARTUP_TRIALS = 10


def optuna_space(search: Search) -> dict[str, Any]:
    """The search space as Optuna distributions, keyed by field path."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    space: dict[str, Any] = {}
    for path, dimension in search.spec.space.items():
        if dimension.choice is not None:
            space[path] = CategoricalDistribution(dimension.choice)
        else:
            low, high = dimension.bounds
            space[path] = FloatDistribution(low, high, log=dimension.loguniform is not None)
    return space


def point_searcher(search: Search, metric: str, mode: str, seed: int) -> Any:
    """Ray Tune's OptunaSearch over the space for one grid point, its TPE sampler seeded with
    `seed`: the first STARTUP_TRIALS proposals are seeded random draws, the later ones TPE's
    model of the results told so far."""
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no log line per told trial
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=STARTUP_TRIALS)
    return OptunaSearch(space=optuna_space(search), metric=metric, mode=mode, sampler=sampler)


def sampler_seed(seed: int, proposed: int) -> int:
    """The samplers' seed: the file's on a fresh start; after `proposed` trials (a resume)
    one derived from both, so that a resume does not draw the proposals it already ran, and
    the same interrupted grid resumes the same way."""
    return seed if proposed == 0 else (seed * 1_000_003 + proposed) % 2**32


def first_proposals(plan: GridPlan, count: int) -> list[Trial]:
    """The first `count` trials of each point on a fresh start, as the run proposes them
    (before any result they do not depend on results); ConfigError for a proposal that is
    not a valid config."""
    search = search_of(plan)
    trials = []
    for point in range(len(search.points)):
        searcher = point_searcher(search, plan.file.metric.name, plan.file.metric.mode,
                                  search.spec.seed)
        trials += [search.trial(point, sample, searcher.suggest(f"{point}-{sample}"))
                   for sample in range(count)]
    return trials


def search_of(plan: GridPlan) -> Search:
    if plan.search is None:
        raise ValueError(f"grid {plan.name} has no search:")
    return plan.search


@dataclass
class Proposal:
    """A trial a search proposed: its grid point, its sample number there, the proposed
    values (field path -> value) and its name."""

    point: int
    sample: int
    values: dict[str, Any]
    name: str

    @property
    def key(self) -> str:
        """Its id in its point's searcher."""
        return f"{self.point}-{self.sample}"


@dataclass
class SearchState:
    """Where a search stands (grid.json's trials, the runs' own files): the proposals that
    are over, those to run again, and the (point, sample) pairs not proposed yet, in the
    order they are proposed (round-robin over the points)."""

    over: list[Proposal]
    rerun: list[Proposal]
    todo: list[tuple[int, int]]

    @property
    def proposed(self) -> int:
        """Trials proposed so far."""
        return len(self.over) + len(self.rerun)


def search_state(plan: GridPlan, entries: list[Any]) -> SearchState:
    """The state of `plan`'s search from grid.json's `trials` (none on a fresh start).
    ConfigError unless each entry is a proposal this grid file names as it does (its name
    is rebuilt from its point, sample and values), each (point, sample) once."""
    search = search_of(plan)
    proposals: list[Proposal] = []
    for index, entry in enumerate(entries):
        try:
            point, sample = entry["point"], entry["sample"]
            values = {path: entry["overrides"][path] for path in search.spec.space}
            valid = (type(point) is int and type(sample) is int
                     and 0 <= point < len(search.points) and 0 <= sample < search.spec.samples
                     and search.name(point, sample, values) == entry["name"])
        except (KeyError, TypeError, ValueError, AttributeError):
            valid = False
        if not valid:
            raise ConfigError(f"--resume: {plan.grid_dir / run_files.GRID}: trials[{index}] is "
                              "not a trial this grid file proposes; start a new grid (--name)")
        proposals.append(Proposal(point, sample, values, entry["name"]))
    taken = {(p.point, p.sample) for p in proposals}
    if len(taken) < len(proposals):
        raise ConfigError(f"--resume: {plan.grid_dir / run_files.GRID} lists a trial twice; "
                          "start a new grid (--name)")
    over = [p for p in proposals if run_is_over(plan.grid_dir / run_files.RUNS / p.name)]
    return SearchState(over, [p for p in proposals if p not in over],
                       [(point, sample) for sample in range(search.spec.samples)
                        for point in range(len(search.points)) if (point, sample) not in taken])


def search_outcome(run_dir: Path, metric: str) -> tuple[float | None, str]:
    """What a search learns from a trial, from its run's own files (as the report ranks it):
    (the metric, "complete") for a finished run; (None, "pruned") for one that diverged,
    was stopped early or did not finish, which TPE counts as worse than every finished one;
    (None, "fail") for a failed one, or one whose files cannot be read, which TPE leaves
    out."""
    try:
        run = load_run(run_dir)
    except ReportError:
        return None, "fail"
    value = finite(run.value(metric)) if run.status == "done" else None
    if value is not None:
        return value, "complete"
    return None, "fail" if run.status == "failed" else "pruned"


def make_searcher(plan: GridPlan, state: SearchState, manifest: dict[str, Any]) -> Any:
    """A Ray Tune Searcher running `plan`'s search from `state`: one seeded OptunaSearch per
    grid point (point_searcher), told the outcome of each trial over (search_outcome). It
    hands out the trials to run again first, then proposes the rest round-robin over the
    points; each proposal is validated as a TrainConfig and added to grid.json (`manifest`,
    rewritten atomically) before Tune sees it. A proposal that is not a valid config is
    recorded as failed (its run's error.txt) and told to its searcher, never run."""
    from ray.tune.search import Searcher

    search = search_of(plan)
    metric, mode = plan.file.metric.name, plan.file.metric.mode
    seed = sampler_seed(search.spec.seed, state.proposed)
    searchers = [point_searcher(search, metric, mode, seed) for _ in search.points]
    runs_dir = plan.grid_dir / run_files.RUNS

    def tell(proposal: Proposal, asked: bool) -> None:
        value, outcome = search_outcome(runs_dir / proposal.name, metric)
        searcher = searchers[proposal.point]
        if asked:  # proposed by this searcher: it waits for the trial's result
            searcher.on_trial_complete(proposal.key, None if value is None else {metric: value},
                                       error=outcome == "fail")
        else:
            searcher.add_evaluated_point(proposal.values, value, error=outcome == "fail",
                                         pruned=outcome == "pruned")

    def record(entry: dict[str, Any]) -> None:
        manifest["trials"].append(entry)
        strict_json.write(plan.grid_dir / run_files.GRID, manifest, indent=2)

    for proposal in state.over:
        tell(proposal, asked=False)

    class ProposalSearcher(Searcher):
        def __init__(self) -> None:
            # No metric: Tune would demand it in every round's result; each trial's outcome
            # is read from its run's files when it completes (search_outcome).
            super().__init__()
            self.rerun = list(state.rerun)
            self.todo = list(state.todo)
            self.live: dict[str, tuple[Proposal, bool]] = {}  # Tune's trial id -> proposal

        def set_search_properties(self, metric: str | None, mode: str | None, config: dict,
                                  **spec: Any) -> bool:
            return True  # the space and the grid's metric are set already

        def suggest(self, trial_id: str) -> dict | None:
            if self.rerun:
                proposal = self.rerun.pop(0)
                self.live[trial_id] = (proposal, False)
                return {"trial": trial_space(search.trial(proposal.point, proposal.sample,
                                                          proposal.values))}
            while self.todo:
                point, sample = self.todo.pop(0)
                key = f"{point}-{sample}"
                values = searchers[point].suggest(key)
                proposal = Proposal(point, sample, values, search.name(point, sample, values))
                try:
                    trial = search.trial(point, sample, values)
                except ConfigError as exc:
                    self.refuse(proposal, str(exc))
                    continue
                record(trial_entry(trial, point=point, sample=sample))
                self.live[trial_id] = (proposal, True)
                return {"trial": trial_space(trial)}
            return Searcher.FINISHED

        def refuse(self, proposal: Proposal, error: str) -> None:
            source = search.points[proposal.point]
            run_dir = runs_dir / proposal.name
            run_dir.mkdir(parents=True, exist_ok=True)
            replace_file(run_dir / run_files.ERROR,
                         f"ConfigError: the proposal is not a valid config: {error}\n")
            record({"name": proposal.name, "overrides": {**source.overrides, **proposal.values},
                    "strategy": proposal.values.get("outer.strategy",
                                                    source.config.outer.strategy),
                    "config": None, "point": proposal.point, "sample": proposal.sample,
                    "error": error})
            tell(proposal, asked=True)
            print(f"{proposal.name}: FAILED: the proposal is not a valid config: "
                  f"{last_error_line(error)}", flush=True)

        def on_trial_complete(self, trial_id: str, result: dict | None = None,
                              error: bool = False) -> None:
            if trial_id in self.live:
                proposal, asked = self.live.pop(trial_id)
                tell(proposal, asked)

    return ProposalSearcher()
