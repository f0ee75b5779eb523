"""One real Ray Train run end to end: 2 workers, Ray Data streams, summary, metrics, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from isoloco_ray import train
from isoloco_ray.config import load_config
from isoloco_ray.data.format import split_files
from isoloco_ray.workers.evaluate import eval_sequences, evaluate

pytestmark = pytest.mark.ray


def test_two_worker_tiny_run_writes_summary_metrics_and_model(ray_cluster, small_dataset,
                                                              tmp_path, capsys):
    args = ["--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64",
            "--data.batch_size=4", "--scaling.replicas=4", "--scaling.replicas_per_worker=2",
            "--inner.steps=3", "--run.rounds=2", "--run.eval_every=1",
            "--run.eval_tokens=2048", f"--run.storage_path={tmp_path}", "--run.name=tiny"]
    assert train.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"summary: {tmp_path / 'tiny' / 'summary.json'}"
    assert sum(line.startswith("round ") for line in out) == 3  # initial eval + 2 rounds

    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    cfg = load_config(args)
    assert summary["strategy"] == "diloco" and summary["replicas"] == 4
    assert summary["rounds"] == 2 and summary["tokens"] == 2 * cfg.tokens_per_round
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    # Cost model: one all-reduce of every parameter (float32) over 2 ranks: 2(W-1)/W·S = S.
    assert summary["outer_bytes_per_round"] == 4 * summary["num_parameters"]
    metrics = [json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").open()]
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert metrics[-1]["eval_loss"] == summary["final_eval_loss"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(summary["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir)("to be or not").input_ids
    assert sum(p.numel() for p in model.parameters()) == summary["num_parameters"]
    sequences = eval_sequences(split_files(small_dataset, "valid"), 64, 2048)
    loss = evaluate(model, sequences, rank=0, world=1, batch_size=4, device=torch.device("cpu"))
    assert loss == pytest.approx(summary["final_eval_loss"], abs=1e-4)

    # The same name again is refused rather than overwriting a finished run.
    assert train.main(args) == 2
    assert "already holds a finished run" in capsys.readouterr().err
