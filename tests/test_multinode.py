"""A multi-node Ray cluster on this machine (ray.cluster_utils.Cluster): lose a node mid-run
and go on with fewer workers, to the model the uninterrupted run makes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from isoloco_ray.config import load_config
from isoloco_ray.workers.local import run_local

ROOT = Path(__file__).resolve().parents[1]
MATH = ["--model.preset=tiny", "--inner.steps=60", "--run.rounds=8", "--data.seq_len=64",
        "--data.batch_size=4", "--run.eval_tokens=512", "--run.eval_every=4"]


@pytest.mark.ray
@pytest.mark.multinode
def test_losing_a_node_shrinks_the_run_and_keeps_the_math(small_dataset, tmp_path):
    """2 workers on 2 one-CPU nodes (R = 2, min_workers 1); a worker's node is removed after
    the second checkpoint. The run restarts from its latest checkpoint on the one worker left,
    which hosts both replicas, and ends with the uninterrupted 2-worker run's model (within
    float tolerance: the outer sum runs in another order on one worker)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "node_loss.py"),
                          str(small_dataset), str(tmp_path), *MATH],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == 0, out.stdout[-3000:]
    assert (result["workers_before"], result["nodes_before"]) == (2, 2)
    assert result["workers_after"] == 1 and result["recovery_seconds"] is not None
    assert result["removed"] not in result["placement_after"]
    summary = result["summary"]
    assert summary["rounds"] == 8 and summary["workers"] == 1
    cfg = load_config(MATH + ["--scaling.replicas=2", "--scaling.replicas_per_worker=1",
                              "--scaling.cpus_per_worker=1"])
    whole, whole_params = run_local(cfg, small_dataset, workers=2)
    assert summary["final_eval_loss"] == pytest.approx(whole["final_eval_loss"], abs=1e-5)
    exported = load_file(tmp_path / "node-loss" / "model" / "model.safetensors")
    shared = set(exported) & set(whole_params)
    assert len(shared) >= len(whole_params) - 1  # the tied head may be saved once
    for name in shared:
        torch.testing.assert_close(exported[name], whole_params[name], rtol=0, atol=1e-5)
