"""run.storage_path on S3: a real S3-compatible server (moto's) on loopback, real Ray runs.

Config, metrics, summary, checkpoints (Ray Train's, and a resume from them that skips a damaged
one, rebuilds an emptied record of them, or stops naming every damaged file), the exported
model (evaluated from there), a grid on data in the bucket, and reports all live in the
bucket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from upath import UPath

from helpers import truncate
from isoloco_ray import evaluate, report, storage, train, tune
from isoloco_ray.config import ConfigError
from isoloco_ray.workers.state import resume


def test_location_keeps_uris_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.location("runs") == tmp_path / "runs"
    assert isinstance(storage.location("runs"), Path)
    assert storage.location("file://" + str(tmp_path / "x")) == tmp_path / "x"
    remote = storage.location("s3://bucket/prefix/runs")
    assert str(remote / "name") == "s3://bucket/prefix/runs/name"
    assert not isinstance(remote, Path) and isinstance(storage.location("runs"), Path)
    with pytest.raises(ConfigError, match=r"^run.storage_path: cannot open nosuch://x/y \("):
        storage.location("nosuch://x/y")


def test_check_writable_on_s3(s3_bucket):
    path = storage.check_writable(f"s3://{s3_bucket}/runs")
    assert isinstance(path, UPath) and str(path) == f"s3://{s3_bucket}/runs"
    assert list(UPath(f"s3://{s3_bucket}").iterdir()) == []  # the probe is gone
    with pytest.raises(ConfigError, match=r"^run.storage_path: cannot write to "
                                          r"s3://no-such-bucket-here/runs \("):
        storage.check_writable("s3://no-such-bucket-here/runs")


def test_upload_directory(s3_bucket, tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    destination = UPath(f"s3://{s3_bucket}/model")
    storage.upload_directory(tmp_path, destination)
    assert (destination / "a.txt").read_text() == "a"
    assert (destination / "sub" / "b.txt").read_text() == "b"


def test_a_run_on_s3_writes_everything_there_and_resumes_from_it(ray_cluster, small_dataset,
                                                                   s3_bucket, capsys):
    """A run stored in the bucket; then, made resumable again (summary.json removed): with
    every checkpoint damaged it stops at once with the files named (no restarts); with the
    newest damaged and Ray Train's record of them emptied (as a write of it on a full disk
    leaves it), the record is rebuilt and the run resumes from the older checkpoint there and
    ends bit-identical. (The same on local storage, and each kind of damage: test_checkpoint's
    one-process tests of the same functions.)"""
    storage_path = f"s3://{s3_bucket}/runs"
    args = ["--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64",
            "--data.batch_size=4", "--scaling.replicas=2", "--scaling.replicas_per_worker=2",
            "--inner.steps=2", "--run.rounds=3", "--run.checkpoint_every=1",
            "--run.eval_every=3", "--run.eval_tokens=512", f"--run.storage_path={storage_path}",
            "--run.name=s3run"]
    run_dir = UPath(storage_path) / "s3run"
    assert train.main(args) == 0
    assert f"summary: {run_dir / 'summary.json'}" in capsys.readouterr().out
    whole = json.loads((run_dir / "summary.json").read_text())
    assert whole["run_dir"] == str(run_dir) and whole["model_dir"] == str(run_dir / "model")
    assert json.loads((run_dir / "config.json").read_text())["run"]["storage_path"] == \
        storage_path
    rounds = [json.loads(line)["round"]
              for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3]
    model_files = {path.name for path in (run_dir / "model").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= model_files
    checkpoints = sorted((path for path in run_dir.iterdir()
                          if path.name.startswith("checkpoint_") and path.is_dir()),
                         key=lambda path: path.name, reverse=True)
    assert len(checkpoints) == 2  # run.keep_checkpoints

    (run_dir / "summary.json").unlink()
    capsys.readouterr()
    newest, older = checkpoints
    truncate(newest / "global.safetensors")
    state = (older / "state.json").read_text()
    (older / "state.json").write_text("junk")
    assert train.main(args) == 1
    err = capsys.readouterr().err
    assert "error: the run stopped: no intact checkpoint to resume from: " \
        f"checkpoint {newest} is damaged: {newest / 'global.safetensors'}: not a complete" in err
    assert f"{older / 'state.json'}: not valid JSON" in err and f"delete {run_dir}" in err

    (older / "state.json").write_text(state)
    (run_dir / resume.RAY_RECORD).write_text("")
    assert train.main(args) == 0
    err = capsys.readouterr().err
    assert f"warning: checkpoint {newest} is damaged" in err
    assert f"note: Ray Train's record of this run's checkpoints ({run_dir / resume.RAY_RECORD})" \
        " was unusable: it is empty" in err
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resume_warning"].startswith(
        f"warning: checkpoint {newest} is damaged: {newest / 'global.safetensors'}: not a "
        "complete safetensors file")
    assert f"resuming from the older checkpoint {older} (round 2) instead" in \
        resumed["resume_warning"]
    assert resumed["model_sha256"] == whole["model_sha256"]

    assert evaluate.main([str(run_dir), "--tokens=512"]) == 0  # the model, copied down once
    evaluations = json.loads((run_dir / "summary.json").read_text())["evaluations"]
    assert [entry["loss"] for entry in evaluations.values()] == \
        [pytest.approx(resumed["final_eval_loss"], abs=1e-6)]

    assert report.main([str(run_dir)]) == 0
    assert "\ns3run,diloco,5.39" in (run_dir / "results.csv").read_text()
    assert (run_dir / "eval_loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_grid_on_s3_with_data_there(ray_cluster, s3_data, s3_bucket, tmp_path, capsys):
    grid = {"name": "s3grid",
            "base": {"model": {"preset": "tiny"},
                     "data": {"path": s3_data, "seq_len": 64, "batch_size": 4},
                     "scaling": {"replicas": 2, "replicas_per_worker": 2},
                     "inner": {"steps": 2},
                     "run": {"rounds": 1, "eval_every": 1, "eval_tokens": 512,
                             "storage_path": f"s3://{s3_bucket}/grids"}},
            "grid": {"outer.strategy": ["isoc"]}}  # one trial shows it all
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    assert tune.main([str(path)]) == 0
    grid_dir = UPath(f"s3://{s3_bucket}/grids/s3grid")
    assert f"table: {grid_dir / 'results.md'}" in capsys.readouterr().out
    names = [trial["name"] for trial in json.loads((grid_dir / "grid.json").read_text())[
        "trials"]]
    assert len(names) == 1
    for name in names:
        summary = json.loads((grid_dir / "runs" / name / "summary.json").read_text())
        assert summary["rounds"] == 1
    table = (grid_dir / "results.csv").read_text()
    assert all(name in table for name in names)
