"""A replica's state outside the round (workers/replica.py): `rejoin`, for a replica whose worker
missed syncs (lost, or replaced) and goes on from the global parameters."""

from __future__ import annotations

import torch

from isoloco_ray.config import load_config
from isoloco_ray.data.format import DatasetMeta
from isoloco_ray.data.stream import ReplicaStream, read_with_pyarrow, replica_share
from isoloco_ray.workers.model import Runtime, build_model
from isoloco_ray.workers.replica import Replica, snapshot_parameters


def test_a_rejoined_replica_goes_on_as_one_that_took_those_steps_from_the_global_parameters(
        small_dataset):
    cfg = load_config(["--model.preset=tiny", "--data.seq_len=64", "--data.batch_size=4",
                       "--inner.steps=3", "--run.rounds=6", "--inner.warmup=0.25"])
    vocab = DatasetMeta.load(small_dataset).vocab_size
    total = cfg.run.rounds * cfg.inner.steps

    def replica() -> tuple[Replica, torch.nn.Module, Runtime]:
        model = build_model(cfg.model, vocab, cfg.run.seed)
        stream = ReplicaStream(replica_share(small_dataset, 1, 2), read_with_pyarrow,
                               cfg.data.seq_len, cfg.data.batch_size, vocab_size=vocab)
        return (Replica(1, model, cfg.inner, total, stream),
                model, Runtime.create(model, torch.device("cpu"), "off", False))

    steps_done = 7  # mid-warmup, mid-round
    # The one that was there: it took the steps (its own θ_r, moments, schedule, stream).
    present, model, runtime = replica()
    present.run_inner_steps(model, runtime, steps_done, cfg.data.micro_batch_size)
    # The one that rejoins: it took none, had other moments, and its stream stood elsewhere.
    rejoined, model_b, runtime_b = replica()
    rejoined.run_inner_steps(model_b, runtime_b, 2, cfg.data.micro_batch_size)
    rejoined.feedback = {"x": torch.ones(1)}
    global_params = {name: p + 0.5 for name, p in snapshot_parameters(model).items()}

    rejoined.rejoin(steps_done, global_params)
    for name, p in rejoined.params.items():
        assert torch.equal(p, global_params[name])
    assert rejoined.optimizer.state == {} and rejoined.feedback == {}
    assert rejoined.schedule.last_epoch == present.schedule.last_epoch == steps_done
    assert rejoined.schedule.get_last_lr() == present.schedule.get_last_lr()  # bit for bit
    assert [g["lr"] for g in rejoined.optimizer.param_groups] == \
        [g["lr"] for g in present.optimizer.param_groups]
    assert rejoined.stream.position == present.stream.position
    # Both read the same batches from here on, and take the same next lr.
    torch.testing.assert_close(rejoined.stream.next_batch(), present.stream.next_batch(),
                               rtol=0, atol=0)
    rejoined.schedule.step()
    present.schedule.step()
    assert rejoined.schedule.get_last_lr() == present.schedule.get_last_lr()
