"""driver.py: the one run the train CLI and a Tune trial share: the run directory's checks
(a resume keeps its settings), config.json, the TorchTrainer, summary.json or why not."""

from __future__ import annotations

import json

import pytest

from helpers import TINY_RUN
from isoloco_ray import driver, run_files, train
from isoloco_ray.config import ConfigError, load_config
from isoloco_ray.run_records import last_error_line

TINY = TINY_RUN + ["--scaling.replicas=2", "--scaling.replicas_per_worker=2", "--inner.steps=3",
                   "--run.rounds=2"]


def test_a_run_directory_resumes_only_with_its_settings_and_its_own_model_files(tmp_path):
    cfg = load_config(TINY)
    saved = load_config(TINY + ["--inner.lr=0.01"]).model_dump(mode="json")
    driver.check_run_dir(cfg, tmp_path, cfg.model_dump(mode="json"))  # the same run: resumed
    driver.check_run_dir(cfg, tmp_path, None)  # a new run
    with pytest.raises(ConfigError, match=rf"run.name: {tmp_path} is a run with other settings "
                                          r"\(inner.lr\); resume it with the same settings"):
        driver.check_run_dir(cfg, tmp_path, saved)
    (tmp_path / run_files.MODEL_DIR).mkdir()
    (tmp_path / run_files.MODEL_DIR / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files this run did not write \(notes.txt\)"):
        driver.check_run_dir(cfg, tmp_path, None)


def test_the_train_cli_refuses_a_resume_with_other_settings_before_ray(small_dataset, tmp_path,
                                                                       no_ray, capsys):
    args = TINY + [f"--data.path={small_dataset}", f"--run.storage_path={tmp_path}",
                   "--run.name=run"]
    (tmp_path / "run").mkdir()
    other = load_config(args + ["--inner.steps=4", "--scaling.cpus_per_worker=1"])
    (tmp_path / "run" / run_files.CONFIG).write_text(json.dumps(other.model_dump(mode="json")))
    assert train.main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: run.name: {tmp_path / 'run'} is a run with other settings (inner.steps); "
        "resume it with the same settings or choose another run.name")


def test_a_trial_gets_the_same_check_and_says_why_it_failed_in_one_line(small_dataset, tmp_path,
                                                                        monkeypatch):
    import ray.tune.integration.ray_train

    from isoloco_ray.grids.trainable import run_trial

    monkeypatch.setattr(ray.tune.integration.ray_train, "TuneReportCallback", lambda: None)
    args = TINY + [f"--data.path={small_dataset}", f"--run.storage_path={tmp_path}",
                   "--run.name=trial"]
    cfg = load_config(args)
    params = {"trial": {"name": "trial", "data_dir": str(small_dataset),
                        "config": cfg.model_dump(mode="json")}}
    run_dir = tmp_path / "trial"
    run_dir.mkdir()
    other = load_config(args + ["--outer.lr=0.5"]).model_dump(mode="json")
    (run_dir / run_files.CONFIG).write_text(json.dumps(other))
    with pytest.raises(ConfigError):
        run_trial(params)
    assert last_error_line((run_dir / run_files.ERROR).read_text()) == (
        f"isoloco_ray.config.loading.ConfigError: run.name: {run_dir} is a run with other "
        "settings (outer.lr); resume it with the same settings or choose another run.name")
    assert json.loads((run_dir / run_files.CONFIG).read_text()) == other  # left as it was

    # The workers stopped the run: no summary, and error.txt's last line says why.
    (run_dir / run_files.CONFIG).unlink()
    monkeypatch.setattr(driver, "fit", lambda *args, **kwargs: {
        "error": "every replica diverged", "rounds": 2})
    with pytest.raises(driver.RunFailed):
        run_trial(params)
    assert last_error_line((run_dir / run_files.ERROR).read_text()) == \
        "isoloco_ray.driver.RunFailed: the run stopped after round 2: every replica diverged"
    assert not (run_dir / run_files.SUMMARY).exists()
    assert (run_dir / run_files.CONFIG).exists()


def test_a_replica_run_starts_again_from_its_checkpoint_when_ray_trains_controller_fails(
        tmp_path, capsys):
    """Ray 2.60's controller fails when several workers are lost at once (issue 46, item 4):
    the attempt is made again, each time with a line saying so, at most run.max_failures
    times; not once the run's result is written, and never for a worker group's own error."""
    from ray.train import ControllerError, WorkerGroupError

    def failing(times: int, error: Exception):
        calls = []

        def attempt():
            calls.append(1)
            if len(calls) <= times:
                raise error
            return "done"
        return attempt, calls

    died = ControllerError(RuntimeError("The actor died unexpectedly before finishing this task."))
    attempt, calls = failing(2, died)
    assert driver.restarting_on_controller_errors(attempt, 3, tmp_path) == ("done", 2)
    lines = capsys.readouterr().err.splitlines()
    assert len(calls) == 3 and len(lines) == 2
    assert lines[1].startswith("warning: Ray Train's controller failed (The actor died "
                               "unexpectedly before finishing this task.)")
    assert lines[1].endswith("(restart 2 of 3, run.max_failures)")
    attempt, calls = failing(5, died)
    with pytest.raises(ControllerError):
        driver.restarting_on_controller_errors(attempt, 1, tmp_path)
    assert len(calls) == 2
    attempt, calls = failing(1, WorkerGroupError("rank 1 raised", {}))
    with pytest.raises(WorkerGroupError):
        driver.restarting_on_controller_errors(attempt, 3, tmp_path)
    assert len(calls) == 1
    (tmp_path / run_files.FT_END).write_text(json.dumps({"rounds": 3}))
    attempt, calls = failing(1, died)
    with pytest.raises(ControllerError):
        driver.restarting_on_controller_errors(attempt, 3, tmp_path)
    assert len(calls) == 1


def test_the_driver_and_a_grid_trial_load_no_model_stack():
    """The train CLI and every grid trial (a fresh Tune process each) import what the driver
    needs, the worker's entry function handed to Ray Train included, without transformers or
    the training loop: those load in the workers only (about 2 s of CPU per process here)."""
    import subprocess
    import sys

    probe = ("import sys\n"
             "import isoloco_ray.train, isoloco_ray.tune, isoloco_ray.driver\n"
             "import isoloco_ray.grids.trainable, isoloco_ray.workers.state.resume\n"
             "from isoloco_ray.workers.ray_entry import train_loop_per_worker\n"
             "print(sorted(m for m in ('transformers', 'isoloco_ray.workers.loop') "
             "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
