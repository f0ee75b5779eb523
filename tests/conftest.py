"""Shared fixtures: a small real dataset (prepared once per session) and one Ray cluster."""

from __future__ import annotations

import os

import pytest

from isoloco_ray.testing import synthetic_documents

# Ray reads these when it starts; quiet and fast for tests (docs/design.md, "Ray specifics").
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION", "0")


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """A prepared dataset (format.py): BPE vocab 384, blocks of 64 tokens, 16 blocks a shard."""
    from isoloco_ray.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "small"
    prepare_dataset(synthetic_documents(600), out, vocab_size=384, block_len=64,
                    shard_blocks=16, valid_fraction=0.05, test_fraction=0.02, seed=0,
                    source_name="synthetic test text")
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session, more logical CPUs than cores, started the
    way train.py starts one (loopback only, token auth)."""
    import ray
    import ray.data

    from isoloco_ray.local_ray import start_local_cluster

    # With the dashboard, as tune.py starts its clusters (Ray Train's placement group cleaner
    # needs its state API).
    start_local_cluster(4, object_store_memory=512 * 1024**2, include_dashboard=True)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a test module, restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the train or tune CLI gets as far as starting Ray."""
    from isoloco_ray import train, tune

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(train, "start_ray", refuse)
    monkeypatch.setattr(tune, "start_cluster", refuse)
