"""Search instead of a grid: the `search:` key, seeded Optuna proposals, grid.json and --resume
of a search (from the run files, no Ray), one real search on Ray Tune."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import TUNE_CONFIGS, strict_json, write_grid
from isoloco_ray import tune
from isoloco_ray.config import ConfigError, check_name
from isoloco_ray.grids.spec import load_grid_file
from isoloco_ray.grids import search as grid_search

pytest.importorskip("optuna")

SPACE = {"inner.lr": {"loguniform": [1e-4, 1e-2]}, "outer.lr": {"uniform": [0.3, 3.0]}}


def search_grid(tmp_path: Path, data_dir: Path, samples: int = 3, seed: int = 0,
                space: dict[str, Any] | None = None, **sections: Any) -> Path:
    """A grid file searching `space` (default SPACE) at DiLoCo and ISO-C."""
    sections.setdefault("trials", [{"outer.strategy": "diloco"}, {"outer.strategy": "isoc"}])
    return write_grid(tmp_path, data_dir, name="search", **sections,
                      search={"algo": "optuna", "samples": samples, "seed": seed,
                              "space": SPACE if space is None else space})


def proposals(path: Path, *args: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, overrides) of the first proposals of each point, as a fresh run makes them."""
    plan = tune.plan_grid(path, list(args))
    return [(t.name, t.overrides)
            for t in grid_search.first_proposals(plan, plan.search.spec.samples)]


# ---------------------------------------------------------------------------------------------
# Seeded proposals


def test_a_seed_repeats_its_proposals_and_another_seed_does_not(tmp_path, small_dataset,
                                                                no_ray):
    first = proposals(search_grid(tmp_path, small_dataset, seed=7))
    again = proposals(search_grid(tmp_path, small_dataset, seed=7))
    other = proposals(search_grid(tmp_path, small_dataset, seed=8))
    assert first == again
    assert [values for _, values in first] != [values for _, values in other]

    # Trial numbers are point x samples + sample: DiLoCo 0-2, ISO-C 3-5, each point starting
    # from the same draws (both strategies are compared on the same settings).
    assert [name.split("-")[:2] for name, _ in first] == [
        ["0", "diloco"], ["1", "diloco"], ["2", "diloco"], ["3", "isoc"], ["4", "isoc"],
        ["5", "isoc"]]
    diloco, isoc = first[:3], first[3:]
    strip = [{k: v for k, v in values.items() if k != "outer.strategy"} for _, values in first]
    assert strip[:3] == strip[3:] and len({json.dumps(v) for v in strip[:3]}) == 3
    for name, values in diloco + isoc:
        assert check_name(name, "trial name") == name
        assert 1e-4 <= values["inner.lr"] <= 1e-2 and 0.3 <= values["outer.lr"] <= 3.0
        assert name.endswith(f"-inner.lr={values['inner.lr']:.3g}-"
                             f"outer.lr={values['outer.lr']:.3g}")


def test_choice_proposes_only_its_values(tmp_path, small_dataset, no_ray):
    space = {"inner.lr": {"uniform": [1e-3, 2e-3]}, "inner.steps": {"choice": [2, 3]}}
    path = search_grid(tmp_path, small_dataset, samples=8, space=space, trials=[])
    found = proposals(path)
    assert {values["inner.steps"] for _, values in found} == {2, 3}
    assert all(type(values["inner.steps"]) is int for _, values in found)
    assert found[0][0].startswith("0-diloco-inner.lr=") and "-inner.steps=" in found[0][0]


def test_dry_run_prints_the_search_and_its_first_proposals(tmp_path, small_dataset, capsys,
                                                           no_ray):
    path = search_grid(tmp_path, small_dataset, samples=12,
                       scheduler={"name": "asha", "grace_rounds": 1})
    assert tune.main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:5] == [
        f"grid search: a search of 2 grid points x 12 samples = 24 trials -> "
        f"{tmp_path / 'grids' / 'search'}",
        "  search: optuna, 12 samples per grid point, seed 0, min final_eval_loss",
        "    inner.lr: loguniform [0.0001, 0.01]",
        "    outer.lr: uniform [0.3, 3]",
        "  early stopping: asha on eval_loss (lower is better), judged on the rounds that "
        "report it, after 1 grace round, reduction factor 3"]
    assert out[5] == "  grid points:" and out[6].split()[0] == "0-diloco"
    assert out[8] == ("  first 10 proposals of each point (random, fixed by the seed; TPE "
                      "proposes the rest from the results):")
    names = [line.split()[0] for line in out[9:]]
    assert len(names) == 20 and names[0].startswith("00-diloco-inner.lr=")
    assert names[10].startswith("12-isoc-inner.lr=")  # ISO-C's trials are 12-23
    assert not (tmp_path / "grids").exists()


