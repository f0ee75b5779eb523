"""Grids on shared storage: resume without unpickling, safe names, strict JSON, dry runs
away from the data."""

from __future__ import annotations

import json
import math
import pickle
import time
from pathlib import Path

import pytest
import yaml

from helpers import TUNE_CONFIGS, started_grid, strict_json, write_grid
from isoloco_ray import tune
from isoloco_ray.config import check_name
from isoloco_ray.grids.console import progress_printer
from isoloco_ray.grids.expand import build_trials, trial_name
from isoloco_ray.grids.spec import load_grid_file


class Payload:
    """Unpickling it creates `marker`: what a tampered Tune state file could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant_payloads(tune_dir: Path, trial: str, marker: Path) -> Path:
    """Every file Tune 2.x unpickles on restore, each a payload creating `marker`; returns
    tuner.pkl."""
    blob = pickle.dumps(Payload(marker))
    embedded = {"_type": "CLOUDPICKLE_FALLBACK", "value": blob.hex()}
    stamp = "2025-01-01_00-00-00"
    (tune_dir / trial / "checkpoint_000000").mkdir(parents=True)
    for name in ("tuner.pkl", "trainable.pkl", f"searcher-state-{stamp}.pkl",
                 f"callback-states-{stamp}.pkl", f"{trial}/params.pkl",
                 f"{trial}/checkpoint_000000/_dict_checkpoint.pkl"):
        (tune_dir / name).write_bytes(blob)
    for name in (f"experiment_state-{stamp}.json", f"basic-variant-state-{stamp}.json",
                 f"search_gen_state-{stamp}.json", f"{trial}/trial_metadata.json"):
        (tune_dir / name).write_text(json.dumps({"runner_data": embedded, "trial_data": [],
                                                 "stats": {}, "state": embedded}))
    return tune_dir / "tuner.pkl"


# ---------------------------------------------------------------------------------------------
# --resume reads our JSON, never Tune's pickles


def test_resume_selects_trials_from_run_files_and_never_reads_tune_state(
        tmp_path, small_dataset, capsys, monkeypatch, no_ray):
    def refuse(*args, **kwargs):
        raise AssertionError("Tune's saved state was consulted")
    monkeypatch.setattr("ray.tune.Tuner.restore", refuse)
    monkeypatch.setattr("ray.tune.Tuner.can_restore", refuse)
    path, grid_dir = started_grid(tmp_path, small_dataset, ["diloco", "isoc"])
    marker = tmp_path / "payload-ran"
    tuner_pkl = plant_payloads(grid_dir / "tune", "1-isoc", marker)
    summary = (grid_dir / "runs" / "0-diloco" / "summary.json").read_bytes()

    # Every trial finished or failed: nothing runs (no Ray), the report is written.
    assert tune.main([str(path), "--resume"]) == 1
    out = capsys.readouterr().out
    assert ("grid shared: every trial has finished, failed or been stopped early; nothing to "
            "resume") in out
    assert "| 0-diloco | diloco |" in out and "1 of 2 trials are not done: 1 failed" in out
    assert (grid_dir / "runs" / "0-diloco" / "summary.json").read_bytes() == summary
    assert not marker.exists()
    assert strict_json(grid_dir / "grid.json")["trials"][1]["name"] == "1-isoc"

    plan = tune.plan_grid(path, [])
    assert tune.unfinished_trials(plan.trials) == []
    (grid_dir / "runs" / "1-isoc" / "error.txt").unlink()  # an interrupted trial
    assert [t.name for t in tune.unfinished_trials(plan.trials)] == ["1-isoc"]
    assert tune.new_experiment_name(grid_dir) == "tune-resume-1"
    (grid_dir / "tune-resume-1").mkdir()
    assert tune.new_experiment_name(grid_dir) == "tune-resume-2"
    assert tune.new_experiment_name(tmp_path / "fresh") == "tune"

    # A manifest that is not the grid's, or not JSON, is refused before anything runs.
    assert tune.main([str(path), "--resume", "--run.rounds=3"]) == 2
    assert "the grid's trials changed" in capsys.readouterr().err
    manifest = json.loads((grid_dir / "grid.json").read_text())
    (grid_dir / "grid.json").write_text(json.dumps({**manifest, "max_concurrent": "lots"}))
    assert tune.main([str(path), "--resume"]) == 2
    assert "grid.json: max_concurrent must be a whole number >= 1 or null (got 'lots')" in \
        capsys.readouterr().err
    (grid_dir / "grid.json").write_bytes(tuner_pkl.read_bytes())
    assert tune.main([str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: cannot read {grid_dir / 'grid.json'}" in err and "Traceback" not in err
    assert not marker.exists()

    pickle.loads(tuner_pkl.read_bytes())  # the payload is live: restoring would have run it
    assert marker.exists()


def test_resume_runs_unfinished_trials_in_a_fresh_tuner(ray_cluster, small_dataset, tmp_path,
                                                        capsys):
    path, grid_dir = started_grid(tmp_path, small_dataset, ["diloco", "isoc", "diloco_sgd"])
    marker = tmp_path / "payload-ran"
    plant_payloads(grid_dir / "tune", "2-diloco_sgd", marker)
    done = grid_dir / "runs" / "0-diloco" / "summary.json"
    before = done.read_bytes(), done.stat().st_mtime_ns

    assert tune.main([str(path), "--resume"]) == 1  # 1-isoc stays failed
    out = capsys.readouterr().out
    assert "grid shared: resuming 1 trial, up to 1 at once" in out
    assert "(Tune: tune-resume-1/)" in out
    assert "2-diloco_sgd: done, final eval loss" in out
    assert "0-diloco:" not in out.split("| trial |")[0]  # the finished trial did not run
    assert not marker.exists()
    assert (done.read_bytes(), done.stat().st_mtime_ns) == before
    assert sorted(p.name for p in (grid_dir / "tune-resume-1").iterdir()
                  if p.is_dir() and not p.name.startswith(".")) == ["2-diloco_sgd"]
    summary = strict_json(grid_dir / "runs" / "2-diloco_sgd" / "summary.json")
    assert math.isfinite(summary["final_eval_loss"])
    rows = [line.split(" | ") for line in (grid_dir / "results.md").read_text().splitlines()
            if line.startswith("| 0-") or line.startswith("| 1-") or line.startswith("| 2-")]
    assert sorted((row[0], row[-1]) for row in rows) == [
        ("| 0-diloco", "done |"), ("| 1-isoc", "failed |"), ("| 2-diloco_sgd", "done |")]


# ---------------------------------------------------------------------------------------------
# Names: one safe directory name, checked before anything starts


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", "..", "", " x", "x" * 129,
                                  "gr\u00efd"])
def test_unsafe_grid_name_flag_is_refused(tmp_path, small_dataset, capsys, no_ray, name):
    path = write_grid(tmp_path, small_dataset)
    assert tune.main([str(path), f"--name={name}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --name ") and err.count("\n") == 1 and "Traceback" not in err
    assert "one directory name" in err or "at most 128" in err
    assert tune.main([str(path), f"--name={name}"]) == 2
    assert not (tmp_path / "grids").exists()


def test_unsafe_grid_file_names_are_refused(tmp_path, small_dataset, capsys, no_ray):
    path = write_grid(tmp_path, small_dataset, name="../../outside")
    assert tune.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: name '../../outside' must be one directory name" in err
    # No name: in the file: the file's name must do, or the message says how to set one.
    spaced = tmp_path / "my grid.yaml"
    spaced.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(path.read_text()).items()
                                      if k != "name"}))
    assert tune.main([str(spaced), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "the grid's name (from the file name my grid.yaml) 'my grid' must be one directory " \
           "name" in err and err.rstrip().endswith("; set name: in the file or pass --name")
    assert tune.main([str(spaced), "--dry-run", "--name=mine"]) == 0
    assert not (tmp_path / "grids").exists()


def test_trial_names_are_safe_directory_names(tmp_path):
    name = trial_name(7, 2, "diloco", {"data.path": "../../" + "\u00e9/x y" * 60}, {"data.path"})
    assert name.startswith("07-diloco-data.path=.._.._") and check_name(name, "t") == name
    grid = load_grid_file(write_grid(tmp_path, tmp_path))
    grid.grid = {"data.path": ["../../etc", "/a b/c", "x" * 300]}
    names = [t.name for t in build_trials(grid, {}, tmp_path / "g")]
    assert names[0] == "0-diloco-data.path=.._.._etc" and names[1] == "1-diloco-data.path=_a_b_c"
    assert len(names[2]) <= 128 and len(set(names)) == 3
    assert all(check_name(n, "trial name") == n for n in names)


# ---------------------------------------------------------------------------------------------
# Strict JSON from a trial, whatever its numbers


def test_trial_summary_and_progress_are_strict_about_non_finite_losses(tmp_path, monkeypatch,
                                                                       small_dataset, capsys):
    import ray.tune.integration.ray_train

    from isoloco_ray import driver

    monkeypatch.setattr(ray.tune.integration.ray_train, "TuneReportCallback", lambda: None)
    monkeypatch.setattr(driver, "fit", lambda *args, **kwargs: {
        "rounds": 2, "tokens": 1536, "final_eval_loss": float("nan"),
        "final_eval_perplexity": float("inf"),
        "evaluations": {"test": {"losses": [1.0, float("-inf")]}}})  # nested: also strict
    plan = tune.plan_grid(write_grid(tmp_path, small_dataset), [])
    trial = plan.trials[0]
    params = {"trial": {"name": trial.name, "data_dir": str(trial.data_dir),
                        "config": trial.config.model_dump(mode="json")}}
    result = tune.run_trial(params)
    summary = strict_json(trial.run_dir / "summary.json")
    assert summary["final_eval_loss"] is None
    assert summary["evaluations"]["test"]["losses"] == [1.0, None]
    assert result["final_eval_perplexity"] is None
    assert tune.run_trial(params) == summary  # a finished run is not trained again

    class Trial:
        config = {"trial": {"name": trial.name}}
        last_result = result
    progress_printer().on_trial_complete(0, [], Trial())
    assert capsys.readouterr().out == (f"{trial.name}: diverged, final eval loss not a "
                                       f"finite number, {result['seconds']:.0f}s\n")


# ---------------------------------------------------------------------------------------------
# --dry-run away from the data


@pytest.mark.parametrize("grid, trials", [("paper_178m_main", 5), ("paper_178m_merging", 4),
                                          ("paper_512m_main", 3)])
def test_dry_run_lists_paper_grids_without_their_data(tmp_path, capsys, monkeypatch, no_ray,
                                                      grid, trials):
    monkeypatch.delenv("DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    path = TUNE_CONFIGS / f"{grid}.yaml"
    assert tune.main([str(path), "--dry-run"]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[0] == f"grid {grid}: {trials} trials -> {tmp_path / 'runs' / grid}"
    assert len(out) == 1 + trials and out[1].split()[0].startswith("0-")
    assert captured.err.splitlines() == [
        "warning: data.path: environment variable DATA_DIR is not set "
        "($DATA_DIR/llama2_2048); a dry run keeps the path as written",
        f"warning: trials 0-{trials - 1} not checked against their data: data.path "
        "$DATA_DIR/llama2_2048 names the unset environment variable DATA_DIR"]

    # DATA_DIR set, its data absent: one warning for the data directory.
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "nowhere"))
    assert tune.main([str(path), "--dry-run"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: trials 0-{trials - 1} not checked against their data: data.path: "
                   f"{tmp_path / 'nowhere' / 'llama2_2048'} is not a prepared data directory "
                   "(no meta.json); create one with `python -m isoloco_ray.data.prepare`, or "
                   "leave data.path unset for the demo"]

    # Without --dry-run these are errors; config errors stay errors in a dry run.
    monkeypatch.delenv("DATA_DIR")
    assert tune.main([str(path)]) == 2
    assert capsys.readouterr().err == ("error: data.path: environment variable DATA_DIR is not "
                                       "set ($DATA_DIR/llama2_2048); set it, or set data.path "
                                       "without it\n")
    assert tune.main([str(path), "--dry-run", "--inner.steps=0"]) == 2
    err = capsys.readouterr().err
    assert "trial 0 (" in err and "inner.steps" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_dry_run_warns_once_per_data_dir_and_still_checks_data_that_is_there(
        tmp_path, small_dataset, capsys, no_ray):
    path = write_grid(tmp_path, small_dataset, grid={"data.path": [
        str(tmp_path / "gone"), str(small_dataset)], "run.seed": [0, 1]})
    assert tune.main([str(path), "--dry-run"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"warning: trials 0-1 not checked against their data: data.path: {tmp_path / 'gone'} "
        "is not a prepared data directory")
    # The data that is there is checked: a config it cannot feed is still an error.
    assert tune.main([str(path), "--dry-run", "--scaling.replicas=256",
                      "--scaling.replicas_per_worker=2"]) == 2
    assert "trial 2 (data.path=" in capsys.readouterr().err


def test_an_unwritable_grid_directory_exits_2_before_ray(small_dataset, tmp_path, capsys,
                                                        monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a grid that cannot be written")

    monkeypatch.setattr(tune, "run_trials", refuse)
    (tmp_path / "file").write_text("not a directory")
    grid = write_grid(tmp_path, small_dataset, grid={"inner.lr": [0.001]})
    status = tune.main([str(grid), f"--run.storage_path={tmp_path / 'file' / 'runs'}"])
    assert status == 2
    assert "run.storage_path: cannot write to" in capsys.readouterr().err


def test_a_large_grid_says_how_far_the_check_of_its_trials_has_got(
        tmp_path, small_dataset, capsys, monkeypatch, no_ray):
    """With max_trials raised, checking every trial's settings takes seconds per thousand
    (10,000 took 52 s in silence): past PROGRESS_FROM trials a line on stderr every
    PROGRESS_EVERY_S seconds says how far it has got (both lowered here: 6 trials)."""
    from isoloco_ray.grids import expand

    monkeypatch.setattr(expand, "PROGRESS_FROM", 5)
    monkeypatch.setattr(expand, "PROGRESS_EVERY_S", 0.0)
    path = write_grid(tmp_path, small_dataset, grid={"run.seed": list(range(6))})
    assert tune.main([str(path), "--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("checked")]
    assert lines == [f"checked {i} of 6 trials' settings" for i in range(1, 7)]
    monkeypatch.setattr(expand, "PROGRESS_FROM", 7)  # a small grid: silent
    assert tune.main([str(path), "--dry-run"]) == 0
    assert "checked" not in capsys.readouterr().err


def test_a_huge_grid_is_refused_from_its_axes_alone_and_a_repeated_value_is_refused(
        tmp_path, small_dataset, capsys, no_ray):
    """10⁷ trials are counted, not built: one line naming the axes that multiply and the
    setting that raises the cap, at once (it took 30 s and 8.8 GB before printing nothing);
    a value listed twice in an axis would run one trial twice: refused, naming it."""
    axis = [round(1e-4 * (i + 1), 8) for i in range(100)]
    path = write_grid(tmp_path, small_dataset,
                      grid={"inner.lr": axis, "outer.lr": axis, "inner.warmup": axis[:10],
                            "run.seed": list(range(100))})
    started = time.monotonic()
    assert tune.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - started < 10
    assert err == (f"error: {path}: the grid makes 10,000,000 trials (inner.lr 100 × "
                   "inner.warmup 10 × outer.lr 100 × run.seed 100), more than max_trials (1,000): "
                   "shorten an axis, or set max_trials: higher in the grid file\n")
    path = write_grid(tmp_path, small_dataset, grid={"run.seed": [0, 1]}, max_trials=1)
    assert tune.main([str(path), "--dry-run"]) == 2
    assert "the grid makes 2 trials (run.seed 2), more than max_trials (1)" in \
        capsys.readouterr().err
    path = write_grid(tmp_path, small_dataset, grid={"inner.lr": [0.001, 0.002, 0.001]})
    assert tune.main([str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err == (f"error: {path}: grid: inner.lr: 0.001 is listed twice, "
                                       "which would run the same trial twice; list each value "
                                       "once\n")
    assert not (tmp_path / "grids").exists()


def test_a_dry_run_refuses_a_storage_path_the_run_would_refuse_and_writes_nothing(
        tmp_path, small_dataset, capsys, no_ray):
    """--dry-run checks what the run checks: a run.storage_path that is a file (or under
    one) is one error line, exit 2, as the real run's, and the dry run creates nothing."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    path = write_grid(tmp_path, small_dataset, grid={"run.seed": [0, 1]})
    for storage in (a_file, a_file / "below"):
        assert tune.main([str(path), "--dry-run", f"--run.storage_path={storage}"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"error: run.storage_path: cannot write to {storage} ({a_file} is not a "
            "directory); choose a writable directory (or a bucket these credentials may "
            "write)")
    assert tune.main([str(path), "--dry-run", f"--run.storage_path={tmp_path / 'new' / 'x'}"]) \
        == 0
    assert not (tmp_path / "new").exists()
