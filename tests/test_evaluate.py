"""`python -m isoloco_ray.evaluate`: the same loss as training's final evaluation, recorded in
the run's summary.json; model directories; every usage problem one `error:` line, exit 2."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from isoloco_ray import evaluate
from isoloco_ray.config import load_config
from isoloco_ray.data.format import DatasetMeta
from isoloco_ray.data.prepare.npy_import import prepare_from_npy
from isoloco_ray.driver import write_summary
from isoloco_ray.workers.local import run_local
from isoloco_ray.workers.model import build_model
from isoloco_ray.workers.replica import load_parameters
from isoloco_ray.workers.state.export import export_model

EVAL_TOKENS = 1500  # 23 sequences of 64: micro-batches of 2, the last one short


@pytest.fixture(scope="module")
def run_dir(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run, laid out as train.py leaves it: config.json, summary.json (from
    train.write_summary) and model/ (workers.export.export_model of the final parameters)."""
    storage = tmp_path_factory.mktemp("runs")
    cfg = load_config([
        "--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64",
        "--data.batch_size=4", "--data.micro_batch_size=2", "--scaling.replicas=2",
        "--scaling.replicas_per_worker=2", "--inner.steps=2", "--run.rounds=2",
        f"--run.eval_tokens={EVAL_TOKENS}", "--run.name=tiny", f"--run.storage_path={storage}"])
    final, params = run_local(cfg, small_dataset)
    run = storage / "tiny"
    run.mkdir()
    (run / "config.json").write_text(cfg.model_dump_json(indent=2))
    model = build_model(cfg.model, DatasetMeta.load(small_dataset).vocab_size, cfg.run.seed)
    load_parameters(model, params)
    export_model(model, small_dataset, run / "model")
    write_summary(cfg, final, small_dataset, run, seconds=1.0)
    return run


@pytest.fixture(scope="module")
def npy_datasets(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Path]:
    """Two datasets the run's model cannot be evaluated on as asked: one without a test
    split, one with a larger vocabulary."""
    root = tmp_path_factory.mktemp("npy")
    npy = root / "arrays"
    npy.mkdir()
    tokens = np.random.default_rng(0).integers(0, 384, 2000, dtype=np.uint16)
    np.save(npy / "train_000000.npy", tokens)
    np.save(npy / "valid_000000.npy", tokens[:500])
    tok = str(small_dataset / "tokenizer")
    prepare_from_npy(npy, root / "no_test", tokenizer=tok, block_len=64)
    prepare_from_npy(npy, root / "big_vocab", tokenizer=tok, block_len=64, vocab_size=1000)
    return {"no_test": root / "no_test", "big_vocab": root / "big_vocab"}