def test_shipped_search_grid_is_valid(tmp_path):
    grid = load_grid_file(TUNE_CONFIGS / "demo_search.yaml")
    assert grid.search is not None and grid.scheduler is not None
    assert (grid.search.samples, grid.search.seed) == (6, 0)
    assert set(grid.search.space) == {"inner.lr", "outer.lr"}


# ---------------------------------------------------------------------------------------------
# Settings: refused with the field and the fix, before Ray starts


@pytest.mark.parametrize("search, sections, args, message", [
    ({"space": {"inner.lrr": {"uniform": [0.1, 1]}}}, {}, [],
     "search.space: unknown field 'inner.lrr'; did you mean inner.lr?"),
    ({"space": {"inner.lr": {"loguniform": [0, 1e-2]}}}, {}, [],
     "search.space.inner.lr: loguniform: low must be above 0 (got 0.0); use uniform: for a "
     "range from 0"),
    ({"space": {"outer.lr": {"uniform": [2, 1]}}}, {}, [],
     "search.space.outer.lr: uniform: [2.0, 1.0] must be two finite numbers, low < high"),
    ({"space": {"outer.lr": {"uniform": [0.5, math.inf]}}}, {}, [],
     "uniform: [0.5, inf] must be two finite numbers, low < high"),
    ({"space": {"outer.lr": {"uniform": [0.5, 1], "choice": [1]}}}, {}, [],
     "search.space.outer.lr: give exactly one of uniform: [low, high], loguniform: [low, high] "
     "or choice: [values] (got uniform, choice)"),
    ({"space": {"outer.lr": {"choice": [1, 1]}}}, {}, [], "choice: [1, 1] repeats a value"),
    ({"space": {"inner.steps": {"uniform": [2, 4]}}}, {}, [],
     "search.space: inner.steps takes whole numbers but uniform proposes fractions; use "
     "choice: [...] for inner.steps"),
    ({"space": {"outer.strategy": {"uniform": [0, 1]}}}, {}, [],
     "search.space: outer.strategy takes no numbers but uniform proposes fractions; use "
     "choice: [...] for outer.strategy"),
    ({"space": {"scaling.replicas": {"choice": [2, 4]}}}, {}, [],
     "search.space: scaling.replicas cannot be searched (it decides the trial's data or "
     "resources, checked before Ray starts); vary it in grid: or trials:"),
    ({"space": {}}, {}, [], "search.space: an empty space has nothing to search"),
    ({"samples": 0}, {}, [], "search.samples: must be a whole number >= 1 (got 0)"),
    ({"seed": -1}, {}, [], "search.seed: must be a whole number from 0 to 2**32 - 1 (got -1)"),
    ({"algo": "hyperopt"}, {}, [], "search.algo: unknown search algo 'hyperopt'; use optuna:"),
    ({}, {"grid": {"inner.lr": [1e-3]}}, [],
     "search.space.inner.lr: grid: or trials: set this field too; search it or set it, in one "
     "place"),
    ({}, {}, ["--outer.lr=1.0"], "--outer.lr: the grid varies this field"),
    ({"space": {"outer.lr": {"uniform": [-1, 1]}}}, {}, [],
     "search.space.outer.lr: uniform value -1.0 is not valid: trial 0 (outer.strategy=diloco, "
     "outer.lr=-1.0): outer.lr: Input should be greater than or equal to 0"),
    ({"space": {"data.seq_len": {"choice": [64, 128]}}}, {}, [],  # the data's blocks are 64
     "search.space.data.seq_len: trial 0 (outer.strategy=diloco, data.seq_len=128): "),
])
def test_bad_search_settings_exit_2_before_ray(tmp_path, small_dataset, capsys, no_ray,
                                               search, sections, args, message):
    spec = {"algo": "optuna", "samples": 2, "seed": 0, "space": SPACE, **search}
    path = write_grid(tmp_path, small_dataset, search=spec,
                      trials=[{"outer.strategy": "diloco"}], **sections)
    assert tune.main([str(path), *args]) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err or ("error: " in err and message in err)
    assert "Traceback" not in err
    assert not (tmp_path / "grids").exists()


def test_a_missing_optuna_names_the_extra(tmp_path, small_dataset, capsys, no_ray,
                                          monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "optuna" else find_spec(name, *a))
    assert tune.main([str(search_grid(tmp_path, small_dataset)), "--dry-run"]) == 2
    assert ('error: search: needs the optuna package, which is not installed; pip install -e '
            '".[tune]"') in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# grid.json, the searcher and --resume, driven without a cluster


