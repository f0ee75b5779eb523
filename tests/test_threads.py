"""Threads per worker: scaling.cpus_per_worker's default, torch's threads, the start line.
No Ray here (the real run's threads are checked in tests/test_ray_train.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from isoloco_ray import train
from isoloco_ray.config import ScalingConfig, load_config
from isoloco_ray.train import resolve_cpus_per_worker, start_line


def layout(replicas: int, per_worker: int, cpus: float | None = None) -> ScalingConfig:
    return ScalingConfig(replicas=replicas, replicas_per_worker=per_worker,
                         cpus_per_worker=cpus)


def test_the_field_is_unset_by_default():
    assert load_config([]).scaling.cpus_per_worker is None


@pytest.mark.parametrize(("replicas", "per_worker", "cores", "expected"), [
    (4, 2, 2, 1.0),    # the demo on 2 cores: 2 workers x 1
    (8, 8, 2, 2.0),    # one worker gets both cores
    (8, 4, 16, 8.0),
    (3, 1, 16, 5.0),   # 16 // 3
    (8, 2, 2, 1.0),    # more workers than cores: still at least 1 each
    (4, 1, 1, 1.0),
])
def test_a_local_cluster_gives_each_worker_its_share_of_the_cores(replicas, per_worker, cores,
                                                                  expected):
    assert resolve_cpus_per_worker(layout(replicas, per_worker), local=True,
                                   cores=cores) == expected


def test_a_fixed_local_cluster_keeps_a_cpu_for_the_data_readers():
    # 2 workers on 16 cores would take 8 each, but a cluster of 6 logical CPUs holds 2 x 2 + 1.
    assert resolve_cpus_per_worker(layout(4, 2), local=True, cores=16, cluster_cpus=6) == 2.0
    assert resolve_cpus_per_worker(layout(4, 2), local=True, cores=16, cluster_cpus=4) == 1.0
    # Never below 1: start_ray then refuses the run, naming run.num_cpus.
    assert resolve_cpus_per_worker(layout(4, 2), local=True, cores=16, cluster_cpus=2) == 1.0
    assert resolve_cpus_per_worker(layout(4, 2), local=True, cores=2, cluster_cpus=64) == 1.0


def test_a_joined_cluster_reserves_one_cpu_per_worker_unless_told():
    assert resolve_cpus_per_worker(layout(8, 1), local=False, cores=64) == 1.0


@pytest.mark.parametrize("local", [True, False])
@pytest.mark.parametrize("cpus", [0.5, 1.0, 3.0, 12.0])
def test_an_explicit_value_is_kept(local, cpus):
    assert resolve_cpus_per_worker(layout(4, 2, cpus), local=local, cores=2,
                                   cluster_cpus=4) == cpus


@pytest.mark.parametrize(("cpus", "threads"), [(None, 1), (0.5, 1), (1.0, 1), (2.0, 2),
                                               (2.7, 2), (8.0, 8)])
def test_torch_threads_are_the_whole_cpus_at_least_one(cpus, threads):
    assert layout(4, 2, cpus).torch_threads == threads


def test_the_run_resolves_for_its_cluster(monkeypatch):
    """with_cpus_per_worker, as main calls it: RAY_ADDRESS decides local or joined, a running
    cluster or run.num_cpus caps the share, a resumed run keeps its value."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(train, "running_cluster_cpus", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config([])  # R = 4, V = 2: 2 workers
    assert train.with_cpus_per_worker(cfg).scaling.cpus_per_worker == 4.0
    assert train.with_cpus_per_worker(load_config(["--run.num_cpus=7"])
                                      ).scaling.cpus_per_worker == 3.0
    monkeypatch.setattr(train, "running_cluster_cpus", lambda: 4.0)
    assert train.with_cpus_per_worker(cfg).scaling.cpus_per_worker == 1.0
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    assert train.with_cpus_per_worker(cfg).scaling.cpus_per_worker == 1.0
    explicit = load_config(["--scaling.cpus_per_worker=0.5"])
    assert train.with_cpus_per_worker(explicit).scaling.cpus_per_worker == 0.5
    saved = {"scaling": {"cpus_per_worker": 2.0}}
    assert train.with_cpus_per_worker(cfg, saved).scaling.cpus_per_worker == 2.0
    assert train.with_cpus_per_worker(explicit, saved).scaling.cpus_per_worker == 0.5
    assert cfg.scaling.cpus_per_worker is None  # resolved in a copy


def test_the_start_line_says_workers_and_threads():
    data = Path("/data/demo")
    cfg = load_config(["--scaling.cpus_per_worker=2"])
    assert start_line(cfg, data) == ("isoloco_ray: diloco, R=4 on 2 workers x 2 threads, "
                                     "model demo, 12 rounds x H=20, data /data/demo")
    one = load_config(["--scaling.replicas=8", "--scaling.replicas_per_worker=8",
                       "--scaling.cpus_per_worker=1", "--outer.strategy=isoloco"])
    assert start_line(one, data).startswith("isoloco_ray: isoloco, R=8 on 1 worker x 1 "
                                            "thread, model demo")
    muon = load_config(["--scaling.cpus_per_worker=2", "--inner.optimizer=muon"])
    assert start_line(muon, data) == ("isoloco_ray: diloco, R=4 on 2 workers x 2 threads, "
                                      "model demo, 12 rounds x H=20 (inner Muon+AdamW), data "
                                      "/data/demo")


def test_a_cluster_too_small_for_the_default_is_refused_before_ray(small_dataset, tmp_path,
                                                                   monkeypatch, capsys):
    """The default never takes the readers' CPU; run.num_cpus too small for one CPU per
    worker plus one is refused as before, naming the fix."""
    import ray

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **_: pytest.fail("Ray must not start"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = [f"--data.path={small_dataset}", "--data.seq_len=64", "--run.rounds=1",
            "--run.num_cpus=2", f"--run.storage_path={tmp_path}", "--run.name=full"]
    assert train.main(args) == 2
    assert ("run.num_cpus (2) leaves no CPU for Ray Data's readers beside 2 workers x "
            "scaling.cpus_per_worker (1); raise run.num_cpus to at least 3") in \
        capsys.readouterr().err