def summary_of(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_valid_split_gives_the_runs_final_eval_loss(run_dir: Path, small_dataset: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    before = summary_of(run_dir)
    assert evaluate.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    summary = summary_of(run_dir)
    key = evaluate.evaluation_key(small_dataset.resolve(), "valid", EVAL_TOKENS, 64)
    entry = summary["evaluations"][key]
    assert abs(entry["loss"] - before["final_eval_loss"]) <= 1e-6
    assert math.isclose(entry["perplexity"], math.exp(entry["loss"]))
    assert (entry["sequences"], entry["predicted_tokens"], entry["batch_size"]) == (
        23, 23 * 63, 2)
    assert entry["model_sha256"] == before["model_sha256"]  # the run's final parameters
    assert {k: v for k, v in summary.items() if k != "evaluations"} == before
    assert out.startswith(f"valid loss {entry['loss']:.6f} (ppl ")
    assert out.endswith(f"recorded in {run_dir / 'summary.json'} (evaluations)\n")

    # Another split and size is another entry; the same one again replaces its entry.
    assert evaluate.main([str(run_dir), "--split", "test", "--tokens", "640"]) == 0
    assert evaluate.main([str(run_dir), "--split", "test", "--tokens", "640"]) == 0
    evaluations = summary_of(run_dir)["evaluations"]
    assert sorted(evaluations) == sorted(
        [key, evaluate.evaluation_key(small_dataset.resolve(), "test", 640, 64)])


def test_a_model_directory_evaluates_alike_and_records_nothing(
        run_dir: Path, small_dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = summary_of(run_dir)["final_eval_loss"]
    before = (run_dir / "summary.json").read_text()
    # Seq_len defaults to the data's blocks (64), within the model's context (256).
    assert evaluate.main([str(run_dir / "model"), "--data", str(small_dataset),
                          "--tokens", str(EVAL_TOKENS), "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    loss = float(out.split()[2])
    assert abs(loss - final) <= 1e-6
    assert "23 sequences of 64 tokens (1,449 predictions)" in out
    assert (run_dir / "summary.json").read_text() == before


def test_an_unfinished_run_gets_no_summary(run_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A summary.json would mark the run finished: train.py would refuse to resume it."""
    run = tmp_path / "unfinished"
    shutil.copytree(run_dir, run)
    (run / "summary.json").unlink()
    assert evaluate.main([str(run), "--tokens", "128"]) == 0
    assert "not recorded: " in capsys.readouterr().out
    assert not (run / "summary.json").exists()


def error_cases(run_dir: Path, data: dict[str, Path], tmp: Path) -> dict[str, tuple[list, str]]:
    (tmp / "empty").mkdir()
    (tmp / "a_file").write_text("x")
    (tmp / "pickled").mkdir()
    (tmp / "pickled" / "pytorch_model.bin").write_bytes(b"")
    (tmp / "started").mkdir()
    shutil.copy(run_dir / "config.json", tmp / "started" / "config.json")
    moved = tmp / "moved"  # a run whose data is gone
    shutil.copytree(run_dir, moved)
    summary = json.loads((moved / "summary.json").read_text())
    (moved / "summary.json").write_text(json.dumps({**summary, "data_dir": str(tmp / "gone")}))
    model = str(run_dir / "model")
    cut = tmp / "cut"  # a model whose weights were copied only in part
    shutil.copytree(run_dir / "model", cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    return {
        "cut_short": ([str(cut), "--data", str(data["no_test"])],
                      f"cannot load the model in {cut}: its safetensors weights are damaged or "
                      "cut short ("),
        "missing": ([str(tmp / "nowhere")], f"RUN_OR_MODEL_DIR {tmp / 'nowhere'} does not exist"),
        "file": ([str(tmp / "a_file")], f"RUN_OR_MODEL_DIR {tmp / 'a_file'} is not a "
                                        "directory"),
        "neither": ([str(tmp / "empty")], f"RUN_OR_MODEL_DIR {tmp / 'empty'} is neither a run "
                                          "directory (model/ and config.json) nor a model "
                                          "directory (config.json and model.safetensors)"),
        "pickled": ([str(tmp / "pickled")], "holds only pickled weights (pytorch_model.bin), "
                                            "which are never loaded"),
        "unfinished": ([str(tmp / "started")], "is a run without a model yet"),
        "no_data": ([model], "--data: a model directory names no data; pass --data DIR"),
        "data_gone": ([str(moved)], f"--data: the run's data {tmp / 'gone'} is no longer a "
                                    "prepared dataset (no meta.json); pass --data DIR"),
        "not_data": ([model, "--data", str(tmp / "empty")],
                     f"--data: {tmp / 'empty'} is not a prepared dataset (no meta.json)"),
        "no_split": ([str(run_dir), "--data", str(data["no_test"]), "--split", "test"],
                     f"--split test: {data['no_test']} holds no test data (it has train, "
                     "valid); choose another --split or --data"),
        "vocab": ([str(run_dir), "--data", str(data["big_vocab"])],
                  f"--data: the vocabulary of {data['big_vocab']} (1000 tokens, meta.json) is "
                  "larger than the model's (384)"),
        "zero_tokens": ([str(run_dir), "--tokens", "0"], "--tokens must be a positive number, "
                                                         "got 0"),
        "negative_tokens": ([str(run_dir), "--tokens=-5"], "--tokens must be a positive number, "
                                                           "got -5"),
        "long_seq": ([str(run_dir), "--seq-len", "128"], "--seq-len 128 is longer than the "
                                                         "blocks of"),
        "device": ([str(run_dir), "--device", "tpu"], "--device tpu: use cpu or cuda"),
    }


def test_usage_problems_are_one_error_line_and_exit_2(
        run_dir: Path, npy_datasets: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    before = (run_dir / "summary.json").read_text()
    for name, (args, message) in error_cases(run_dir, npy_datasets, tmp_path).items():
        assert evaluate.main(args) == 2, name
        captured = capsys.readouterr()
        assert captured.out == "", name
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, captured.err)
        assert message in lines[0], (name, lines[0])
    assert (run_dir / "summary.json").read_text() == before


def test_the_module_runs_from_the_command_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "isoloco_ray.evaluate", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"error: RUN_OR_MODEL_DIR {tmp_path / 'x'} does not exist\n"


def test_cuda_asked_for_where_there_is_none(run_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert evaluate.main([str(run_dir), "--device", "cuda"]) == 2
    assert capsys.readouterr().err == ("error: --device cuda: CUDA is not available here; use "
                                       "--device cpu\n")