def write_run(run_dir: Path, outcome: str, loss: float = 5.0) -> None:
    """What a trial leaves: `done` (summary.json), `failed` (error.txt), `stopped`
    (stopped.json) or `interrupted` (some rounds)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0, "tokens": 0,
                                                       "eval_loss": loss}) + "\n")
    if outcome == "done":
        (run_dir / "summary.json").write_text(json.dumps({"final_eval_loss": loss}))
    elif outcome == "failed":
        (run_dir / "error.txt").write_text("RuntimeError: boom\n")
    elif outcome == "stopped":
        (run_dir / "stopped.json").write_text(json.dumps(
            {"round": 0, "scheduler": "asha", "metric": "eval_loss", "value": loss,
             "reason": "stopped early by asha", "metrics": {"round": 0}}))


def drain(searcher: Any) -> list[dict[str, Any]]:
    """Every trial the searcher hands out, each completed right away (as Tune would)."""
    from ray.tune.search import Searcher

    handed = []
    while (config := searcher.suggest(f"tune-{len(handed)}")) != Searcher.FINISHED:
        handed.append(config["trial"])
        searcher.on_trial_complete(f"tune-{len(handed) - 1}")
    return handed


def test_searcher_records_each_proposal_and_resume_keeps_what_ran(tmp_path, small_dataset,
                                                                  no_ray):
    path = search_grid(tmp_path, small_dataset, samples=3)
    plan = tune.plan_grid(path, [])
    manifest = plan.manifest(1)
    assert manifest["trials"] == [] and manifest["search"]["samples"] == 3
    assert [p["name"] for p in manifest["points"]] == ["0-diloco", "1-isoc"]
    state = tune.search_state(plan, [])
    assert state.todo == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]  # round-robin

    # A fresh search hands out the proposals the dry run shows, in round-robin order, and
    # adds each to grid.json before Tune sees it.
    plan.grid_dir.mkdir(parents=True)
    searcher = tune.make_searcher(plan, state, manifest)
    first = [searcher.suggest(f"tune-{i}")["trial"] for i in range(3)]
    expected = {t.index: t for t in grid_search.first_proposals(plan, 3)}
    assert [t["name"] for t in first] == [expected[index].name for index in (0, 3, 1)]
    expected = {t.name: t for t in expected.values()}
    for trial in first:
        assert trial["config"] == expected[trial["name"]].config.model_dump(mode="json")
        assert trial["config"]["run"]["name"] == trial["name"]
    stored = strict_json(plan.grid_dir / "grid.json")
    assert [(t["name"], t["point"], t["sample"]) for t in stored["trials"]] == [
        (first[0]["name"], 0, 0), (first[1]["name"], 1, 0), (first[2]["name"], 0, 1)]

    # Interrupted: the first finished, the second failed, the third was running.
    runs = plan.grid_dir / "runs"
    write_run(runs / first[0]["name"], "done")
    write_run(runs / first[1]["name"], "failed")
    write_run(runs / first[2]["name"], "interrupted")
    resumed = tune.plan_grid(path, [])
    stored = tune.read_manifest(resumed)
    state = tune.search_state(resumed, stored["trials"])
    assert [p.name for p in state.over] == [first[0]["name"], first[1]["name"]]
    assert [p.name for p in state.rerun] == [first[2]["name"]]
    assert state.todo == [(1, 1), (0, 2), (1, 2)]
    handed = drain(tune.make_searcher(resumed, state, stored))
    # The interrupted trial first, with its config (Ray Train continues its run), then the
    # three proposals left, from samplers seeded by the seed and the 3 proposed before: not
    # the draws already run.
    assert handed[0] == {**first[2], "data_dir": str(small_dataset)}
    assert [t["name"].split("-")[:2] for t in handed[1:]] == [["4", "isoc"], ["2", "diloco"],
                                                              ["5", "isoc"]]
    ran = {json.dumps({k: t["overrides"][k] for k in SPACE}) for t in first}
    assert not ran & {json.dumps({k: t["overrides"][k] for k in SPACE}) for t in handed[1:]}
    assert len(strict_json(plan.grid_dir / "grid.json")["trials"]) == 6
    # The same interrupted grid resumes the same way.
    again = drain(tune.make_searcher(resumed, tune.search_state(resumed, stored["trials"][:3]),
                                     {**stored, "trials": stored["trials"][:3]}))
    assert [t["name"] for t in again] == [t["name"] for t in handed]


def test_resume_refuses_a_tampered_or_changed_search(tmp_path, small_dataset, capsys, no_ray):
    path = search_grid(tmp_path, small_dataset, samples=2)
    plan = tune.plan_grid(path, [])
    plan.grid_dir.mkdir(parents=True)
    manifest = plan.manifest(1)
    drain(tune.make_searcher(plan, tune.search_state(plan, []), manifest))
    entry = manifest["trials"][0]
    for bad in ({**entry, "name": "../elsewhere"}, {**entry, "point": 5},
                {**entry, "overrides": {**entry["overrides"], "inner.lr": 0.5}}, "junk"):
        with pytest.raises(ConfigError, match=r"trials\[0\] is not a trial this grid file "
                                              r"proposes; start a new grid \(--name\)"):
            tune.search_state(plan, [bad])
    with pytest.raises(ConfigError, match="lists a trial twice"):
        tune.search_state(plan, [entry, entry])

    # Another seed is another search: refused, like a changed grid.
    for trial in manifest["trials"]:
        write_run(plan.grid_dir / "runs" / trial["name"], "done")
    (plan.grid_dir / "grid.json").write_text(json.dumps(manifest))
    other = search_grid(tmp_path, small_dataset, samples=2, seed=1)
    assert tune.main([str(other), "--resume"]) == 2
    assert "the grid's trials changed" in capsys.readouterr().err
    # The same one with every trial over: nothing runs, the report lists the proposals.
    path = search_grid(tmp_path, small_dataset, samples=2)
    assert tune.main([str(path), "--resume"]) == 0
    assert "nothing to resume" in capsys.readouterr().out
    rows = list(csv.DictReader((plan.grid_dir / "results.csv").open()))
    assert sorted(r["trial"] for r in rows) == sorted(t["name"] for t in manifest["trials"])


@pytest.mark.parametrize("outcome, told", [("done", (5.0, "complete")),
                                           ("failed", (None, "fail")),
                                           ("stopped", (None, "pruned")),
                                           ("interrupted", (None, "pruned"))])
def test_search_outcome_reads_the_run_files(tmp_path, outcome, told):
    write_run(tmp_path / "run", outcome)
    assert grid_search.search_outcome(tmp_path / "run", "final_eval_loss") == told


def test_a_proposal_that_is_not_a_valid_config_is_recorded_as_failed(tmp_path, small_dataset,
                                                                     capsys, no_ray,
                                                                     monkeypatch):
    path = search_grid(tmp_path, small_dataset, samples=2, trials=[])
    plan = tune.plan_grid(path, [])
    plan.grid_dir.mkdir(parents=True)
    build = type(plan.search).trial

    def refuse_first(search, point, sample, values):
        if sample == 0:
            raise ConfigError(f"trial 0 ({values}): outer.lr: too big")
        return build(search, point, sample, values)
    monkeypatch.setattr(type(plan.search), "trial", refuse_first)
    manifest = plan.manifest(1)
    handed = drain(tune.make_searcher(plan, tune.search_state(plan, []), manifest))
    assert [t["name"].split("-")[0] for t in handed] == ["1"]  # sample 0 never runs
    refused = manifest["trials"][0]
    assert refused["sample"] == 0 and "outer.lr: too big" in refused["error"]
    error = (plan.grid_dir / "runs" / refused["name"] / "error.txt").read_text()
    assert error.startswith("ConfigError: the proposal is not a valid config: trial 0")
    assert f"{refused['name']}: FAILED: the proposal is not a valid config" in \
        capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# One real search on Ray Tune


def test_real_search_runs_its_proposals(ray_cluster, small_dataset, tmp_path, capsys):
    path = search_grid(tmp_path, small_dataset, samples=2, trials=[],
                       resources={"trial_cpus": 0.5, "max_concurrent": 2})
    grid = yaml.safe_load(path.read_text())
    grid["base"]["scaling"]["cpus_per_worker"] = 0.5
    path.write_text(yaml.safe_dump(grid))
    expected = proposals(path)

    assert tune.main([str(path)]) == 0
    out = capsys.readouterr().out
    grid_dir = tmp_path / "grids" / "search"
    assert "search: optuna, 2 samples per grid point, seed 0" in out
    stored = strict_json(grid_dir / "grid.json")
    assert [(t["name"], t["overrides"]) for t in stored["trials"]] == [
        (name, {k: v for k, v in values.items()}) for name, values in expected]
    for name, values in expected:
        assert f"{name}: done, final eval loss" in out
        config = strict_json(grid_dir / "runs" / name / "config.json")
        assert (config["inner"]["lr"], config["outer"]["lr"]) == (values["inner.lr"],
                                                                   values["outer.lr"])
    rows = list(csv.DictReader((grid_dir / "results.csv").open()))
    assert sorted(r["trial"] for r in rows) == sorted(name for name, _ in expected)
    assert {r["status"] for r in rows} == {"done"}

    assert tune.main([str(path), "--resume"]) == 0
    assert "nothing to resume" in capsys.readouterr().out
