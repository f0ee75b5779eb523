"""A GPU worker's bytes (gpu_memory.py): the state counted exactly, the refusal and warning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import TINY_RUN
from isoloco_ray import gpu_memory, train
from isoloco_ray.config import ConfigError, TrainConfig, load_config
from isoloco_ray.data.format import Dataset
from isoloco_ray.workers.local import in_gloo_group, local_env
from isoloco_ray.workers.loop import Trainer
from isoloco_ray.workers.model import parameter_shapes, parameters_of

TINY = TINY_RUN + ["--inner.steps=2", "--run.rounds=1", "--data.micro_batch_size=2",
                   "--run.eval_tokens=256"]


def held_bytes(trainer: Trainer) -> int:
    """The bytes of every distinct storage a worker's training state holds after a round:
    the model and its gradients, θ, the replicas' parameters, AdamW moments and residuals,
    the outer momentum (AdamW's 0-dim step counters aside)."""
    storages: dict[int, int] = {}

    def add(tensor: torch.Tensor | None) -> None:
        if tensor is not None and tensor.dim() > 0:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    for p in trainer.model.parameters():
        add(p)
        add(p.grad)
    for tensor in trainer.global_params.values():
        add(tensor)
    for replica in trainer.replicas:
        for tensor in [*replica.params.values(), *replica.feedback.values()]:
            add(tensor)
        for state in replica.optimizer.state.values():
            for tensor in state.values():
                add(tensor)
    for tensor in trainer.outer.optimizer.buffers.values():
        add(tensor)
    return sum(storages.values())


@pytest.mark.parametrize("flags", [
    ["--scaling.replicas=2", "--scaling.replicas_per_worker=2"],
    ["--scaling.replicas=1", "--scaling.replicas_per_worker=1"],  # the replica in the model
    ["--scaling.replicas=2", "--scaling.replicas_per_worker=2", "--outer.comm_dtype=int8",
     "--outer.error_feedback=true", "--outer.strategy=tsv"],
    ["--scaling.replicas=2", "--scaling.replicas_per_worker=2", "--outer.fragments=2",
     "--outer.mix=0.5", "--outer.strategy=ties"],  # streaming: replicas keep their own θ_r
    # Muon: one moment of each hidden matrix, AdamW's two of the rest.
    ["--scaling.replicas=2", "--scaling.replicas_per_worker=2", "--inner.optimizer=muon"],
])
def test_the_state_is_counted_exactly(small_dataset, flags):
    cfg = load_config(TINY + flags)
    trainer = Trainer(cfg, small_dataset, local_env())
    trainer.run()
    vocab = Dataset.open(small_dataset).meta.vocab_size
    memory = gpu_memory.estimate(cfg, parameter_shapes(cfg.model, vocab), vocab)
    assert memory.state_bytes == held_bytes(trainer)
    assert memory.state["parameters"] == 4 * parameters_of(cfg.model, vocab)


def held_by_rank(rank: int, world: int, config: dict[str, Any], data: str) -> int:
    trainer = Trainer(TrainConfig.model_validate(config), Path(data), local_env(rank, world))
    trainer.run()
    return held_bytes(trainer)


@pytest.mark.parametrize("flags", [
    ["--outer.strategy=diloco"],  # each position's outer group: every rank merges its share
    ["--outer.strategy=isoloco", "--outer.placement=sharded"],  # owners within each share
    ["--outer.strategy=diloco", "--outer.comm_dtype=int8", "--outer.error_feedback=true"],
])
def test_the_state_of_a_replica_spread_over_two_workers_is_counted_exactly(small_dataset,
                                                                          flags):
    """R = 2 replicas × G = 2 workers: the busiest worker's state, with the outer momentum of
    its position's share only."""
    cfg = load_config(TINY + ["--scaling.replicas=2", "--scaling.replicas_per_worker=1",
                              "--scaling.workers_per_replica=2", "--data.micro_batch_size=1",
                              *flags])
    held = in_gloo_group(held_by_rank, 4, cfg.model_dump(mode="json"), str(small_dataset))
    vocab = Dataset.open(small_dataset).meta.vocab_size
    memory = gpu_memory.estimate(cfg, parameter_shapes(cfg.model, vocab), vocab)
    assert memory.state_bytes == max(held)
    assert 0 < memory.state["outer momentum"] < memory.state["parameters"]  # a share only


def test_more_replicas_per_worker_than_fit_are_refused_with_the_fix():
    cfg = load_config(["--model.preset=512M", "--scaling.replicas=8",
                       "--scaling.replicas_per_worker=8", "--scaling.use_gpu=true",
                       "--data.seq_len=1024"])
    memory = gpu_memory.estimate(cfg, parameter_shapes(cfg.model, 32000), 32000)
    # 512M float32 parameters: θ, the model, gradients, 8 replicas' own copies and AdamW
    # moments, and (one worker) the outer momentum of every tensor.
    assert memory.state_bytes / 2**30 == pytest.approx(4 * 512.4e6 * (3 + 8 + 16 + 1) / 2**30,
                                                        rel=1e-3)
    with pytest.raises(ConfigError, match=(
            r"^scaling.replicas_per_worker: one GPU worker would hold 53.4 GiB of training "
            r"state \(AdamW moments 30.5, replicas' own parameters 15.3, .*\), more than its "
            r"GPU's 40.0 GiB; lower scaling.replicas_per_worker \(more workers, each hosting "
            r"fewer replicas; with scaling.min_workers, raise it too\) or choose a smaller "
            r"model$")):
        memory.check(40 * 2**30)
    warning = memory.check(64 * 2**30)
    assert warning is not None and warning.startswith(
        f"warning: one GPU worker is estimated to peak at {memory.peak_bytes / 2**30:.1f} GiB "
        "of its GPU's 64.0 GiB (state 53.4; activations ")
    assert warning.endswith("set model.activation_checkpointing=true, lower "
                            "data.micro_batch_size or scaling.replicas_per_worker")
    assert memory.check(141 * 2**30) is None  # an H200


def test_activation_checkpointing_and_more_workers_lower_the_estimate():
    base = ["--model.preset=178M", "--scaling.replicas=8", "--scaling.use_gpu=true",
            "--data.seq_len=2048"]

    def of(flags: list[str]) -> gpu_memory.GpuMemory:
        cfg = load_config(base + flags)
        return gpu_memory.estimate(cfg, parameter_shapes(cfg.model, 32000), 32000)

    kept, recomputed = of([]), of(["--model.activation_checkpointing=true"])
    assert recomputed.state == kept.state
    assert recomputed.step["activations"] < kept.step["activations"] / 5
    assert of(["--scaling.replicas_per_worker=1"]).state_bytes < kept.state_bytes
    # The outer momentum a worker holds follows the route: all of it where every worker merges
    # (diloco's float32 sums all-reduced, or rank0's rank 0); where owners merge (bfloat16),
    # the busiest owner's share of the 8 workers' plan: at least an even share and the largest
    # tensor (the 32000 x 1024 embedding), which it cannot split.
    every = 4 * parameters_of(load_config(base).model, 32000)

    def momentum(flags: list[str]) -> int:
        return of(["--scaling.replicas_per_worker=1", *flags]).state["outer momentum"]

    assert momentum([]) == momentum(["--outer.placement=rank0"]) == every
    assert every > momentum(["--outer.comm_dtype=bfloat16"]) >= max(every / 8, 4 * 32000 * 1024)


def test_a_gpu_run_that_cannot_fit_is_refused_before_training(
        small_dataset, tmp_path, capsys, monkeypatch, cluster_without_gpus):
    import ray

    from isoloco_ray import cuda_check

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    monkeypatch.setattr(cuda_check, "check_cuda_on_gpu_nodes", lambda memory: (
        cuda_check.check_memory(memory, [2**20, 2**30])))  # a 1 MiB GPU and a 1 GiB one
    status = train.main(["--model.preset=tiny", f"--data.path={small_dataset}",
                         "--data.seq_len=64", "--scaling.replicas=2",
                         "--scaling.replicas_per_worker=1", "--scaling.use_gpu=true",
                         f"--run.storage_path={tmp_path}"])
    assert status == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: model.preset: one GPU worker would hold 0.0 GiB of "
                           "training state (")  # one replica per worker: no fewer to host
    assert last.endswith("more than its GPU's 0.0 GiB; choose a smaller model (model.preset) "
                         "or GPUs with more memory")


def test_a_grid_checks_its_hungriest_gpu_trial(small_dataset, tmp_path):
    from helpers import write_grid
    from isoloco_ray.grids.cluster import largest_gpu_memory
    from isoloco_ray.grids.plan import plan_grid

    grid = write_grid(tmp_path, small_dataset, grid={"scaling.replicas_per_worker": [1, 2]})
    assert largest_gpu_memory(plan_grid(grid, [])) is None  # no GPU trial
    plan = plan_grid(grid, ["--scaling.use_gpu=true"])
    hungriest = largest_gpu_memory(plan)
    vocab = Dataset.open(small_dataset).meta.vocab_size
    each = [gpu_memory.estimate(t.config, parameter_shapes(t.config.model, vocab), vocab)
            for t in plan.trials]
    assert [t.config.scaling.replicas_per_worker for t in plan.trials] == [1, 2]
    assert hungriest == each[1] and each[1].state_bytes > each[0].state_bytes
