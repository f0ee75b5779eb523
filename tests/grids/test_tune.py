"""Grids with Ray Tune: expansion, up-front validation, one real grid, W&B offline."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil

import pytest
import yaml

from helpers import TUNE_CONFIGS, write_grid
from isoloco_ray import tune
from isoloco_ray.config import TrainConfig, load_config
from isoloco_ray.grids.expand import build_trials
from isoloco_ray.grids.spec import load_grid_file
from isoloco_ray.grids import plan as plan_module



def test_dry_run_crosses_trials_with_the_grid(tmp_path, small_dataset, capsys, no_ray):
    path = write_grid(tmp_path, small_dataset, name="sweep",
                      grid={"inner.lr": [1e-3, 2e-3]},
                      trials=[{"outer.strategy": "diloco"},
                              {"outer": {"strategy": "isoc", "lr": 1.5}}])
    assert tune.main([str(path), "--dry-run", "--run.rounds=3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"grid sweep: 4 trials -> {tmp_path / 'grids' / 'sweep'}"
    names = [line.split()[0] for line in out[1:]]
    assert names == ["0-diloco-inner.lr=0.001", "1-diloco-inner.lr=0.002",
                     "2-isoc-inner.lr=0.001", "3-isoc-inner.lr=0.002"]
    assert "3 rounds x H=3" in out[1] and "outer lr 1.5" in out[3]
    assert out[4].endswith("R=2 on 1 worker, 3 rounds x H=3, 4,608 tokens, inner lr 0.002, "
                           "outer lr 1.5 | outer.lr=1.5, outer.strategy=isoc, inner.lr=0.002")
    assert not (tmp_path / "grids").exists()  # a dry run writes nothing


@pytest.mark.parametrize("sections, args, message", [
    ({"grid": {"outer.strategy": ["diloco", "tsv"]}, "trials": [{"outer.keep_fraction": 0.5}]},
     [], "trial 0 (outer.keep_fraction=0.5, outer.strategy=diloco): outer.keep_fraction does "
         "not apply to outer.strategy 'diloco'"),
    ({"grid": {"inner.lrr": [1e-3]}}, [], "grid.yaml: grid: unknown field 'inner.lrr'; did "
                                          "you mean inner.lr?"),
    ({"grid": {"inner.lr": [1e-3]}}, ["--inner.lr=0.1"], "--inner.lr: the grid varies this "
                                                         "field"),
    ({"grid": {"inner.lr": [1e-3]}, "trials": [{"inner.lr": 0.1}]}, [],
     "trials[0] sets inner.lr, which grid: varies too"),
    ({"grids": {"inner.lr": [1e-3]}}, [], "grids: unknown field"),
    ({"grid": {"scaling.replicas": [2, 256], "scaling.replicas_per_worker": [2]}}, [],
     "trial 1 (scaling.replicas=256, scaling.replicas_per_worker=2): data.batch_size (4) is "
     "more than the 3 sequences"),
    ({"grid": {"run.wandb.project": ["x"]}}, ["--run.wandb.mode=offline"], None),
    # Axes the grid would overwrite or ignore.
    ({"grid": {"run.storage_path": ["/tmp/a", "/tmp/b"]}}, [],
     "grid.yaml: grid: run.storage_path is set by the grid (every trial runs in <grid>/runs); "
     "set it in base: or with --run.storage_path"),
    ({"grid": {"scaling.fault_tolerance": ["restart", "replica"]}},
     ["--scaling.replicas_per_worker=1"],
     "trial 1 (scaling.fault_tolerance=replica): scaling.fault_tolerance: replica does not run "
     "in a grid (Tune needs every worker's reports); run it alone with python -m "
     "isoloco_ray.train, or use restart"),
    ({"trials": [{"run.num_cpus": 4}, {"run.num_cpus": 8}]}, [],
     "trial 1 (run.num_cpus=8): run.num_cpus must be the same for every trial of a grid; set "
     "it in base:"),
])
def test_grid_errors_name_trial_and_field(tmp_path, small_dataset, capsys, no_ray, monkeypatch,
                                          sections, args, message):
    if message is None:  # W&B asked for but not installed
        monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
        message = "trial 0 (run.wandb.project=x): run.wandb.project is set but the wandb " \
                  "package is not installed; pip install 'isoloco_ray[wandb]'"
    path = write_grid(tmp_path, small_dataset, **sections)
    assert tune.main([str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("path", sorted(TUNE_CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_grid_file_is_valid(tmp_path, monkeypatch, path):
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    trials = build_trials(load_grid_file(path), {}, tmp_path)
    assert trials
    for trial in trials:
        assert TrainConfig.model_validate(trial.config.model_dump(mode="json")) == trial.config


def test_shipped_grids_expand_to_valid_trials(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    strategies = {}
    for name in ("demo_strategies", "paper_178m_main", "paper_178m_merging", "paper_512m_main"):
        trials = build_trials(load_grid_file(TUNE_CONFIGS / f"{name}.yaml"), {}, tmp_path)
        strategies[name] = [t.config.outer.strategy for t in trials]
        for trial in trials:
            cfg = trial.config
            # What a trial's workers receive: the resolved config, validated again.
            assert TrainConfig.model_validate(cfg.model_dump(mode="json")) == cfg
            assert cfg.scaling.replicas == 8
            if name != "demo_strategies":
                assert cfg.scaling.use_gpu and cfg.data.seq_len == 2048
                assert cfg.model.vocab_size == 32000 and cfg.inner.steps == 30
                assert cfg.data.path == str(tmp_path / "llama2_2048")
    assert strategies["demo_strategies"] == ["adamw_ddp", "diloco", "diloco_sgd", "isoc",
                                             "isoloco", "isocts", "tsv", "ties", "dare"]
    assert strategies["paper_178m_main"] == ["adamw_ddp", "diloco", "diloco_sgd", "isoc",
                                             "isoloco"]
    assert strategies["paper_178m_merging"] == ["ties", "dare", "tsv", "isocts"]
    assert strategies["paper_512m_main"] == ["adamw_ddp", "diloco", "isoloco"]
    # 178M: rounds = budget // (32 x 2048 x 30 x 8); 512M DiLoCo: batch 128.
    main = build_trials(load_grid_file(TUNE_CONFIGS / "paper_178m_main.yaml"), {}, tmp_path)
    assert {t.config.run.rounds for t in main} == {3552440320 // (32 * 2048 * 30 * 8)}
    adamw = main[0].config
    assert (adamw.inner.lr, adamw.inner.weight_decay, adamw.inner.clip) == (1.95e-3, 0.15, None)
    big = build_trials(load_grid_file(TUNE_CONFIGS / "paper_512m_main.yaml"), {}, tmp_path)
    assert [t.config.inner.lr for t in big] == [2.76e-3, 6.91e-4, 1.38e-3]
    assert [t.config.data.batch_size for t in big] == [32, 128, 128]


def test_wandb_single_run_logger_works_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from isoloco_ray.wandb_log import RunLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert RunLogger(load_config([]), tmp_path).run is None  # no project: W&B untouched
    cfg = load_config(["--run.wandb.project=isoloco-test", "--run.name=offline-run"])
    with RunLogger(cfg, tmp_path) as logger:
        logger.log({"round": 0, "tokens": 0, "eval_loss": 6.0})
        logger.log({"round": 1, "tokens": 100, "loss": 5.5, "eval_loss": 5.4})
        logger.finish({"final_eval_loss": 5.4})
    runs = list((tmp_path / "wandb").glob("offline-run-*-offline-run"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_real_grid_runs_trials_records_a_failure_and_resumes(ray_cluster, small_dataset,
                                                             tmp_path, capsys, monkeypatch):
    # The second trial's data loses its shards after validation (as when shared storage
    # fails): it fails inside its trial and the grid carries on. (Two trials only: each
    # concurrent trial slows the others on 2 cores; test_report checks the ranking.)
    broken = tmp_path / "broken"
    shutil.copytree(small_dataset, broken)
    validate = plan_module.validate_against_data

    def validate_then_break(trials, *args):
        validate(trials, *args)
        for shard in (broken / "train").glob("*.parquet"):
            shard.unlink()
    monkeypatch.setattr(plan_module, "validate_against_data", validate_then_break)
    wandb_installed = importlib.util.find_spec("wandb") is not None
    base_extra = {}
    if wandb_installed:
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        base_extra = {"wandb": {"project": "isoloco-test"}}
    path = write_grid(tmp_path, small_dataset, name="real",
                      trials=[{"outer.strategy": "diloco"},
                              {"outer.strategy": "diloco_sgd", "data.path": str(broken)}],
                      resources={"trial_cpus": 0.5, "max_concurrent": 2})
    grid = yaml.safe_load(path.read_text())
    grid["base"]["scaling"]["cpus_per_worker"] = 0.5
    grid["base"]["run"].update(base_extra)
    path.write_text(yaml.safe_dump(grid))

    assert tune.main([str(path)]) == 1  # one trial failed
    out = capsys.readouterr().out
    grid_dir = tmp_path / "grids" / "real"
    assert "up to 2 at once" in out
    assert "0-diloco: round    2/2" in out and "0-diloco: done, final eval loss" in out
    assert "1-diloco_sgd: FAILED:" in out

    rows = list(csv.DictReader((grid_dir / "results.csv").open()))
    assert [r["status"] for r in rows] == ["done", "failed"]
    run_dir = grid_dir / "runs" / "0-diloco"
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert summary["final_eval_loss"] == metrics[-1]["eval_loss"]
    assert summary["strategy"] == "diloco"
    error = (grid_dir / "runs" / "1-diloco_sgd" / "error.txt").read_text()
    assert f"cannot read shard {broken / 'train'}" in error and "is missing or damaged" in error
    best = load_config([str(grid_dir / "best_config.yaml")])
    assert best.outer.strategy == rows[0]["strategy"] and best.run.name is None
    if importlib.util.find_spec("matplotlib"):
        assert (grid_dir / "eval_loss.png").stat().st_size > 0
    if wandb_installed:  # one offline W&B run per trial, in Tune's trial directories
        assert list((grid_dir / "tune" / "0-diloco" / "wandb").glob("offline-run-*"))

    # The same grid again is refused, and so is resuming it with other settings; --resume
    # keeps finished and failed trials (the data is back, and validated again): nothing is
    # left to run (test_grid_safety runs an unfinished trial on resume).
    monkeypatch.setattr(plan_module, "validate_against_data", validate)
    shutil.copytree(small_dataset / "train", broken / "train", dirs_exist_ok=True)
    assert tune.main([str(path)]) == 2
    assert "already holds a grid; continue it with --resume" in capsys.readouterr().err
    assert tune.main([str(path), "--resume", "--run.rounds=3"]) == 2
    assert "the grid's trials changed" in capsys.readouterr().err
    finished = (grid_dir / "runs" / "0-diloco" / "summary.json").stat().st_mtime
    assert tune.main([str(path), "--resume"]) == 1
    assert (grid_dir / "runs" / "0-diloco" / "summary.json").stat().st_mtime == finished
    out = capsys.readouterr().out
    assert "every trial has finished, failed or been stopped early; nothing to resume" in out
    assert "| 0-diloco | diloco |" in out and "1 of 2 trials are not done: 1 failed" in out
    assert not (grid_dir / "tune-resume-1").exists()


def test_resume_needs_a_grid_to_resume(tmp_path, small_dataset, capsys, no_ray):
    path = write_grid(tmp_path, small_dataset, name="fresh")
    assert tune.main([str(path), "--resume"]) == 2
    assert "holds no grid to resume" in capsys.readouterr().err
