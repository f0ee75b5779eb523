"""Ray Train's worker count for a run: fixed (R·G/V), or elastic within scaling.worker_counts.

With `scaling.min_workers` the TorchTrainer gets `num_workers=(min, max)`: Ray Train V2 starts
with as many workers as the cluster has room for (at least min), restarts from the latest
checkpoint with fewer after losing a node, and with more when nodes join (checked every
`elastic_resize_monitor_interval_s`). Ray would pick any count in the range; a count that
does not divide R would leave replicas split unevenly, so `ReplicaCountPolicy` rounds Ray's
count down to the nearest allowed one. Ray 2.60 has no public hook for that: its trainer builds
the policy with `create_scaling_policy` (ray.train.v2.api.data_parallel_trainer), which
`allowed_counts_only` replaces while a trainer's `fit()` runs. The policy object travels to
Ray Train's controller by pickle, so the class lives here, importable wherever the package is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from isoloco_ray.config import ScalingConfig
from isoloco_ray.env_settings import read_env

# How often a running elastic job checks whether the cluster now fits another worker count:
# ISOLOCO_RAY_RESIZE_CHECK_SECONDS (env_settings.py), 60 s as Ray's default (a restart costs a
# checkpoint's worth of rounds, so not much sooner); set lower by tests and benchmarks that
# add a node and cannot wait.


def ray_scaling_config(scaling: ScalingConfig) -> Any:
    """The ray.train.ScalingConfig of a run: R·G/V workers, or (min_workers, R·G/V)."""
    import ray.train

    counts = scaling.worker_counts
    elastic = len(counts) > 1
    return ray.train.ScalingConfig(
        num_workers=(counts[0], counts[-1]) if elastic else counts[0],
        use_gpu=scaling.use_gpu, resources_per_worker={"CPU": scaling.worker_cpus},
        # Ranks are contiguous per node, so PACK keeps a replica's G workers (ranks
        # g·G … g·G+G-1), which all-reduce every inner step, on one node (checked at start:
        # layout_warning).
        placement_strategy="PACK",
        **({"elastic_resize_monitor_interval_s": read_env().resize_check_seconds}
           if elastic else {}))


def round_down(count: int, allowed: Sequence[int]) -> int:
    """The largest allowed worker count not above `count`; 0 when none is (keep waiting)."""
    return max((a for a in allowed if a <= count), default=0)


def _policy_class() -> type:
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    class ReplicaCountPolicy(ElasticScalingPolicy):
        """Ray's elastic policy, with every count it finds rounded down to an allowed one."""

        allowed: tuple[int, ...] = ()

        def _count_possible_workers(self, reserved_resources: Any) -> int:
            return round_down(super()._count_possible_workers(reserved_resources),
                              self.allowed)

    ReplicaCountPolicy.__module__ = __name__
    ReplicaCountPolicy.__qualname__ = "ReplicaCountPolicy"
    return ReplicaCountPolicy


try:
    ReplicaCountPolicy: type | None = _policy_class()
except ImportError:  # a Ray without Train V2's policies: elastic runs are refused (below)
    ReplicaCountPolicy = None


@contextlib.contextmanager
def allowed_counts_only(scaling: ScalingConfig) -> Iterator[None]:
    """While inside, an elastic TorchTrainer's fit() uses only scaling.worker_counts."""
    if len(scaling.worker_counts) == 1:
        yield
        return
    try:
        import ray.train.v2.api.data_parallel_trainer as trainer_module
    except ImportError:
        trainer_module = None
    if ReplicaCountPolicy is None or not hasattr(trainer_module, "create_scaling_policy"):
        raise RuntimeError("scaling.min_workers needs Ray Train V2's elastic scaling (Ray "
                           "2.60, RAY_TRAIN_V2_ENABLED unset or 1); unset scaling.min_workers")
    stock = trainer_module.create_scaling_policy

    def create(ray_scaling: Any) -> Any:
        if not ray_scaling.elasticity_enabled:
            return stock(ray_scaling)
        policy = ReplicaCountPolicy(scaling_config=ray_scaling)
        policy.allowed = tuple(scaling.worker_counts)
        return policy

    trainer_module.create_scaling_policy = create
    try:
        yield
    finally:
        trainer_module.create_scaling_policy = stock
