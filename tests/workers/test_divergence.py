"""A run that goes non-finite stops with an error and a finite last checkpoint; strict JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import TINY_RUN

from isoloco_ray import driver, strict_json, train
from isoloco_ray.config import load_config
from isoloco_ray.data.format import DataError
from isoloco_ray.data.stream import ReplicaStream
from isoloco_ray.workers import loop, replica
from isoloco_ray.workers.local import run_local
from isoloco_ray.workers.outer.step import OuterSync
from isoloco_ray.workers.state import checkpoint

RUN = TINY_RUN + ["--scaling.replicas=2", "--scaling.replicas_per_worker=2", "--inner.steps=2",
                  "--run.rounds=3", "--run.checkpoint_every=1", "--run.eval_tokens=512",
                  "--run.eval_every=1"]


def assert_finite_checkpoints(directory):
    for saved in directory.iterdir():
        params, _, _ = checkpoint.load_shared(saved)
        assert all(torch.isfinite(p).all() for p in params.values()), saved.name


def test_an_outer_step_that_overflows_stops_the_run_before_saving(small_dataset, tmp_path,
                                                                  monkeypatch):
    real = OuterSync.step

    def step(self, global_params, *args, **kwargs):  # e.g. a huge outer.lr overflowing float32
        stats = real(self, global_params, *args, **kwargs)
        if args[1] == 1:  # round_index: the second round
            next(iter(global_params.values()))[0] = math.inf
        return stats

    monkeypatch.setattr(OuterSync, "step", step)
    cfg = load_config(RUN + ["--outer.strategy=diloco_sgd", "--outer.lr=2.5"])
    summary, _ = run_local(cfg, small_dataset, checkpoints=tmp_path)
    assert summary["rounds"] == 2
    assert summary["error"].startswith(
        "the global parameters are not finite after the outer step of round 2 "
        "(outer.strategy diloco_sgd, outer.lr 2.5)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000001"]  # none of a NaN model
    assert_finite_checkpoints(tmp_path)


def test_a_non_finite_validation_loss_stops_the_run(small_dataset, tmp_path, monkeypatch):
    calls = []

    def evaluate(*args, **kwargs):
        calls.append(1)
        return 2.0 if len(calls) < 3 else math.inf

    monkeypatch.setattr(loop, "evaluate", evaluate)
    summary, _ = run_local(load_config(RUN), small_dataset, checkpoints=tmp_path)
    assert summary["rounds"] == 2 and "validation loss is inf" in summary["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000001"]


def test_adamw_ddp_skips_non_finite_rounds_and_stops_after_max_bad_rounds(
        small_dataset, tmp_path, monkeypatch):
    real = replica.accumulate_gradients
    poisoned_from_round = 2  # rounds are 1-based in reports; round 2's steps get NaN gradients
    state = {"steps": 0}

    def accumulate_gradients(runtime, batch, micro_batch_size, before_last_backward=None):
        loss = real(runtime, batch, micro_batch_size, before_last_backward)
        state["steps"] += 1
        if state["steps"] > (poisoned_from_round - 1) * 2 * 2:  # 2 steps x 2 hosted replicas
            for p in runtime.forward.parameters():
                p.grad.fill_(math.nan)
        return loss

    monkeypatch.setattr(replica, "accumulate_gradients", accumulate_gradients)
    cfg = load_config(RUN + ["--outer.strategy=adamw_ddp", "--run.rounds=5",
                             "--run.max_bad_rounds=2"])
    reports = []
    summary, params = run_local(cfg, small_dataset, checkpoints=tmp_path, reports=reports)
    assert summary["rounds"] == 3
    assert "2 consecutive rounds" in summary["error"]
    assert [m["dropped_replicas"] for m in reports if m["round"] > 0] == [[], [0, 1]]
    assert all(torch.isfinite(p).all() for p in params.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000001", "round_000002"]
    assert_finite_checkpoints(tmp_path)
    # The skipped round left the parameters as round 1 ended.
    round1, _, _ = checkpoint.load_shared(tmp_path / "round_000001")
    round2, _, _ = checkpoint.load_shared(tmp_path / "round_000002")
    assert all(torch.equal(round1[name], round2[name]) for name in round1)


def test_a_data_error_in_a_replica_stops_the_run_with_its_message(small_dataset, monkeypatch):
    real = ReplicaStream.next_batch
    calls = {"n": 0}

    def next_batch(self):
        calls["n"] += 1
        if calls["n"] == 7:  # round 2 (2 replicas x 2 steps a round), replica 0's 2nd step
            raise DataError("train/part-00001.parquet: token id 99999 >= vocabulary 384")
        return real(self)

    monkeypatch.setattr(ReplicaStream, "next_batch", next_batch)
    summary, _ = run_local(load_config(RUN), small_dataset)
    assert summary["rounds"] == 1
    assert summary["error"] == ("worker 0 in round 2: train/part-00001.parquet: token id 99999 "
                                ">= vocabulary 384")


def test_strict_json_writes_null_for_non_finite_values():
    text = strict_json.dumps({"a": math.nan, "b": [1.0, -math.inf], "c": {"d": math.inf},
                              "e": 2, "f": "nan"})
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None}, "e": 2, "f": "nan"}
    with pytest.raises(ValueError):  # what the standard library would have written instead
        json.dumps({"a": math.nan}, allow_nan=False)


def test_summary_json_is_strict(tmp_path, small_dataset):
    cfg = load_config(RUN)
    summary = driver.write_summary(cfg, {"final_eval_loss": 3.0,
                                         "final_eval_perplexity": math.inf},
                                   small_dataset, tmp_path, 1.0)
    text = (tmp_path / "summary.json").read_text()
    assert "Infinity" not in text and json.loads(text)["final_eval_perplexity"] is None
    assert summary["final_eval_perplexity"] == math.inf


def test_a_run_that_stopped_exits_1_without_a_summary(small_dataset, tmp_path, monkeypatch,
                                                       capsys):
    monkeypatch.setattr(train, "start_ray", lambda cfg, **options: None)
    monkeypatch.setattr(driver, "fit", lambda *args, **kwargs: {
        "error": "the global parameters are not finite after the outer step of round 1",
        "rounds": 1})
    status = train.main(RUN + [f"--data.path={small_dataset}", f"--run.storage_path={tmp_path}",
                               "--run.name=nan-run"])
    assert status == 1
    assert "the run stopped after round 1: the global parameters are not finite" in \
        capsys.readouterr().err
    assert not (tmp_path / "nan-run" / "summary.json").exists()


def test_a_failing_metrics_logger_is_reported_once_and_the_record_goes_on(tmp_path, capsys):
    import threading

    from ray.util.queue import Empty

    class Queue:  # ray.util.queue.Queue's interface, in process
        def __init__(self, items):
            self.items = list(items)

        def get(self, timeout):
            if not self.items:
                raise Empty
            return self.items.pop(0)

        def empty(self):
            return not self.items

    reports = [{"round": r, "tokens": r, "eval_loss": 2.0, "eval_perplexity": 7.4}
               for r in range(3)]
    calls = []

    def failing_logger(metrics):
        calls.append(metrics["round"])
        raise ConnectionError("W&B is unreachable")

    stop = threading.Event()
    stop.set()
    driver.follow_progress(Queue(reports), 3, tmp_path / "metrics.jsonl", stop, failing_logger)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2]
    assert calls == [0]
    err = capsys.readouterr().err
    assert err.count("warning: logging round 0 failed (ConnectionError: W&B is unreachable)") == 1


def test_an_out_of_vocabulary_id_on_one_rank_stops_both_ranks_naming_the_shard(
        small_dataset, tmp_path):
    """Replica 1 (on rank 1) reads a shard with a bad id: both gloo ranks stop together,
    with its name, rather than rank 0 waiting forever in the next collective."""
    import shutil

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from isoloco_ray.data.format import split_files

    data = tmp_path / "data"
    shutil.copytree(small_dataset, data)
    bad = split_files(data, "train")[1]  # replica 1 of 2 reads shards 1, 3, ...
    rows = pq.read_table(bad).column("tokens").to_pylist()
    rows[0][5] = 99_999
    pq.write_table(pa.table({"tokens": pa.array([np.asarray(r, np.int32) for r in rows],
                                                 pa.list_(pa.int32()))}), bad)
    cfg = load_config(RUN + ["--scaling.replicas_per_worker=1"])
    summary, _ = run_local(cfg, data)
    assert summary["rounds"] == 0
    assert summary["error"].startswith(f"worker 1 in round 1: {bad}: token id 99999 is outside "
                                       "the model's vocabulary (0..383)")


# -- finished, but no success ------------------------------------------------------------------


@pytest.mark.parametrize("lr, reason", [
    ("1e30", "every replica diverged in the last 2 round(s), which were skipped"),
    ("1e6", "the final eval loss 5.9506 is no better than a uniform prediction's (ln V = "
            "5.9506): lower outer.lr or inner.lr"),
], ids=["last-rounds-skipped", "uniform"])
def test_a_destroyed_model_finishes_as_diverged_not_done(small_dataset, lr, reason):
    """A finite but absurd outer.lr: every replica non-finite and the last rounds skipped, or
    weights so large the model predicts uniformly (eval loss ln V)."""
    summary, _ = run_local(load_config(RUN + [f"--outer.lr={lr}"]), small_dataset)
    assert summary["status"] == "diverged" and summary["diverged"] == reason
    healthy, _ = run_local(load_config(RUN), small_dataset)
    assert healthy["status"] == "done" and "diverged" not in healthy


def test_the_train_cli_says_a_run_diverged_last_and_exits_1(small_dataset, tmp_path, capsys,
                                                            monkeypatch):
    """What the workers return for a destroyed model: summary.json with its status and reason,
    the reason as the last line, exit status 1 (the model is exported, marked: test_export)."""
    cfg = load_config(RUN + ["--outer.lr=1e6"])
    final, _ = run_local(cfg, small_dataset)
    monkeypatch.setattr(train, "start_ray", lambda *args, **kwargs: None)
    monkeypatch.setattr(driver, "fit", lambda *args, **kwargs: dict(final))
    assert train.main(RUN + ["--outer.lr=1e6", f"--data.path={small_dataset}",
                             f"--run.storage_path={tmp_path}", "--run.name=destroyed"]) == 1
    out, err = capsys.readouterr()
    summary = json.loads((tmp_path / "destroyed" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged"] == final["diverged"]
    assert out.strip().splitlines()[-1] == f"summary: {tmp_path / 'destroyed' / 'summary.json'}"
    assert err.strip().splitlines()[-1] == (
        f"error: the run diverged: {final['diverged']}; its model is in "
        f"{tmp_path / 'destroyed' / 'model'}, marked DIVERGED.txt")
