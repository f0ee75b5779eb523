"""Elastic worker counts: which counts a run may use, the layout at each, resuming on fewer or
more workers than the checkpoint was written with, and the placement check."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_RUN
from pydantic import ValidationError

from isoloco_ray.config import ScalingConfig, load_config
from isoloco_ray.elastic import allowed_counts_only, ray_scaling_config, round_down
from isoloco_ray.workers.local import StopAfterRound, run_local
from isoloco_ray.workers.parallel.layout import WorkerLayout, placement_warning

RUN = TINY_RUN + ["--inner.steps=2", "--run.rounds=4", "--run.checkpoint_every=2",
                  "--run.eval_tokens=512", "--run.eval_every=2"]


def test_worker_counts_divide_the_replicas():
    assert ScalingConfig(replicas=8, replicas_per_worker=1).worker_counts == [8]
    elastic = ScalingConfig(replicas=8, replicas_per_worker=1, min_workers=2)
    assert elastic.worker_counts == [2, 4, 8]
    assert [elastic.replicas_per_worker_at(w) for w in elastic.worker_counts] == [4, 2, 1]
    assert ScalingConfig(replicas=12, replicas_per_worker=2, min_workers=1).worker_counts == \
        [1, 2, 3, 4, 6]


@pytest.mark.parametrize(("fields", "message"), [
    ({"replicas": 8, "replicas_per_worker": 1, "min_workers": 3},
     r"scaling.min_workers \(3\) must be one of \[1, 2, 4, 8\]"),
    ({"replicas": 8, "replicas_per_worker": 2, "min_workers": 8},
     r"scaling.min_workers \(8\) must be one of \[1, 2, 4\]"),
    ({"replicas": 2, "replicas_per_worker": 1, "workers_per_replica": 2, "min_workers": 2},
     r"min_workers \(2\) has no effect with scaling.workers_per_replica \(2\) > 1: a replica "
     r"spread over several workers needs them all, so the run cannot shrink; remove it"),
])
def test_min_workers_outside_the_allowed_counts_is_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        ScalingConfig(**fields)


def test_layout_at_each_worker_count():
    scaling = ScalingConfig(replicas=4, replicas_per_worker=1, min_workers=1)
    for world, hosted in [(1, [range(4)]), (2, [range(2), range(2, 4)]),
                          (4, [range(r, r + 1) for r in range(4)])]:
        assert [WorkerLayout.create(scaling, rank, world).hosted
                for rank in range(world)] == hosted
    with pytest.raises(ValueError, match=r"3 workers but the scaling section allows \[1, 2, 4\]"):
        WorkerLayout.create(scaling, 0, 3)


def test_rays_count_is_rounded_down_to_an_allowed_one():
    allowed = [2, 4, 8]
    assert [round_down(n, allowed) for n in range(10)] == [0, 0, 2, 2, 4, 4, 4, 4, 8, 8]


def test_ray_scaling_config_is_elastic_only_with_min_workers():
    fixed = ray_scaling_config(ScalingConfig(replicas=4, replicas_per_worker=1))
    assert fixed.num_workers == 4 and not fixed.elasticity_enabled
    elastic = ray_scaling_config(ScalingConfig(replicas=4, replicas_per_worker=1,
                                               min_workers=2))
    assert elastic.elasticity_enabled and (elastic.min_workers, elastic.max_workers) == (2, 4)
    assert elastic.placement_strategy == "PACK"


def test_the_elastic_policy_uses_allowed_counts_only():
    """Inside allowed_counts_only the trainer's policy factory rounds Ray's count down to a
    divisor of R (and outside it Ray's own factory is back)."""
    import ray.train.v2.api.data_parallel_trainer as trainer_module

    scaling = ScalingConfig(replicas=8, replicas_per_worker=1, min_workers=2)
    stock = trainer_module.create_scaling_policy
    with allowed_counts_only(scaling):
        policy = trainer_module.create_scaling_policy(ray_scaling_config(scaling))
    assert trainer_module.create_scaling_policy is stock
    assert type(policy).__name__ == "ReplicaCountPolicy" and policy.allowed == (2, 4, 8)
    fixed = ray_scaling_config(ScalingConfig(replicas=8, replicas_per_worker=1))
    with allowed_counts_only(scaling):
        assert type(trainer_module.create_scaling_policy(fixed)).__name__ == \
            "FixedScalingPolicy"


def test_placement_warning_names_replicas_split_across_nodes():
    assert placement_warning(["a", "a", "b", "b"], 2) is None
    assert placement_warning(["a", "b", "c"], 1) is None
    warning = placement_warning(["a", "a", "a", "b", "b", "b"], 2)
    assert warning is not None and "replica slot(s) [1] are on different nodes" in warning


@pytest.mark.parametrize("flags", [
    ["--outer.strategy=diloco"], ["--outer.strategy=tsv"],
    # Owners on SparseLoCo's wire: the one worker's update residuals, split between the two.
    ["--outer.strategy=tsv", "--outer.comm_dtype=int2", "--outer.topk=0.25",
     "--outer.error_feedback=true"]], ids=["diloco", "tsv", "tsv-int2-owners"])
def test_resume_on_another_worker_count_keeps_the_math(small_dataset, tmp_path, flags):
    """A run checkpointed on 1 worker (R = 2 replicas on it) and resumed on 2 (one each), as
    after a node joins (or the reverse, after one is lost): the same model as the run that
    never stopped, within float tolerance (the merge is summed in another order)."""
    cfg = load_config(RUN + ["--scaling.replicas=2", "--scaling.replicas_per_worker=1",
                             "--scaling.min_workers=1", *flags])
    whole, whole_params = run_local(cfg, small_dataset, workers=1)
    with pytest.raises(StopAfterRound):
        run_local(cfg, small_dataset, workers=1, checkpoints=tmp_path, stop_after=3)
    resumed, resumed_params = run_local(cfg, small_dataset, workers=2,
                                        restore_from=tmp_path / "round_000002")
    for name in whole_params:
        torch.testing.assert_close(resumed_params[name], whole_params[name], rtol=0, atol=1e-6)
    assert resumed["final_eval_loss"] == pytest.approx(whole["final_eval_loss"], abs=1e-6)
    assert resumed["rounds"] == whole["rounds"] == 4
