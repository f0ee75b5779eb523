"""Checkpoints: exact resume, what a checkpoint holds, hashes, and replicas that diverge."""

from __future__ import annotations

import math

import pytest
import torch

from isoloco_ray.config import load_config
from isoloco_ray.workers import checkpoint
from isoloco_ray.workers.local import StopAfterRound, run_local
from isoloco_ray.workers.outer_sync import OuterSync
from isoloco_ray.workers.replica import Replica

RUN = ["--model.preset=tiny", "--scaling.replicas=2", "--scaling.replicas_per_worker=2",
       "--inner.steps=2", "--run.rounds=4", "--run.checkpoint_every=2", "--data.seq_len=64",
       "--data.batch_size=4", "--run.eval_tokens=512", "--run.eval_every=2"]


@pytest.mark.parametrize("strategy", ["diloco", "dare", "tsv"])
def test_interrupted_and_resumed_run_is_bit_identical(small_dataset, tmp_path, strategy):
    cfg = load_config(RUN + [f"--outer.strategy={strategy}"])
    whole, whole_params = run_local(cfg, small_dataset)

    with pytest.raises(StopAfterRound):  # dies after round 3: round 3's work is lost
        run_local(cfg, small_dataset, checkpoints=tmp_path, stop_after=3)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["round_000002"]
    resumed, resumed_params = run_local(cfg, small_dataset,
                                        restore_from=tmp_path / "round_000002")

    for name in whole_params:
        assert torch.equal(resumed_params[name], whole_params[name]), name
    assert resumed["model_sha256"] == whole["model_sha256"]
    assert resumed["initial_eval_loss"] == whole["initial_eval_loss"]
    assert resumed["final_eval_loss"] == whole["final_eval_loss"]


def test_checkpoint_holds_every_replica_and_loads_without_pickle(small_dataset, tmp_path):
    cfg = load_config(RUN + ["--run.rounds=2"])
    run_local(cfg, small_dataset, checkpoints=tmp_path)
    directory = tmp_path / "round_000002"
    assert sorted(p.name for p in directory.iterdir()) == [
        "global.safetensors", "outer_0000.safetensors", "replica_0000.pt", "replica_0001.pt",
        "rng.safetensors", "state.json"]
    params, outer_state, state = checkpoint.load_shared(directory)
    assert state["round"] == 2 and outer_state["step"] == 2
    assert set(outer_state["buffers"]) == set(params)  # diloco keeps a momentum buffer each
    replica = checkpoint.load_replica(directory, 1)  # torch.load(weights_only=True)
    assert replica["stream"] == {"epoch": 0, "sequences": 2 * 2 * 4}
    assert replica["schedule"]["last_epoch"] == 4


def test_resume_with_other_settings_is_refused(small_dataset, tmp_path):
    cfg = load_config(RUN + ["--run.rounds=2"])
    run_local(cfg, small_dataset, checkpoints=tmp_path)
    other = load_config(RUN + ["--run.rounds=2", "--inner.lr=1e-2"])
    with pytest.raises(ValueError, match=r"different settings: inner.lr"):
        run_local(other, small_dataset, restore_from=tmp_path / "round_000002")


def test_incomplete_checkpoint_is_reported(small_dataset, tmp_path):
    cfg = load_config(RUN + ["--run.rounds=2"])
    run_local(cfg, small_dataset, checkpoints=tmp_path)
    (tmp_path / "round_000002" / "replica_0001.pt").unlink()
    with pytest.raises(FileNotFoundError, match="incomplete: missing replica_0001.pt"):
        run_local(cfg, small_dataset, restore_from=tmp_path / "round_000002")


def test_parameters_hash_is_order_independent_and_sensitive():
    a = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    b = {"b": torch.ones(3), "w": torch.arange(6.0).reshape(2, 3)}
    assert checkpoint.parameters_sha256(a) == checkpoint.parameters_sha256(b)
    b["w"][0, 0] = 1e-30
    assert checkpoint.parameters_sha256(a) != checkpoint.parameters_sha256(b)
    reshaped = {"w": torch.arange(6.0).reshape(3, 2), "b": torch.ones(3)}
    assert checkpoint.parameters_sha256(a) != checkpoint.parameters_sha256(reshaped)


@pytest.mark.parametrize("strategy", ["diloco", "tsv"])
def test_a_nan_replica_is_left_out_of_the_merge(strategy):
    cfg = load_config(["--scaling.replicas=3", "--scaling.replicas_per_worker=3",
                       f"--outer.strategy={strategy}"])
    deltas = {r: {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(r)),
                  "b": torch.full((3,), float(r))} for r in range(3)}
    poisoned = {**deltas, 1: {"w": deltas[1]["w"].clone(), "b": deltas[1]["b"]}}
    poisoned[1]["w"][2, 1] = math.nan
    clean = {0: deltas[0], 2: deltas[2]}

    expected = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    reference = OuterSync(cfg.outer.model_copy(), replicas=2, seed=0)
    reference.step(expected, {0: clean[0], 1: clean[2]}, round_index=0)

    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    stats = OuterSync(cfg.outer, replicas=3, seed=0).step(params, poisoned, round_index=0)
    assert stats.dropped == [1] and not stats.skipped
    torch.testing.assert_close(params["w"], expected["w"])
    torch.testing.assert_close(params["b"], expected["b"])


def test_all_replicas_bad_skips_the_round():
    cfg = load_config([])
    sync = OuterSync(cfg.outer, replicas=2, seed=0)
    params = {"w": torch.ones(2, 2)}
    stats = sync.step(params, {0: {"w": torch.ones(2, 2)}, 1: {"w": torch.ones(2, 2)}},
                      round_index=0, diverged=[0, 1])
    assert stats.skipped and stats.dropped == [0, 1]
    assert torch.equal(params["w"], torch.ones(2, 2)) and sync.optimizer.steps == 0


def poison_replicas(monkeypatch, bad: set[int]):
    """Make the given replicas' inner steps end in NaN parameters and a NaN loss."""
    original = Replica.run_inner_steps

    def run_inner_steps(self, *args, **kwargs):
        delta, loss = original(self, *args, **kwargs)
        if self.index in bad:
            delta = {k: torch.full_like(v, math.nan) for k, v in delta.items()}
            loss = math.nan
        return delta, loss

    monkeypatch.setattr(Replica, "run_inner_steps", run_inner_steps)


def test_training_goes_on_without_a_diverged_replica(small_dataset, monkeypatch):
    poison_replicas(monkeypatch, {1})
    reports = []
    summary, params = run_local(load_config(RUN), small_dataset, reports=reports)
    assert "error" not in summary
    assert all(torch.isfinite(p).all() for p in params.values())
    assert [m["dropped_replicas"] for m in reports if m["round"] > 0] == [[1]] * 4
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_run_stops_after_max_bad_rounds_with_last_good_checkpoint(small_dataset, tmp_path,
                                                                  monkeypatch):
    cfg = load_config(RUN + ["--run.max_bad_rounds=2", "--run.checkpoint_every=1"])
    poison_replicas(monkeypatch, {0, 1})
    summary, params = run_local(cfg, small_dataset, checkpoints=tmp_path)
    assert summary["rounds"] == 2
    assert "every replica diverged" in summary["error"] and "2 consecutive rounds" in summary["error"]
    # Round 1 was skipped and checkpointed unchanged; round 2 stopped the run before saving.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000001"]
    saved, _, _ = checkpoint.load_shared(tmp_path / "round_000001")
    for name, value in saved.items():  # the initial parameters: skipped rounds change nothing
        assert torch.equal(value, params[name]) and torch.isfinite(value).all()
