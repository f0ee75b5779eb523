"""A multi-node Ray cluster on this machine (ray.cluster_utils.Cluster): lose a node mid-run
and go on with fewer workers, then gain one and grow again, to the model the uninterrupted
run makes."""

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


def node_change(data_dir: Path, out_dir: Path, *options: str) -> dict:
    """benchmarks/node_loss.py's JSON line (`options` last: they override MATH); the run must
    have succeeded."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "node_loss.py"),
                          str(data_dir), str(out_dir), *MATH, *options],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == 0, out.stdout[-3000:]
    return result


def assert_same_model(result: dict, model_dir: Path, data_dir: Path, *options: str) -> None:
    """The run's final eval loss and exported model are the uninterrupted 2-worker run's,
    within float tolerance (the outer sum runs in another order on one worker)."""
    cfg = load_config(MATH + ["--scaling.replicas=2", "--scaling.replicas_per_worker=1",
                              "--scaling.cpus_per_worker=1", *options])
    whole, whole_params = run_local(cfg, data_dir, workers=2)
    assert result["summary"]["final_eval_loss"] == pytest.approx(whole["final_eval_loss"],
                                                                 abs=1e-5)
    exported = load_file(model_dir / "model.safetensors")
    shared = set(exported) & set(whole_params)
    assert len(shared) >= len(whole_params) - 1  # the tied head may be saved once
    for name in shared:
        torch.testing.assert_close(exported[name], whole_params[name], rtol=0, atol=1e-5)


@pytest.mark.multinode
def test_losing_a_node_then_gaining_one_resizes_the_run_and_keeps_the_math(
        own_ray, small_dataset, tmp_path, monkeypatch):
    """2 workers on 2 one-CPU nodes (R = 2, min_workers 1). A worker's node is removed after the
    second checkpoint: the run restarts from its latest checkpoint on the one worker left,
    which hosts both replicas. Two rounds later a new node joins: at its next resize check Ray
    Train restarts the run from the latest checkpoint on two workers, one replica each. The
    model is the uninterrupted 2-worker run's (within float tolerance: the outer sum runs in
    another order on one worker). One cluster and one run for both changes."""
    # More, shorter rounds: the resize comes on a timer (here a check every 2 s, then a
    # restart), and the run must still be going when it does, on a fast machine too (rounds
    # of 0.4 s: the grow, after round 5 or so, is in place by round 11).
    monkeypatch.setenv("ISOLOCO_RAY_RESIZE_CHECK_SECONDS", "2")
    longer = ("--run.rounds=16", "--inner.steps=30")
    result = node_change(small_dataset, tmp_path, "--shrink-then-grow", *longer)
    shrink, grow = result["changes"]
    assert shrink["change"] == "remove" and grow["change"] == "add"
    assert (shrink["workers_before"], shrink["nodes_before"]) == (2, 2)
    assert shrink["workers_after"] == 1 and shrink["recovery_seconds"] is not None
    assert shrink["node"] not in shrink["placement_after"]
    assert grow["workers_before"] == 1
    assert grow["workers_after"] == 2 and grow["recovery_seconds"] is not None
    assert grow["node"] in grow["placement_after"]
    assert result["summary"]["rounds"] == 16 and result["summary"]["workers"] == 2
    assert_same_model(result, tmp_path / "node-loss" / "model", small_dataset, *longer)
